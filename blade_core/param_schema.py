"""Deprecated shim: a method's parameters are declared once, in the torch-free `contracts.methods`, and
validated by `contracts.params`. Kept so existing imports keep working; import from `contracts` instead.

    from blade_service.contracts.params import validate_params
    validate_params("blade", {"max_steps": 50, "tau": 0.6})  # -> the params; ParamError naming the field
"""

from __future__ import annotations

from typing import Any

from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods import METHOD_NAMES, NOT_TUNABLE
from blade_service.contracts.params import describe, validate_params

# Each method's tunable fields as JSON-ready descriptions (type, range, nullable, help), from the configs.
METHOD_PARAMS: dict[str, dict[str, dict[str, Any]]] = {name: describe(name) for name in METHOD_NAMES}

__all__ = ["METHOD_PARAMS", "NOT_TUNABLE", "ParamError", "describe", "validate_params"]
