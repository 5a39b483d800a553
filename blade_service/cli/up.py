"""`blade up`: the whole service on embedded defaults (what `make run` starts). It prepares the data dir
(migrations, the demo base model `demo-tiny`, the admin key), then supervises two child processes, `blade api`
and one `blade worker` on every queue, each in its own session with its log under the data dir: it waits for
both to be ready, prints the banner with a first request to paste, and stops both in order on Ctrl-C or when
either exits.

    blade up --port 8000 --data-dir ./var        # API + one Celery worker + SQLite + server-less broker"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from blade_service.cli.main import CliError
from blade_service.cli.worker import EMBEDDED_QUEUES
from blade_service.contracts.records import DatasetError, read_records

DEMO_MODEL_NAME = "demo-tiny"
ADMIN_KEY_FILE = "admin-key"  # under the data dir, mode 0600: the key `blade up` generated on first start


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="the whole service on embedded defaults (what `make run` starts)",
        description="API + one real Celery worker + SQLite + a server-less broker + "
        "artifacts on local disk, with the demo base model `demo-tiny`.",
    )
    p.add_argument("--port", type=int, default=None, help="default: BLADE_PORT, else 8000")
    p.add_argument("--host", default=None, help="default: BLADE_HOST, else 127.0.0.1")
    p.add_argument("--data-dir", type=Path, default=Path("./var"))
    p.add_argument(
        "--demo-model",
        type=Path,
        default=None,
        help="a model dir to register as demo-tiny instead of building the demo model",
    )
    p.add_argument(
        "--demo-data",
        type=Path,
        default=None,
        help="a TOFU-format dir for the printed first-request example (default: the demo world)",
    )
    p.set_defaults(func=run_up)


def _say(message: str) -> None:
    print(f"[blade up] {message}", file=sys.stderr, flush=True)


def _prepare(settings: Any, demo_model: Path | None, *, save_key: bool) -> tuple[Path, bool]:
    """Migrate the database, register demo-tiny, bootstrap the admin key and keep it in the key file when
    there is none yet (given or generated); (model dir, key file new?)."""
    from blade_service.persistence import auth, base_models
    from blade_service.persistence.db import session_factory, session_scope, upgrade_to_head

    data_dir = settings.data_dir
    _say(f"database: {settings.resolved_database_url()}")
    upgrade_to_head(settings.resolved_database_url())
    if demo_model is None:
        from blade_core.demo import ensure_demo_model

        _say(
            "demo model: building it, or loading it from the cache (the first run trains it; progress below)"
        )
        model_dir = Path(ensure_demo_model(data_dir / "cache" / "demo", progress=True))
    else:
        model_dir = demo_model
    model_dir = model_dir.resolve()
    if not (model_dir / "config.json").is_file():
        raise CliError(f"{model_dir}: not a model directory (no config.json)")
    with session_scope(settings) as session:
        model = base_models.ensure_registered(session, name=DEMO_MODEL_NAME, source=str(model_dir))
        if model.source != str(model_dir):
            _say(f"note: {DEMO_MODEL_NAME} stays registered with its first source {model.source}")
    auth.bootstrap_admin_key(session_factory(settings), settings)
    key_file = data_dir / ADMIN_KEY_FILE
    if save_key and not key_file.exists():
        key_file.write_text(settings.bootstrap_admin_key + "\n")
        key_file.chmod(0o600)
        return model_dir, True
    return model_dir, False


def admin_key_lines(key_file: Path, *, key: str, generated: bool, file_is_new: bool) -> tuple[str, str]:
    """(the banner's key line, a shell expression for the key). The expression reads the key file, which
    `_prepare` always writes on a data dir's first start and whose key stays a valid admin key, so the pasted
    commands work whether the key was generated or given as BLADE_BOOTSTRAP_ADMIN_KEY (inline or exported)."""
    where = shlex.quote(str(key_file))
    expr = f"$(cat {where})"
    if generated and file_is_new:
        return f"admin key (generated; kept in {key_file}): {key}", expr
    if generated:
        return f"admin key: the one generated on first start, in {key_file}", expr
    kept = key_file.read_text().strip() if key_file.is_file() else ""
    if kept == key:
        return f"admin key: your BLADE_BOOTSTRAP_ADMIN_KEY (also kept in {key_file})", expr
    return (
        f"admin key: your BLADE_BOOTSTRAP_ADMIN_KEY; {key_file} holds an earlier start's, which works too",
        expr,
    )


def _admin_key(data_dir: Path, given: str | None) -> str:
    """BLADE_BOOTSTRAP_ADMIN_KEY when set, else the key generated on this data dir's first start (or new)."""
    if given:
        return given
    key_file = data_dir / ADMIN_KEY_FILE
    if key_file.is_file():
        return key_file.read_text().strip()
    return "blade_" + secrets.token_urlsafe(24)


def _wait_http(url: str, procs: dict[str, subprocess.Popen], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"the {name} process exited with status {proc.returncode} while starting")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")


def _wait_worker(
    settings: Any, name: str, procs: dict[str, subprocess.Popen], *, since: float, timeout: float
) -> None:
    """Until the worker's heartbeat row says it is consuming (written on Celery's worker_ready)."""
    from blade_service.persistence.db import session_scope
    from blade_service.persistence.models import WorkerHeartbeat

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc_name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the {proc_name} process exited with status {proc.returncode} while starting"
                )
        with session_scope(settings) as session:
            row = session.get(WorkerHeartbeat, name)
            if row is not None and row.alive and row.last_seen.timestamp() >= since - 1:
                return
        time.sleep(0.3)
    raise RuntimeError(f"the worker did not report ready within {timeout:g} s")


def _demo_files(data_dir: Path, demo_data: Path | None) -> tuple[Path, Path] | None:
    """Forget and retain files for the printed example: forget01/retain99 of `--demo-data`, else of the demo
    world (the one `demo-tiny` memorised)."""
    if demo_data is None:
        from blade_core.demo import demo_data_dir

        demo_data = demo_data_dir(data_dir / "cache" / "demo")
    forget, retain = demo_data / "forget01_perturbed.json", demo_data / "retain99.json"
    return (forget.resolve(), retain.resolve()) if forget.is_file() and retain.is_file() else None


def _first_question(forget: Path) -> str | None:
    """The forget file's first question (for the printed generation), or None."""
    try:
        rows, _ = read_records(forget)
    except DatasetError:
        return None
    question = rows[0].data.get("question")
    return question if isinstance(question, str) and question.strip() else None


def first_request_curl(url: str, key_expr: str, files: tuple[Path, Path] | None) -> str:
    """A ready-to-paste shell sequence: upload forget + retain, submit, poll, and ask the model the forget
    file's first question (before the request: the memorised answer; after it: not)."""
    forget, retain = files if files else (Path("forget.jsonl"), Path("retain.jsonl"))
    pick = "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"id\"])'"
    lines = [
        f"KEY={key_expr}",
        f"URL={url}",
        f'F=$(curl -sf -H "Authorization: Bearer $KEY" -F file=@{shlex.quote(str(forget))} $URL/datasets '
        f"| {pick})",
        f'R=$(curl -sf -H "Authorization: Bearer $KEY" -F file=@{shlex.quote(str(retain))} $URL/datasets '
        f"| {pick})",
        'REQ=$(curl -sf -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" '
        f'-d "{{\\"base_model\\": \\"{DEMO_MODEL_NAME}\\", \\"forget_dataset\\": \\"$F\\", '
        '\\"retain_dataset\\": \\"$R\\"}" '
        f"$URL/unlearn-requests | {pick})",
        'curl -s -H "Authorization: Bearer $KEY" $URL/unlearn-requests/$REQ; echo   # repeat until succeeded',
        'curl -s -H "Authorization: Bearer $KEY" $URL/unlearn-requests/$REQ/metrics; echo',
        f'curl -s -H "Authorization: Bearer $KEY" $URL/base-models/{DEMO_MODEL_NAME}/adapters; echo',
    ]
    question = _first_question(forget) if files else None
    if question is not None:
        body = shlex.quote(json.dumps({"question": question, "max_new_tokens": 24}))
        lines.append(
            'curl -s -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" '
            f"-d {body} $URL/base-models/{DEMO_MODEL_NAME}/generate; echo   # before and after the request"
        )
    return "\n".join(lines)


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(
            argv, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(procs: dict[str, subprocess.Popen], grace: float = 15.0) -> None:
    """SIGTERM each child's process group (API first, then the worker); SIGKILL what is left after `grace`."""
    for proc in procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_up(args: argparse.Namespace) -> int:
    from blade_service.persistence.settings import Settings, get_settings

    data_dir = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    given = get_settings()
    args.host = args.host or given.host
    args.port = args.port if args.port is not None else given.port
    key = _admin_key(data_dir, given.bootstrap_admin_key)
    settings = Settings(data_dir=data_dir, host=args.host, port=args.port, bootstrap_admin_key=key)
    env = dict(os.environ)  # the children read the same settings from their environment
    env.update(
        {
            "BLADE_DATA_DIR": str(data_dir),
            "BLADE_HOST": args.host,
            "BLADE_PORT": str(args.port),
            "BLADE_BOOTSTRAP_ADMIN_KEY": key,
            "PYTHONUNBUFFERED": "1",
        }
    )
    # The demo model is tiny: one torch thread trains it fastest, and two threads on a 2-core machine that is
    # busy with anything else slow each step down many times over (3 s instead of 0.05 s per build step).
    env.setdefault("OMP_NUM_THREADS", "1")
    generated_here = not given.bootstrap_admin_key

    with socket.socket() as probe:
        if probe.connect_ex((args.host, args.port)) == 0:
            raise CliError(
                f"port {args.port} on {args.host} is already in use (is another `blade up` running?); "
                "another port: --port N, or BLADE_PORT=N make run"
            )

    model_dir, key_is_new = _prepare(settings, args.demo_model, save_key=True)
    url = f"http://{args.host}:{args.port}"
    python = sys.executable
    procs: dict[str, subprocess.Popen] = {}
    stopping = {"flag": False}

    def _terminate(signum: int, _frame: Any) -> None:
        stopping["flag"] = True
        raise KeyboardInterrupt

    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _terminate)
    previous_int = signal.signal(signal.SIGINT, _terminate)  # also when started with SIGINT ignored (`&`)
    worker_name, started = f"embedded@{socket.gethostname()}", time.time()
    try:
        # Each child in its own session (Ctrl-C reaches only us, and we stop them in order), its output in a
        # log file under the data dir.
        procs["api"] = _spawn(
            [python, "-m", "blade_service.cli", "api", "--host", args.host, "--port", str(args.port)],
            env,
            logs / "api.log",
        )
        # One worker process for every queue. Threads (two of them) so a /generate call is answered while a
        # training run is going; the production GPU worker instead runs prefork, one task per child.
        procs["worker"] = _spawn(
            [
                python,
                "-m",
                "blade_service.cli",
                "worker",
                "--queues",
                EMBEDDED_QUEUES,
                "--pool",
                "threads",
                "--concurrency",
                "2",
                "--beat",
                "--name",
                worker_name,
            ],
            env,
            logs / "worker.log",
        )
        _say("starting the API and the worker ...")
        _wait_http(f"{url}/healthz", procs, timeout=120)
        _wait_worker(settings, worker_name, procs, since=started, timeout=120)
        files = _demo_files(data_dir, args.demo_data)
        key_line, key_expr = admin_key_lines(
            data_dir / ADMIN_KEY_FILE, key=key, generated=generated_here, file_is_new=key_is_new
        )
        print(
            f"\nBLADE service ready at {url}   (API docs {url}/docs, dashboard {url}/dashboard)\n"
            f"base model: {DEMO_MODEL_NAME} ({model_dir})\n{key_line}\n"
            f"CLI: export BLADE_API_URL={url} BLADE_API_KEY={key_expr}   (then `blade requests`, "
            "`blade submit ... --wait`)\n\n"
            f"A first request (paste into a shell):\n\n{first_request_curl(url, key_expr, files)}\n\n"
            f"Logs: {logs}/api.log, {logs}/worker.log.   Ctrl-C stops everything.\n",
            flush=True,
        )
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the {name} process exited unexpectedly (status {proc.returncode})")
            time.sleep(0.5)
    except KeyboardInterrupt:
        _say("stopping ...")
        return 0
    except RuntimeError as exc:
        tails = "".join(
            f"\n--- {name} log ({logs / f'{name}.log'}) ---\n{_log_tail(logs / f'{name}.log')}"
            for name in procs
        )
        raise CliError(f"{exc}{tails}") from None
    finally:
        _stop(procs)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
