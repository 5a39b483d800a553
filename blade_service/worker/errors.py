"""How a failed task names its cause: `TaskFailure` carries a code and a message to the request; `classify`
turns any other exception into one by its type (never by searching its message text)."""

from __future__ import annotations

import sys

from blade_service.contracts.errors import BaseModelUnavailable
from blade_service.contracts.records import DatasetError
from blade_service.persistence.storage import StorageError


class TaskFailure(Exception):
    """A failure the request should carry: a short code and a readable message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def is_accelerator_oom(exc: BaseException) -> bool:
    """True for torch's CUDA out-of-memory error. torch is looked up, not imported: a process that never
    loaded it cannot have raised it."""
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return isinstance(oom, type) and isinstance(exc, oom)


def classify(exc: BaseException) -> tuple[str, str]:
    """(code, message) a request failed by `exc` records; `internal_error` for any type not named here."""
    text = str(exc) or type(exc).__name__
    if is_accelerator_oom(exc):
        return "out_of_memory", f"the accelerator ran out of memory: {text}"
    if isinstance(exc, StorageError):
        return "storage_error", f"artifact storage failed: {text}"
    if isinstance(exc, BaseModelUnavailable):  # raised where the model is loaded, never by training
        return "base_model_unavailable", f"the base model could not be loaded: {text}"
    if isinstance(exc, DatasetError):
        return "invalid_dataset", text
    return "internal_error", f"{type(exc).__name__}: {text}"
