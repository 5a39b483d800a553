"""Typed errors the engine raises where a caller (the worker, the CLI) must tell causes apart without reading
message text. They live in the torch-free contracts layer (`blade_service/contracts/errors.py`); re-exported
here."""

from __future__ import annotations

from blade_service.contracts.errors import BaseModelUnavailable

__all__ = ["BaseModelUnavailable"]
