"""Learning rates for the models `blade model build` trains from scratch.

The published learning rates (OpenUnlearning's baselines; BLADE's eta_in and eta_out) are tuned for pretrained
1B-8B models fine-tuned on TOFU at 1e-5. A model we build from scratch trained at a far higher rate, and at
the published rates no method makes it forget anything (docs/results.md). So every method's learning rates
are multiplied by one common factor, the model's own training LR over TOFU's fine-tuning LR, taken from the
`build_info.json` the build writes. Any other model (a hub id, a fine-tuned checkpoint) gets factor 1: the
published values. The bench and the service both apply it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from blade_core.methods import get_method

LR_FIELDS: tuple[str, ...] = ("lr", "lora_lr", "eta_in", "eta_out")  # baselines: lr, lora_lr; BLADE: eta_*
TOFU_FINETUNE_LR = 1e-5  # TOFU's target fine-tuning LR (Maini et al. 2024; OpenUnlearning finetune.yaml)


def auto_lr_scale(model: str | Path) -> float:
    """scale = (peak training LR in the model's build_info.json) / TOFU_FINETUNE_LR; 1.0 without one."""
    try:
        info = json.loads((Path(model) / "build_info.json").read_text())
        return float(info["recipe"]["lr"]) / TOFU_FINETUNE_LR
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0


def scaled_learning_rates(method: str, scale: float) -> dict[str, float]:
    """Each learning-rate field of the method's config: its default times `scale` (empty when scale is 1)."""
    if scale == 1.0:
        return {}
    fields = dataclasses.fields(get_method(method).config_class)
    return {f.name: f.default * scale for f in fields if f.name in LR_FIELDS}
