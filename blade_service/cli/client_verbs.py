"""The client verbs: one per API route, over HTTP with `client.BladeClient` (BLADE_API_URL, BLADE_API_KEY).

Lists page through every cursor page; output is a table (or `--json`). Examples:

    blade submit --base-model demo-tiny --forget f.jsonl --retain r.jsonl --set max_steps=60 --wait
    blade status req_... --events              # the request, then its training dynamics as a table
    blade requests --status running            # blade cancel req_... · blade events req_... --follow
    blade download ad_... --out adapter/       # the PEFT dir, extracted and sha256-checked
    blade certificate req_... --out cert.json  # then: blade verify-certificate cert.json
    blade datasets list|show|upload|delete · blade base-models list|show|register|adapters
    blade rollback ad_... --reason "..." [--cascade] [--enable]
    blade generate demo-tiny --question "Where was ... born?"  # or a raw prompt to continue
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from blade_service.cli.main import CliError

REQUEST_COLUMNS = ["id", "status", "base_model", "method", "progress", "adapter_id", "created_at"]
ADAPTER_COLUMNS = ["id", "version", "state", "request_id", "method", "trained_on_stale", "created_at"]
DATASET_COLUMNS = ["id", "name", "kind", "format", "rows", "size_bytes", "created_at", "purged_at"]
MODEL_COLUMNS = ["name", "source", "shared", "description", "created_at"]
AUDIT_COLUMNS = ["id", "created_at", "actor", "action", "subject_id", "reason"]
WEBHOOK_COLUMNS = ["id", "url", "events", "created_at", "disabled_at"]
DELIVERY_COLUMNS = ["id", "event", "status", "attempts", "last_status_code", "created_at", "delivered_at"]
KEY_COLUMNS = ["id", "name", "prefix", "scopes", "tenant", "created_at", "revoked_at"]
FAILED = frozenset({"failed", "cancelled", "rejected"})


def _common(p: argparse.ArgumentParser, *, json_flag: bool = True) -> argparse.ArgumentParser:
    p.add_argument("--url", default=None, help="the API (default BLADE_API_URL or http://BLADE_HOST:PORT)")
    p.add_argument("--key", default=None, help="API key (default BLADE_API_KEY)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    return p


class _NamesTheMethods(argparse.HelpFormatter):
    """Lists the methods in `--method`'s help when the help is printed, not whenever `blade` starts."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "--method" not in action.option_strings:
            return super()._get_help_string(action)
        # lazy: the methods' configs are pydantic models, about 0.1 s on every `blade` start otherwise
        from blade_service.contracts.methods import METHOD_NAMES

        return f"one of {', '.join(METHOD_NAMES)} (default: blade)"


def _verb(subparsers: Any, name: str, func: Callable[[argparse.Namespace], int], helptext: str, **kw: Any):
    p = _common(subparsers.add_parser(name, help=helptext, description=helptext), **kw)
    p.set_defaults(func=func)
    return p


def register(subparsers: argparse._SubParsersAction) -> None:
    p = _verb(subparsers, "submit", run_submit, "submit an unlearn request")
    p.add_argument("--base-model", required=True, help="a registered base model (blade base-models list)")
    p.add_argument("--forget", required=True, help="a dataset id, or a file to upload first")
    p.add_argument("--retain", required=True, help="a dataset id, or a file to upload first")
    p.add_argument("--method", default=None, help="the method (default: blade)")
    p.formatter_class = _NamesTheMethods
    p.add_argument("--preset", default=None, help="a named config of the method (e.g. tofu, muse, lora)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a method parameter")
    p.add_argument("--metadata", default=None, help="a JSON object stored with the request")
    retry = "a retry with this key gets the first request back, not a second"
    p.add_argument("--idempotency-key", default=None, help=retry)
    p.add_argument("--wait", action="store_true", help="show live progress until it ends, then a summary")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits (default: 3600)")

    p = _verb(subparsers, "status", run_status, "show an unlearn request")
    p.add_argument("request_id")
    p.add_argument("--events", action="store_true", help="also the training dynamics, as a table")
    p.add_argument("--wait", action="store_true", help="show live progress until it ends, then a summary")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits (default: 3600)")

    p = _verb(subparsers, "requests", run_requests, "list unlearn requests (newest first)")
    p.add_argument("--status", default=None)
    p.add_argument("--base-model", default=None)
    p.add_argument("--limit", type=int, default=None, help="at most this many (default: all)")

    p = _verb(subparsers, "cancel", run_cancel, "cancel an unlearn request")
    p.add_argument("request_id")
    p.add_argument("--reason", default=None)

    p = _verb(subparsers, "events", run_events, "a request's training dynamics, one row per outer step")
    p.add_argument("request_id")
    p.add_argument("--follow", action="store_true", help="keep printing new steps until the request ends")
    p.add_argument("--interval", type=float, default=1.0)

    p = _verb(subparsers, "metrics", run_metrics, "a request's forget/retain metrics before and after")
    p.add_argument("request_id")

    p = _verb(subparsers, "certificate", run_certificate, "fetch a request's signed deletion certificate")
    p.add_argument("request_id")
    p.add_argument("--out", type=Path, default=None, help="write it here (default: print it)")
    p.add_argument("--html", action="store_true", help="the printable HTML page instead of the JSON")

    p = _verb(subparsers, "rollback", run_rollback, "disable (or --enable) an adapter version")
    p.add_argument("adapter_id")
    p.add_argument("--reason", required=True)
    how = p.add_mutually_exclusive_group()  # one way to change the stack per call
    how.add_argument("--cascade", action="store_true", help="also disable adapters trained on top of it")
    how.add_argument("--enable", action="store_true", help="restore the adapter instead")
    how.add_argument(
        "--retrain", action="store_true", help="re-run the later versions' requests on the new stack instead"
    )

    p = _verb(subparsers, "retrain", run_retrain, "re-run an adapter version's request on the current stack")
    p.add_argument("adapter_id")
    p.add_argument("--reason", required=True)
    p.add_argument("--forget", default=None, help="its purged forget data again: a dataset id or a file")

    p = _verb(subparsers, "adapter", run_adapter, "show one adapter version")
    p.add_argument("adapter_id")

    p = _verb(subparsers, "download", run_download, "download an adapter version as a PEFT directory")
    p.add_argument("adapter_id")
    p.add_argument("--out", type=Path, required=True, help="directory to extract into (or file, --archive)")
    p.add_argument("--archive", action="store_true", help="keep the .tar.gz instead of extracting it")

    p = _verb(subparsers, "generate", run_generate, "greedy completion by a base model and its active stack")
    p.add_argument("base_model")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("prompt", nargs="?", help="raw text to continue")
    text.add_argument(
        "--question", "-q", help="a question, asked the way the model's forget and retain rows ask it"
    )
    p.add_argument("--max-new-tokens", type=int, default=None)
    tenant_help = "the operator: the tenant whose model it is (names are per tenant)"
    p.add_argument("--tenant", default=None, help=tenant_help)

    p = _verb(subparsers, "compact", run_compact, "merge a model's active stack into one version (admin)")
    p.add_argument("base_model")
    p.add_argument("--tenant", default=None, help=tenant_help)
    p.add_argument("--reason", required=True)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--wait", action="store_true", help="poll until the compaction ends; exit 1 if it failed")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits at most")

    p = _verb(subparsers, "export", run_export, "the effective model as one adapter or merged weights")
    p.add_argument("base_model")
    p.add_argument("--tenant", default=None, help=tenant_help)
    p.add_argument("--out", type=Path, required=True, help="directory to extract into (or file, --archive)")
    p.add_argument("--format", choices=("adapter", "merged"), default="adapter")
    p.add_argument("--archive", action="store_true", help="keep the .tar.gz instead of extracting it")

    group = subparsers.add_parser("datasets", help="forget/retain datasets: list, show, upload, delete")
    verbs = group.add_subparsers(dest="verb", required=True)
    p = _verb(verbs, "list", run_datasets_list, "your datasets (newest first)")
    p.add_argument("--all", action="store_true", help="also the records of deleted or purged ones")
    _verb(verbs, "show", run_dataset_show, "one dataset").add_argument("dataset_id")
    _verb(verbs, "upload", run_dataset_upload, "upload and validate a dataset file").add_argument(
        "file", type=Path
    )
    _verb(verbs, "delete", run_dataset_delete, "delete a dataset's bytes").add_argument("dataset_id")

    group = subparsers.add_parser("base-models", help="base-model registry: list, show, register, adapters")
    verbs = group.add_subparsers(dest="verb", required=True)
    p = _verb(verbs, "list", run_models_list, "registered base models: your tenant's and the shared ones")
    p.add_argument("--tenant", default=None, help="the operator: another tenant's and the shared ones")
    p = _verb(verbs, "show", run_model_show, "one base model")
    p.add_argument("name")
    p.add_argument("--tenant", default=None, help=tenant_help)
    p = _verb(verbs, "register", run_model_register, "register a base model (admin)")
    p.add_argument("name")
    p.add_argument("source", help="a hub id; the operator may also name a model directory or storage key")
    p.add_argument("--description", default=None)
    p.add_argument("--revision", default=None, help="pin a hub revision")
    p.add_argument("--shared", action="store_true", help="the operator only: visible to every tenant")
    p.add_argument("--tenant", default=None, help="the operator only: register it for this tenant")
    p = _verb(verbs, "adapters", run_adapters, "the model's adapter stack in order")
    p.add_argument("name")
    p.add_argument("--tenant", default=None, help=tenant_help)
    p = _verb(verbs, "retention", run_model_retention, "show, or with --set change, forget-data retention")
    p.add_argument("name")
    p.add_argument("--tenant", default=None, help=tenant_help)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=SECONDS", help="e.g. failure_s=3600")
    p = _verb(verbs, "policy", run_model_policy, "show, or change, a model's unlearning policy or canary set")
    p.add_argument("name")
    p.add_argument("--tenant", default=None, help=tenant_help)
    p.add_argument("--reason", default=None, help="why (required to change it; audited)")
    p.add_argument(
        "--set", action="append", default=[], metavar="RULE=VALUE", help="a policy rule (VALUE off: no limit)"
    )
    p.add_argument("--canary-dataset", default=None, help="a dataset id to measure utility on")
    p.add_argument("--clear-canary", action="store_true")

    group = subparsers.add_parser("keys", help="API keys of your tenant (admin): list, create, revoke; me")
    verbs = group.add_subparsers(dest="verb", required=True)
    _verb(verbs, "list", run_keys_list, "your tenant's keys")
    p = _verb(verbs, "create", run_key_create, "a new key (its secret is printed once)")
    p.add_argument("name")
    p.add_argument("--scope", action="append", required=True, choices=("read", "submit", "admin"))
    p.add_argument("--tenant", default=None)
    _verb(verbs, "revoke", run_key_revoke, "revoke a key").add_argument("key_id")
    _verb(verbs, "me", run_me, "the key you call with")

    group = subparsers.add_parser("webhooks", help="signed event callbacks (admin): list, create, disable")
    verbs = group.add_subparsers(dest="verb", required=True)
    _verb(verbs, "list", run_webhooks_list, "your tenant's webhook endpoints")
    p = _verb(verbs, "create", run_webhook_create, "a new endpoint (its signing secret is printed once)")
    p.add_argument("url")
    p.add_argument("--event", action="append", default=[], help="an event to send (default: every event)")
    p.add_argument("--allow-loopback", action="store_true")
    _verb(verbs, "disable", run_webhook_disable, "stop sending to an endpoint").add_argument("webhook_id")
    _verb(verbs, "deliveries", run_webhook_deliveries, "an endpoint's delivery log").add_argument(
        "webhook_id"
    )

    p = _verb(subparsers, "audit", run_audit, "the audit log (newest first), or --verify its hash chain")
    p.add_argument("--action", default=None)
    p.add_argument("--subject", default=None, help="a subject id (request, adapter, dataset)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (0: all)")
    p.add_argument("--verify", action="store_true", help="recompute the hash chain instead")

    _verb(subparsers, "health", run_health, "is the API up and ready (database, broker)?")


# --- plumbing -----------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace):
    from blade_service.client import BladeClient
    from blade_service.persistence.settings import get_settings

    settings = get_settings()
    url = args.url or settings.api_url or f"http://{settings.host}:{settings.port}"
    return BladeClient(url, api_key=args.key or settings.api_key)


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False)


def _call(args: argparse.Namespace, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(client)`; API and network errors become one-paragraph CliErrors."""
    import httpx

    from blade_service.client import ApiError

    with _client(args) as client:
        try:
            return fn(client)
        except ApiError as exc:
            where = f" (field {exc.field})" if exc.field else ""
            raise CliError(f"the API answered {exc.status} {exc.code}{where}: {exc.message}") from None
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach the API at {client.base_url}: {exc}") from None
        except TimeoutError as exc:
            raise CliError(str(exc)) from None


def _show(
    args: argparse.Namespace, doc: Any, columns: list[str] | None = None, title: str | None = None
) -> None:
    from blade_service.cli import display

    if getattr(args, "json", False):
        display.print_json(doc)
    elif isinstance(doc, list):
        display.print_table(_console(), [_row(d) for d in doc], columns or list(doc[0] if doc else []), title)
    else:
        display.print_record(_console(), _row(doc), title)
    _convergence_line(doc)


def _convergence_line(doc: Any) -> None:
    """One line (stderr, so JSON output stays clean) for a run that stopped without converging."""
    if isinstance(doc, dict) and doc.get("converged") is False:
        print(
            f"warning: request {doc.get('id')} did not converge: it ended as {doc.get('run_status')!r} "
            "(stopped at its step cap without meeting its convergence criterion)",
            file=sys.stderr,
        )


def _row(doc: dict[str, Any]) -> dict[str, Any]:
    """Table cells: a request's progress as text."""
    if isinstance(doc.get("progress"), dict):
        from blade_service.cli import display

        return {**doc, "progress": display.progress_text(doc)}
    return doc


def _dataset_ref(client: Any, value: str, uploaded: list[str] | None = None) -> str:
    """A dataset id as given, or the id of the file `value` uploaded now (appended to `uploaded`)."""
    path = Path(value)
    if path.is_file():
        dataset_id: str = client.upload_dataset(path)["id"]
        if uploaded is not None:
            uploaded.append(dataset_id)
        return dataset_id
    if value.endswith((".json", ".jsonl", ".txt")):
        raise CliError(f"{value}: no such file (and not a dataset id)")
    return value


def _parse_sets(items: list[str], method: str | None = None) -> dict[str, Any]:
    """KEY=VALUE pairs as JSON values. With a `method`, a field of its config is read as `blade unlearn --set`
    reads it (`contracts.params.from_text`: `none`, `off`, `q_proj,v_proj`); anything else as JSON, else text.
    The API validates the result."""
    from blade_service.contracts.methods import CONFIGS
    from blade_service.contracts.params import from_text, tunable_fields

    fields = tunable_fields(CONFIGS[method]) if method in CONFIGS else {}
    params: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise CliError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = (part.strip() for part in item.split("=", 1))
        if key in fields:
            params[key] = from_text(fields[key], raw)
            continue
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def _watch(client: Any, request_id: str, *, timeout: float, quiet: bool) -> dict[str, Any]:
    """Poll until the request ends, drawing progress on stderr (unless `quiet`); the final state."""
    from blade_service.cli import display

    watch = None if quiet else display.RunWatch(_console(stderr=True), request_id)
    newest: dict[str, Any] = {"record": None}

    def on_update(state: dict[str, Any]) -> None:
        if watch is None:
            return
        step = (newest["record"] or {}).get("step", 0)
        if (state.get("progress") or {}).get("step", 0) > step:
            records = client.events(request_id, after_step=step)
            newest["record"] = records[-1] if records else newest["record"]
        watch.update(state, newest["record"])

    try:
        return client.wait(request_id, timeout=timeout, interval=1.0, on_update=on_update)
    finally:
        if watch is not None:
            watch.close()


def _finish(args: argparse.Namespace, client: Any, state: dict[str, Any]) -> dict[str, Any]:
    """After --wait: the summary table (or the JSON of the state and its metrics)."""
    from blade_service.cli import display

    metrics = client.metrics(state["id"])
    if args.json:
        display.print_json({**state, "metrics": metrics})
    else:
        display.print_summary(_console(), state, metrics)
        _restart_lines(client.events(state["id"]))
    _convergence_line(state)
    _run_warning_lines(metrics)
    return state


def _run_warning_lines(metrics: Any) -> None:
    """The training run's warnings (stderr), e.g. that forget Prob did not move: the worker keeps them with
    the metrics after the run (`after.warnings`)."""
    after = (metrics or {}).get("after") if isinstance(metrics, dict) else None
    for warning in (after or {}).get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)


def _restart_lines(records: list[dict[str, Any]]) -> None:
    """A line (stderr) for each time the worker started the run over, which its step count no longer shows:
    the new first step's event says why (`restarted`, blade_service/worker/training.py)."""
    for record in records:
        why = record.get("restarted")
        if not isinstance(why, dict):
            continue
        if "collapsed" in why:
            text = f"it collapsed ({why['collapsed']}), and ran from step 0 at eta_out {why.get('eta_out')}"
        else:
            text = (
                f"its checkpoint at step {why.get('discarded_checkpoint_step')} no longer matched the config"
            )
        print(f"note: the worker started this run over: {text}", file=sys.stderr)


def _exit_code(state: dict[str, Any]) -> int:
    return 1 if state.get("status") in FAILED else 0


# --- requests -----------------------------------------------------------------------------------------------


def run_submit(args: argparse.Namespace) -> int:
    metadata = None
    if args.metadata:
        try:
            metadata = json.loads(args.metadata)
        except json.JSONDecodeError as exc:
            raise CliError(f"--metadata: not JSON ({exc})") from None

    params = _parse_sets(args.set, args.method or "blade")  # its errors come before anything is uploaded

    def go(client: Any) -> dict[str, Any]:
        with _uploads_kept_if_accepted(client) as uploaded:
            req = client.submit(
                args.base_model,
                _dataset_ref(client, args.forget, uploaded),
                _dataset_ref(client, args.retain, uploaded),
                method=args.method,
                params=params,
                metadata=metadata,
                idempotency_key=args.idempotency_key,
                preset=args.preset,
            )
        if not args.wait:
            _show(args, req)
            return req
        print(f"submitted {req['id']}", file=sys.stderr)
        return _finish(args, client, _watch(client, req["id"], timeout=args.timeout, quiet=args.json))

    return _exit_code(_call(args, go))


@contextlib.contextmanager
def _uploads_kept_if_accepted(client: Any) -> Iterator[list[str]]:
    """The ids of the datasets a call uploads (the block appends them); when the API refuses the call (4xx),
    they are deleted: no request names them, so no retention rule would ever purge that forget data."""
    from blade_service.client import ApiError

    uploaded: list[str] = []
    try:
        yield uploaded
    except ApiError as exc:
        if exc.status < 500:  # refused for good (a 5xx may have been accepted after all)
            _discard_uploads(client, uploaded)
        raise


def _discard_uploads(client: Any, dataset_ids: list[str]) -> None:
    """Delete `dataset_ids`, naming what was deleted and what could not be."""
    deleted = []
    for dataset_id in dataset_ids:
        try:
            client.delete_dataset(dataset_id)
            deleted.append(dataset_id)
        except Exception as exc:  # the refusal is the error to report; this one is only named
            print(f"warning: could not delete the uploaded dataset {dataset_id}: {exc}", file=sys.stderr)
    if deleted:
        print(f"deleted the datasets this call uploaded: {', '.join(deleted)}", file=sys.stderr)


def run_status(args: argparse.Namespace) -> int:
    def go(client: Any) -> dict[str, Any]:
        if args.wait:
            state = _finish(
                args, client, _watch(client, args.request_id, timeout=args.timeout, quiet=args.json)
            )
        else:
            state = client.status(args.request_id)
            if args.json and args.events:
                state = {**state, "events": client.events(args.request_id)}
            _show(args, state)
        if args.events and not args.json:
            records = client.events(args.request_id)
            _events_table(records)
            _restart_lines(records)
        return state

    state = _call(args, go)
    return _exit_code(state) if args.wait else 0


def _event_columns(records: list[dict[str, Any]]) -> list[str]:
    from blade_service.cli import display

    return [c for c in display.EVENT_COLUMNS if any(c in r for r in records)] or ["step"]


def _events_table(records: list[dict[str, Any]]) -> None:
    from blade_service.cli import display

    display.print_table(_console(), records, _event_columns(records), title="training dynamics")


def run_requests(args: argparse.Namespace) -> int:
    def go(client: Any) -> list[dict[str, Any]]:
        found = []
        for item in client.iter_requests(status=args.status, base_model=args.base_model):
            found.append(item)
            if args.limit and len(found) >= args.limit:
                break
        return found

    _show(args, _call(args, go), REQUEST_COLUMNS)
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.cancel(args.request_id, reason=args.reason)))
    return 0


def run_events(args: argparse.Namespace) -> int:
    """The steps so far as a table (`--json`: a JSON list); `--follow`: then each new step as it comes (JSON
    Lines with `--json`) until the request ends."""
    from blade_service.cli import display
    from blade_service.client import TERMINAL_STATES

    columns: list[str] = []  # fixed by the first rows, so later rows line up under their header

    def show(records: list[dict[str, Any]]) -> None:
        nonlocal columns
        if args.json:
            for r in records:
                print(json.dumps(r, default=str), flush=True)
        elif records:
            title = None if columns else "training dynamics"
            columns = columns or _event_columns(records)
            display.print_stream_rows(_console(), records, columns, title)

    def go(client: Any) -> None:
        records = client.events(args.request_id)
        if not args.follow:
            if args.json:
                print(json.dumps(records, indent=2, default=str))
            else:
                _events_table(records)
                _restart_lines(records)
            return
        show(records)
        last = records[-1]["step"] if records else 0
        while True:
            ended = client.status(args.request_id)["status"] in TERMINAL_STATES  # before the last fetch
            newer = client.events(args.request_id, after_step=last)
            show(newer)
            last = newer[-1]["step"] if newer else last
            if ended:
                return
            time.sleep(args.interval)

    _call(args, go)
    return 0


def run_metrics(args: argparse.Namespace) -> int:
    from blade_service.cli import display

    doc = _call(args, lambda c: c.metrics(args.request_id))
    if args.json:
        display.print_json(doc)
    else:
        rows = display.metric_rows(doc.get("before"), doc.get("after"))
        display.print_table(_console(), rows, ["metric", "before", "after", "change"], title=doc["status"])
        if not rows:
            print(
                f"request {doc['request_id']} is {doc['status']} and has no metrics: they are measured when "
                "its training starts and again when it ends",
                file=sys.stderr,
            )
    _run_warning_lines(doc)
    return 0


def run_certificate(args: argparse.Namespace) -> int:
    since_issue: list[str] = []

    def go(client: Any) -> str:
        if args.html:  # the page says what changed since issue itself
            return client.certificate_html(args.request_id)
        doc = client.certificate(args.request_id)
        since_issue.extend(_since_issue(client, doc))
        return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False)

    text = _call(args, go)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    for line in since_issue:
        print(line, file=sys.stderr)
    return 0


def _since_issue(client: Any, doc: dict[str, Any]) -> list[str]:
    """A warning when the certified adapter's state changed after issue: the signed document is immutable and
    still says what held then. A rollback undoes the deletion it certifies; a compaction or a retrain that
    replaced the version carries it on (`superseded_by`)."""
    issued = (doc.get("model") or {}).get("adapter") or {}
    if not issued.get("id"):
        return []
    now = client.adapter(issued["id"])
    if now.get("state") == issued.get("state"):
        return []
    reason = f" ({now['state_reason']})" if now.get("state_reason") else ""
    if now.get("change_in_effect", now.get("state") == "active"):
        carried = f", and {now['superseded_by']} carries its change" if now.get("superseded_by") else ""
        effect = f"the deletion it certifies is still in effect{carried}"
    else:
        effect = "the deletion it certifies is not in effect"
    return [
        f"warning: since this certificate was issued, adapter {issued['id']} is {now.get('state')}{reason} "
        f"since {now.get('state_changed_at')}: {effect}; the certificate still shows it {issued.get('state')}"
    ]


def run_rollback(args: argparse.Namespace) -> int:
    def go(client: Any) -> dict[str, Any]:
        if args.enable:
            return client.enable(args.adapter_id, args.reason)
        cascade = "retrain" if args.retrain else args.cascade
        return client.disable(args.adapter_id, args.reason, cascade=cascade)

    doc = _call(args, go)
    if args.json:
        _show(args, doc)
    else:
        _show(args, doc["adapter"], title="changed" if doc.get("changed") else "unchanged")
        if doc.get("flagged"):
            _show(args, doc["flagged"], ADAPTER_COLUMNS, title="later versions now on a different stack")
        if doc.get("retrains"):
            _show(args, doc["retrains"], title="retrains (request, or why a version cannot be retrained)")
    return 0


def run_retrain(args: argparse.Namespace) -> int:
    def go(client: Any) -> dict[str, Any]:
        with _uploads_kept_if_accepted(client) as uploaded:
            forget = _dataset_ref(client, args.forget, uploaded) if args.forget else None
            result: dict[str, Any] = client.retrain(args.adapter_id, args.reason, forget_dataset=forget)
        return result

    _show(args, _call(args, go))
    return 0


def run_adapter(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.adapter(args.adapter_id)))
    return 0


def run_download(args: argparse.Namespace) -> int:
    path = _call(args, lambda c: c.download_adapter(args.adapter_id, args.out, extract=not args.archive))
    print(path)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    doc = _call(
        args,
        lambda c: c.generate(
            args.base_model, args.prompt, args.max_new_tokens, question=args.question, tenant=args.tenant
        ),
    )
    if args.json:
        _show(args, doc)
    else:
        print(doc["text"])
    return 0


def run_compact(args: argparse.Namespace) -> int:
    def go(client: Any) -> dict[str, Any]:
        op: dict[str, Any] = client.compact(args.base_model, args.reason, rank=args.rank, tenant=args.tenant)
        deadline = time.monotonic() + args.timeout
        while args.wait and op.get("status") in ("queued", "running"):
            if time.monotonic() > deadline:
                raise CliError(f"compaction {op['id']} still {op['status']} after {args.timeout:g} s")
            time.sleep(1.0)
            op = client.stack_operation(op["id"])
        return op

    op = _call(args, go)
    _show(args, op)
    return 1 if args.wait and op.get("status") == "failed" else 0


def run_export(args: argparse.Namespace) -> int:
    path = _call(
        args,
        lambda c: c.export(
            args.base_model, args.out, format=args.format, extract=not args.archive, tenant=args.tenant
        ),
    )
    print(path)
    return 0


def run_adapters(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.adapters(args.name, tenant=args.tenant)), ADAPTER_COLUMNS)
    return 0


def run_models_list(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.base_models(tenant=args.tenant)), MODEL_COLUMNS)
    return 0


def run_model_show(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.base_model(args.name, tenant=args.tenant)))
    return 0


def run_model_register(args: argparse.Namespace) -> int:
    extra = {k: v for k, v in (("revision", args.revision), ("tenant", args.tenant)) if v}
    doc = _call(
        args,
        lambda c: c.register_base_model(
            args.name, args.source, description=args.description, shared=args.shared, **extra
        ),
    )
    _show(args, doc)
    return 0


def run_model_retention(args: argparse.Namespace) -> int:
    if args.set:
        changes = _parse_sets(args.set)

        def put(client: Any) -> Any:  # PUT sets both: a field not given keeps the model's own value
            now = client.retention(args.name, tenant=args.tenant)
            body = {k: now.get(k) for k in ("success_s", "failure_s")} | changes
            return client.set_retention(args.name, tenant=args.tenant, **body)

        doc = _call(args, put)
    else:
        doc = _call(args, lambda c: c.retention(args.name, tenant=args.tenant))
    _show(args, doc)
    return 0


def run_model_policy(args: argparse.Namespace) -> int:
    if not (args.set or args.canary_dataset or args.clear_canary):  # nothing to change: show it
        doc = _call(args, lambda c: c.base_model(args.name, tenant=args.tenant))
        _show(args, {k: doc.get(k) for k in ("name", "policy", "canary_dataset")})
        return 0
    if not args.reason:
        raise CliError("--reason is required to change a policy (it goes to the audit log)")
    body: dict[str, Any] = {"reason": args.reason}
    if args.set:  # `off` turns a rule off, as the dashboard names an unset rule (the API's null)
        body["policy"] = {k: None if v == "off" else v for k, v in _parse_sets(args.set).items()}
    if args.canary_dataset:
        body["canary_dataset"] = args.canary_dataset
    if args.clear_canary:
        body["clear_canary"] = True
    _show(args, _call(args, lambda c: c.set_policy(args.name, tenant=args.tenant, **body)))
    return 0


# --- datasets, keys, audit, health --------------------------------------------------------------------------


def run_datasets_list(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.datasets(purged=None if args.all else False)), DATASET_COLUMNS)
    return 0


def run_dataset_show(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.dataset(args.dataset_id)))
    return 0


def run_dataset_upload(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        raise CliError(f"{args.file}: no such file")
    _show(args, _call(args, lambda c: c.upload_dataset(args.file)))
    return 0


def run_dataset_delete(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.delete_dataset(args.dataset_id)))
    return 0


def run_keys_list(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.api_keys()), KEY_COLUMNS)
    return 0


def run_key_create(args: argparse.Namespace) -> int:
    doc = _call(args, lambda c: c.create_api_key(args.name, args.scope, tenant=args.tenant))
    _show(args, doc)
    print("the key is shown only this once: the service keeps only its hash", file=sys.stderr)
    return 0


def run_key_revoke(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.revoke_api_key(args.key_id)))
    return 0


def run_me(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.me()))
    return 0


def run_webhooks_list(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.webhooks()), WEBHOOK_COLUMNS)
    return 0


def run_webhook_create(args: argparse.Namespace) -> int:
    doc = _call(
        args, lambda c: c.create_webhook(args.url, events=args.event, allow_loopback=args.allow_loopback)
    )
    _show(args, doc)
    return 0


def run_webhook_disable(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.disable_webhook(args.webhook_id)))
    return 0


def run_webhook_deliveries(args: argparse.Namespace) -> int:
    _show(args, _call(args, lambda c: c.webhook_deliveries(args.webhook_id)), DELIVERY_COLUMNS)
    return 0


def run_audit(args: argparse.Namespace) -> int:
    if args.verify:
        doc = _call(args, lambda c: c.verify_audit_log())
        _show(args, doc)
        return 0 if doc.get("intact") else 1

    def go(client: Any) -> list[dict[str, Any]]:
        found = []
        for entry in client.iter_audit_log(action=args.action, subject_id=args.subject):
            found.append(entry)
            if args.limit and len(found) >= args.limit:
                break
        return found

    _show(args, _call(args, go), AUDIT_COLUMNS)
    return 0


def run_health(args: argparse.Namespace) -> int:
    from blade_service.client import ApiError

    def go(client: Any) -> dict[str, Any]:
        try:
            return client.ready()
        except ApiError as exc:
            if exc.status != 503:
                raise
            return {"status": "unavailable", "checks": {"readyz": exc.message}}

    doc = _call(args, go)
    _show(args, {"status": doc.get("status"), **(doc.get("checks") or {})})
    return 0 if doc.get("status") == "ok" else 1
