"""Registry of unlearning methods: one module per method, each exposing `METHOD` (see `base.py`)."""

from __future__ import annotations

import importlib

from blade_core.methods.base import Method, MethodConfig
from blade_service.contracts.methods import METHOD_NAMES, SERVICE_PRESETS, service_preset


def get_method(name: str) -> Method:
    """The method registered under `name`; ValueError listing the known names otherwise."""
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    method: Method = importlib.import_module(f"blade_core.methods.{name}").METHOD
    return method


__all__ = ["METHOD_NAMES", "SERVICE_PRESETS", "Method", "MethodConfig", "get_method", "service_preset"]
