"""A small typed HTTP client for the BLADE service (httpx, synchronous).

    from client import BladeClient
    with BladeClient("http://127.0.0.1:8000", api_key="...") as c:
        forget = c.upload_dataset("forget.jsonl")
        retain = c.upload_dataset("retain.jsonl")
        req = c.submit("demo-tiny", forget["id"], retain["id"], params={"max_steps": 20})
        done = c.wait(req["id"])                       # polls until a terminal state
        print(done["status"], c.adapters("demo-tiny"))

Every non-2xx answer raises `ApiError` with the server's `{error: {code, message}}`.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import httpx

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})

JSON = dict[str, Any]


class ApiError(RuntimeError):
    """A non-2xx answer: HTTP status, the error code and message from the body."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


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
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
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
        if response.status_code >= 400:
            code, message = "http_error", response.text[:500]
            try:
                err = response.json().get("error") or {}
                code, message = err.get("code", code), err.get("message", message)
            except (ValueError, AttributeError):
                pass
            raise ApiError(response.status_code, code, message)
        if not response.content:
            return None
        ctype = response.headers.get("content-type", "")
        return response.json() if "json" in ctype else response.content

    # --- datasets and base models -----------------------------------------------------------------------

    def upload_dataset(self, file: str | Path | BinaryIO, filename: str | None = None) -> JSON:
        """POST /datasets: `{id, sha256, rows, format}`."""
        if isinstance(file, str | Path):
            path = Path(file)
            with path.open("rb") as fh:
                return self.request("POST", "/datasets", files={"file": (filename or path.name, fh)})
        return self.request("POST", "/datasets", files={"file": (filename or "dataset.jsonl", file)})

    def dataset(self, dataset_id: str) -> JSON:
        return self.request("GET", f"/datasets/{dataset_id}")

    def register_base_model(self, name: str, source: str) -> JSON:
        return self.request("POST", "/base-models", json={"name": name, "source": source})

    def base_models(self) -> list[JSON]:
        return _items(self.request("GET", "/base-models"))

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
        key = idempotency_key or uuid.uuid4().hex
        return self.request("POST", "/unlearn-requests", json=body, headers={"Idempotency-Key": key})

    def status(self, request_id: str) -> JSON:
        return self.request("GET", f"/unlearn-requests/{request_id}")

    def requests(self) -> list[JSON]:
        return _items(self.request("GET", "/unlearn-requests"))

    def wait(self, request_id: str, *, timeout: float = 600.0, interval: float = 0.5) -> JSON:
        """Poll until the request reaches a terminal state; TimeoutError with the last state otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.status(request_id)
            if state.get("status") in TERMINAL_STATES:
                return state
            if time.monotonic() >= deadline:
                raise TimeoutError(f"request {request_id} still {state.get('status')!r} after {timeout:g} s")
            time.sleep(interval)

    def events(self, request_id: str) -> list[JSON]:
        return _items(self.request("GET", f"/unlearn-requests/{request_id}/events"))

    def metrics(self, request_id: str) -> JSON:
        return self.request("GET", f"/unlearn-requests/{request_id}/metrics")

    def cancel(self, request_id: str) -> JSON:
        return self.request("POST", f"/unlearn-requests/{request_id}/cancel")

    # --- adapter registry -------------------------------------------------------------------------------

    def adapters(self, base_model: str) -> list[JSON]:
        return _items(self.request("GET", f"/base-models/{base_model}/adapters"))

    def adapter(self, adapter_id: str) -> JSON:
        return self.request("GET", f"/adapters/{adapter_id}")

    def download_adapter(self, adapter_id: str) -> bytes:
        return self.request("GET", f"/adapters/{adapter_id}/download")

    def disable(self, adapter_id: str, reason: str, *, cascade: bool = False) -> JSON:
        body: JSON = {"reason": reason}
        if cascade:
            body["cascade"] = True
        return self.request("POST", f"/adapters/{adapter_id}/disable", json=body)

    def enable(self, adapter_id: str, reason: str) -> JSON:
        return self.request("POST", f"/adapters/{adapter_id}/enable", json={"reason": reason})

    def generate(self, base_model: str, prompt: str, max_new_tokens: int | None = None) -> JSON:
        body: JSON = {"prompt": prompt}
        if max_new_tokens is not None:
            body["max_new_tokens"] = max_new_tokens
        return self.request("POST", f"/base-models/{base_model}/generate", json=body)

    def audit_log(self) -> list[JSON]:
        return _items(self.request("GET", "/audit-log"))

    def health(self) -> JSON:
        return self.request("GET", "/healthz")


def _items(payload: Any) -> list[JSON]:
    """Lists come back either bare or wrapped (`{"items": [...]}` / `{"events": [...]}` / ...)."""
    if isinstance(payload, list):
        return payload
    if isinstance(payload, dict):
        for key in ("items", "events", "adapters", "data", "rows", "requests", "entries"):
            if isinstance(payload.get(key), list):
                return payload[key]
    return [payload] if payload else []
