"""The methods' names, configs and presets: what the API, the CLI and the engine agree on, without torch.

Adding a parameter to a method means adding one field to its config class here (`base.py`, `blade.py`,
`baselines.py`); the API validator, `blade unlearn --set`, the OpenAPI document and the engine follow.
"""

from __future__ import annotations

from typing import Any

from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods.base import MethodConfig
from blade_service.contracts.methods.baselines import (
    BASELINE_PRESETS,
    LORA_PRESET,
    BaselineConfig,
    BLURNPOConfig,
    GradAscentConfig,
    GradDiffConfig,
    NPOConfig,
    PDUConfig,
    RMUConfig,
    SimNPOConfig,
)
from blade_service.contracts.methods.blade import PRESETS as BLADE_PRESETS
from blade_service.contracts.methods.blade import BladeConfig

CONFIGS: dict[str, type[MethodConfig]] = {
    "blade": BladeConfig,
    "grad_ascent": GradAscentConfig,
    "grad_diff": GradDiffConfig,
    "npo": NPOConfig,
    "simnpo": SimNPOConfig,
    "rmu": RMUConfig,
    "pdu": PDUConfig,
    "blur_npo": BLURNPOConfig,
}
METHOD_NAMES: tuple[str, ...] = tuple(CONFIGS)

# Each method's named presets: BLADE's from the paper's table, every baseline's 'lora' (OpenUnlearning's TOFU
# LoRA experiment).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    name: BLADE_PRESETS if name == "blade" else BASELINE_PRESETS for name in METHOD_NAMES
}

# The preset the service trains each method with: every result must be a LoRA adapter that stacks and rolls
# back, so the baselines (full-parameter as published) run OpenUnlearning's TOFU LoRA experiment there.
SERVICE_PRESETS: dict[str, str | None] = {name: None if name == "blade" else "lora" for name in METHOD_NAMES}

# Config fields that are not the client's to set (the API and `--set` reject them as unknown).
NOT_TUNABLE: frozenset[str] = frozenset({"show_progress"})


def check_method(name: str) -> str:
    """`name` if it is a method; ParamError on field `method` listing the known names otherwise."""
    if name not in CONFIGS:
        raise ParamError("method", f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    return name


def service_preset(name: str) -> str | None:
    """The preset the worker trains `name` with (see SERVICE_PRESETS); ParamError for an unknown method."""
    return SERVICE_PRESETS[check_method(name)]


__all__ = [
    "BASELINE_PRESETS",
    "CONFIGS",
    "LORA_PRESET",
    "METHOD_NAMES",
    "NOT_TUNABLE",
    "PRESETS",
    "SERVICE_PRESETS",
    "BLURNPOConfig",
    "BaselineConfig",
    "BladeConfig",
    "GradAscentConfig",
    "GradDiffConfig",
    "MethodConfig",
    "NPOConfig",
    "PDUConfig",
    "RMUConfig",
    "SimNPOConfig",
    "check_method",
    "service_preset",
]
