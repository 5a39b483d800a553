"""A small typed HTTP client for the BLADE service (httpx, synchronous): one method per route.

    from blade_service.client import BladeClient
    with BladeClient("http://127.0.0.1:8000", api_key="...") as c:
        forget = c.upload_dataset("forget.jsonl")
        retain = c.upload_dataset("retain.jsonl")
        req = c.submit("demo-tiny", forget["id"], retain["id"], params={"max_steps": 20})
        done = c.wait(req["id"], on_update=print)       # polls until a terminal state
        c.download_adapter(done["adapter_id"], "adapter/")  # the PEFT dir, extracted and checked
        cert = c.certificate(req["id"])

List methods return every item: they follow `next_cursor` page by page (`iter_*` yields them lazily).
Every non-2xx answer raises `ApiError` with the server's `{error: {code, message}}`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "rejected"})
PAGE_SIZE = 500

JSON = dict[str, Any]


class ApiError(RuntimeError):
    """A non-2xx answer: HTTP status, the error code and message from the body."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message, self.field = status, code, message, field


class BladeClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    # --- plumbing ---------------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BladeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        _raise_for_error(response)
        if not response.content:
            return None
        ctype = response.headers.get("content-type", "")
        if "json" in ctype:
            return response.json()
        return response.text if ctype.startswith("text/") else response.content

    def iter_pages(self, path: str, params: dict[str, Any] | None = None) -> Iterator[JSON]:
        """Each page of a list route, following `next_cursor` until `has_more` is false."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        query.setdefault("limit", PAGE_SIZE)
        while True:
            page = self.request("GET", path, params=query)
            if isinstance(page, list):  # a bare list: everything at once
                yield {"items": page, "has_more": False, "next_cursor": None}
                return
            yield page
            if not page.get("has_more") or not page.get("next_cursor"):
                return
            query["cursor"] = page["next_cursor"]

    def iter_items(self, path: str, params: dict[str, Any] | None = None) -> Iterator[JSON]:
        for page in self.iter_pages(path, params):
            yield from page.get("items", [])

    def _download(self, path: str, dest: str | Path, *, extract: bool, params: JSON | None = None) -> Path:
        """Stream an archive route to `dest`; check `X-Content-SHA256`; extract it into `dest` when asked
        (dest then is a directory) or keep the `.tar.gz` at `dest`."""
        dest = Path(dest)
        with self._http.stream("GET", path, params=params) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            expected = response.headers.get("x-content-sha256")
            digest = hashlib.sha256()
            with tempfile.NamedTemporaryFile(suffix=".tar.gz", delete=False) as tmp:
                for chunk in response.iter_bytes():
                    digest.update(chunk)
                    tmp.write(chunk)
        archive = Path(tmp.name)
        try:
            if expected and digest.hexdigest() != expected:
                raise ApiError(
                    response.status_code,
                    "checksum_mismatch",
                    f"{path}: received bytes have sha256 {digest.hexdigest()}, the server said {expected}",
                )
            if not extract:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(archive, dest)
                return dest
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive, "r:*") as tar:
                tar.extractall(dest, filter="data")  # no absolute paths, links out of dest or devices
                for member in tar.getmembers():  # archives are built with mtime 0 (the same bytes each time):
                    with contextlib.suppress(OSError):  # the files read as downloaded now, not 1970
                        os.utime(dest / member.name)
            return dest
        finally:
            archive.unlink(missing_ok=True)

    # --- service ----------------------------------------------------------------------------------------

    def health(self) -> JSON:
        return self.request("GET", "/healthz")

    def ready(self) -> JSON:
        """GET /readyz: 200 when the database and the broker answer, else ApiError 503."""
        return self.request("GET", "/readyz")

    def prometheus_metrics(self) -> str:
        return self.request("GET", "/metrics")

    # --- API keys ---------------------------------------------------------------------------------------

    def me(self) -> JSON:
        return self.request("GET", "/me")

    def create_api_key(self, name: str, scopes: list[str], *, tenant: str | None = None) -> JSON:
        """POST /api-keys (admin): the new key, with its secret `key` shown this once."""
        body: JSON = {"name": name, "scopes": scopes}
        if tenant:
            body["tenant"] = tenant
        return self.request("POST", "/api-keys", json=body)

    def api_keys(self) -> list[JSON]:
        return list(self.iter_items("/api-keys"))

    def revoke_api_key(self, key_id: str) -> JSON:
        return self.request("POST", f"/api-keys/{key_id}/revoke")

    # --- datasets ---------------------------------------------------------------------------------------

    def upload_dataset(self, file: str | Path | BinaryIO, filename: str | None = None) -> JSON:
        """POST /datasets: `{id, sha256, rows, format}`."""
        if isinstance(file, str | Path):
            path = Path(file)
            with path.open("rb") as fh:
                return self.request("POST", "/datasets", files={"file": (filename or path.name, fh)})
        return self.request("POST", "/datasets", files={"file": (filename or "dataset.jsonl", file)})

    def dataset(self, dataset_id: str) -> JSON:
        return self.request("GET", f"/datasets/{dataset_id}")

    def iter_datasets(self, *, purged: bool | None = None) -> Iterator[JSON]:
        """`purged` False: only datasets whose bytes are kept; True: only purged ones; None: all."""
        return self.iter_items("/datasets", None if purged is None else {"purged": str(purged).lower()})

    def datasets(self, *, purged: bool | None = None) -> list[JSON]:
        return list(self.iter_datasets(purged=purged))

    def delete_dataset(self, dataset_id: str) -> JSON:
        """DELETE /datasets/{id}: its bytes go; the record stays (409 while a running request uses it)."""
        return self.request("DELETE", f"/datasets/{dataset_id}")

    # --- base models and their stacks -------------------------------------------------------------------

    def register_base_model(
        self,
        name: str,
        source: str,
        *,
        description: str | None = None,
        shared: bool = False,
        **fields: Any,
    ) -> JSON:
        """POST /base-models (admin); `fields` passes any further field the server takes (e.g. `revision`)."""
        body: JSON = {"name": name, "source": source, **fields}
        if description is not None:
            body["description"] = description
        if shared:
            body["shared"] = True
        return self.request("POST", "/base-models", json=body)

    def base_model(self, name: str, *, tenant: str | None = None) -> JSON:
        """`tenant` (the operator): whose model `name` is; names are per tenant."""
        return self.request("GET", f"/base-models/{name}", params=_of_tenant(tenant))

    def base_models(self, *, tenant: str | None = None) -> list[JSON]:
        """The tenant's own and the shared ones; `tenant` (the operator): another tenant's."""
        return list(self.iter_items("/base-models", _of_tenant(tenant)))

    def adapters(self, base_model: str, *, tenant: str | None = None) -> list[JSON]:
        """The model's adapter stack in order, active and disabled."""
        return list(self.iter_items(f"/base-models/{base_model}/adapters", _of_tenant(tenant)))

    def generate(
        self,
        base_model: str,
        prompt: str | None = None,
        max_new_tokens: int | None = None,
        *,
        question: str | None = None,
        tenant: str | None = None,
    ) -> JSON:
        """A greedy completion of raw `prompt`, or of a `question` asked as the model's QA rows ask it."""
        given = {"prompt": prompt, "question": question}
        body: JSON = {name: text for name, text in given.items() if text is not None}
        if max_new_tokens is not None:
            body["max_new_tokens"] = max_new_tokens
        return self.request(
            "POST", f"/base-models/{base_model}/generate", json=body, params=_of_tenant(tenant)
        )

    def set_policy(self, base_model: str, *, tenant: str | None = None, **body: Any) -> JSON:
        """PUT /base-models/{name}/policy (admin): e.g. `policy=..., reason=...`."""
        return self.request("PUT", f"/base-models/{base_model}/policy", json=body, params=_of_tenant(tenant))

    def retention(self, base_model: str, *, tenant: str | None = None) -> JSON:
        """GET /base-models/{name}/retention: how long forget data is kept after a request ends."""
        return self.request("GET", f"/base-models/{base_model}/retention", params=_of_tenant(tenant))

    def set_retention(self, base_model: str, *, tenant: str | None = None, **body: Any) -> JSON:
        """PUT /base-models/{name}/retention (admin): e.g. `success_s=0, failure_s=3600`."""
        path = f"/base-models/{base_model}/retention"
        return self.request("PUT", path, json=body, params=_of_tenant(tenant))

    def compact(
        self, base_model: str, reason: str, *, rank: int | None = None, tenant: str | None = None
    ) -> JSON:
        """POST /base-models/{name}/compact (admin): the queued stack operation; poll `stack_operation`."""
        body: JSON = {"reason": reason}
        if rank is not None:
            body["rank"] = rank
        return self.request(
            "POST", f"/base-models/{base_model}/compact", json=body, params=_of_tenant(tenant)
        )

    def stack_operation(self, operation_id: str) -> JSON:
        return self.request("GET", f"/stack-operations/{operation_id}")

    def export(
        self,
        base_model: str,
        dest: str | Path,
        *,
        format: str = "adapter",
        extract: bool = True,
        tenant: str | None = None,
    ) -> Path:
        """GET /base-models/{name}/export: the effective model as one adapter (or merged weights), extracted
        into the directory `dest` (or, with `extract=False`, the `.tar.gz` written to `dest`)."""
        return self._download(
            f"/base-models/{base_model}/export",
            dest,
            extract=extract,
            params={"format": format} | (_of_tenant(tenant) or {}),
        )

    # --- unlearn requests -------------------------------------------------------------------------------

    def submit(
        self,
        base_model: str,
        forget_dataset: str,
        retain_dataset: str,
        *,
        method: str | None = None,
        params: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        preset: str | None = None,
        probe_datasets: dict[str, str] | None = None,
    ) -> JSON:
        """POST /unlearn-requests (202). A generated Idempotency-Key makes this call safe to retry."""
        body: JSON = {
            "base_model": base_model,
            "forget_dataset": forget_dataset,
            "retain_dataset": retain_dataset,
        }
        if method:
            body["method"] = method
        if params:
            body["params"] = params
        if metadata:
            body["metadata"] = metadata
        if preset:
            body["preset"] = preset
        if probe_datasets:
            body["probe_datasets"] = probe_datasets
        key = idempotency_key or uuid.uuid4().hex
        return self.request("POST", "/unlearn-requests", json=body, headers={"Idempotency-Key": key})

    def status(self, request_id: str) -> JSON:
        return self.request("GET", f"/unlearn-requests/{request_id}")

    def iter_requests(self, *, status: str | None = None, base_model: str | None = None) -> Iterator[JSON]:
        """Newest first, every page."""
        return self.iter_items("/unlearn-requests", {"status": status, "base_model": base_model})

    def requests(self, *, status: str | None = None, base_model: str | None = None) -> list[JSON]:
        return list(self.iter_requests(status=status, base_model=base_model))

    def wait(
        self,
        request_id: str,
        *,
        timeout: float = 600.0,
        interval: float = 0.5,
        on_update: Callable[[JSON], None] | None = None,
    ) -> JSON:
        """Poll until the request reaches a terminal state (calling `on_update` with each state seen);
        TimeoutError with the last state otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.status(request_id)
            if on_update is not None:
                on_update(state)
            if state.get("status") in TERMINAL_STATES:
                return state
            if time.monotonic() >= deadline:
                raise TimeoutError(f"request {request_id} still {state.get('status')!r} after {timeout:g} s")
            time.sleep(interval)

    def events(self, request_id: str, *, after_step: int | None = None) -> list[JSON]:
        """The training dynamics so far (one record per outer step), optionally only after `after_step`."""
        return list(self.iter_items(f"/unlearn-requests/{request_id}/events", {"after_step": after_step}))

    def metrics(self, request_id: str) -> JSON:
        return self.request("GET", f"/unlearn-requests/{request_id}/metrics")

    def cancel(self, request_id: str, reason: str | None = None) -> JSON:
        return self.request(
            "POST", f"/unlearn-requests/{request_id}/cancel", json={"reason": reason} if reason else None
        )

    def certificate(self, request_id: str) -> JSON:
        """The signed deletion certificate of a succeeded request (ApiError 409 before that)."""
        return self.request("GET", f"/unlearn-requests/{request_id}/certificate")

    def certificate_html(self, request_id: str) -> str:
        return self.request("GET", f"/unlearn-requests/{request_id}/certificate", params={"format": "html"})

    def certificate_keys(self) -> JSON:
        """The public keys that verify certificates (no API key needed)."""
        return self.request("GET", "/certificate-keys")

    # --- adapter registry -------------------------------------------------------------------------------

    def adapter(self, adapter_id: str) -> JSON:
        return self.request("GET", f"/adapters/{adapter_id}")

    def download_adapter(self, adapter_id: str, dest: str | Path, *, extract: bool = True) -> Path:
        """The adapter's PEFT files (`adapter_config.json`, `adapter_model.safetensors`) extracted into the
        directory `dest`, checked against the server's sha256; `extract=False` keeps the `.tar.gz`."""
        return self._download(f"/adapters/{adapter_id}/download", dest, extract=extract)

    def retrain(self, adapter_id: str, reason: str, *, forget_dataset: str | None = None) -> JSON:
        """POST /adapters/{id}/retrain (admin): the queued request that re-runs this version on the current
        stack; `forget_dataset` supplies purged forget data again (same sha256)."""
        body: JSON = {"reason": reason}
        if forget_dataset:
            body["forget_dataset"] = forget_dataset
        return self.request("POST", f"/adapters/{adapter_id}/retrain", json=body)

    def disable(self, adapter_id: str, reason: str, *, cascade: bool | str = False) -> JSON:
        """`cascade`: True also disables the versions trained on top of it; "retrain" re-runs their requests
        on the new stack (the answer's `retrains` lists each one's request or why it cannot be retrained)."""
        body: JSON = {"reason": reason}
        if cascade:
            body["cascade"] = cascade
        return self.request("POST", f"/adapters/{adapter_id}/disable", json=body)

    def enable(self, adapter_id: str, reason: str) -> JSON:
        return self.request("POST", f"/adapters/{adapter_id}/enable", json={"reason": reason})

    # --- webhooks ---------------------------------------------------------------------------------------

    def create_webhook(
        self, url: str, *, events: list[str] | None = None, allow_loopback: bool = False
    ) -> JSON:
        """POST /webhooks (admin): the endpoint, with its signing `secret` shown this once."""
        body: JSON = {"url": url, "events": events or []}
        if allow_loopback:
            body["allow_loopback"] = True
        return self.request("POST", "/webhooks", json=body)

    def webhooks(self) -> list[JSON]:
        return list(self.iter_items("/webhooks"))

    def disable_webhook(self, webhook_id: str) -> JSON:
        return self.request("DELETE", f"/webhooks/{webhook_id}")

    def webhook_deliveries(self, webhook_id: str) -> list[JSON]:
        """The delivery log, newest first."""
        return list(self.iter_items(f"/webhooks/{webhook_id}/deliveries"))

    # --- audit ------------------------------------------------------------------------------------------

    def iter_audit_log(self, *, action: str | None = None, subject_id: str | None = None) -> Iterator[JSON]:
        """Newest first, every page."""
        return self.iter_items("/audit-log", {"action": action, "subject_id": subject_id})

    def audit_log(self, *, action: str | None = None, subject_id: str | None = None) -> list[JSON]:
        return list(self.iter_audit_log(action=action, subject_id=subject_id))

    def verify_audit_log(self) -> JSON:
        return self.request("GET", "/audit-log/verify")


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    code, message, field = "http_error", response.text[:500], None
    try:
        err = response.json().get("error") or {}
        code, message, field = err.get("code", code), err.get("message", message), err.get("field")
    except (ValueError, AttributeError):
        pass
    raise ApiError(response.status_code, code, message, field)


def _of_tenant(tenant: str | None) -> dict[str, str] | None:
    """The query naming whose model a `/base-models/{name}` route means (the operator's `?tenant=`)."""
    return {"tenant": tenant} if tenant else None
