"""The learning-rate rule for models `blade model build` trains from scratch, applied by the engine.

The published learning rates (OpenUnlearning's baselines; BLADE's eta_in and eta_out) are tuned for pretrained
1B-8B models fine-tuned on TOFU at 1e-5. A model we build trained at a far higher rate, and at the published
rates no method makes it forget anything (docs/results.md). `run_unlearning` (so `blade unlearn`, the worker
and the bench alike) therefore resolves every learning rate a run did not set explicitly by one rule:

- Adam learning rates (`lr`, `lora_lr`, BLADE's `eta_out`): the published value times `factor`, the model's
  own training LR over TOFU's fine-tuning LR (from the `build_info.json` the build writes; 1 for any other
  model, i.e. the published values). Both are Adam LRs, and Adam's step is about `lr` per coordinate whatever
  the gradient's scale, so their ratio carries over.
- Plain-SGD learning rates (BLADE's inner `eta_in`): the reference's published value, unscaled. A ratio of
  Adam LRs means nothing for them: an SGD step is `lr x gradient`, and BLADE clips it to norm 1, so `eta_in`
  bounds the length of an inner step in weight space, which the LoRA init (PEFT's, the same for every base
  model) does not tie to the base model's training LR. An earlier rule, eta_in = 1 / lambda_max of the retain
  loss measured at the start of the run, collapsed utility (issue 9): at the LoRA init (B = 0) the retain loss
  is nearly flat (lambda_max ~3 on the quick validation target, eta_in 0.34) while after 30 outer steps it is
  ~100x sharper; in every run with it the reference's one-shot calibration judged forgetting too slow and
  raised eta_out 1.5-3x, and real-authors ROUGE fell to 0. On the bench's validation world (seed 1000,
  forget05, 30 steps, 4 x 4 batches) HM was 0.00 with it, 0.37 with the published 2e-4, 0.34 with 2e-4 x the
  factor.
- The baselines' LoRA rate (`lora_lr`, in a run that trains LoRA) on a built model: also times the
  method's `LORA_LR_ON_BUILT_MODELS`, selected on a validation world. At the factor alone,
  OpenUnlearning's LoRA setting (r = alpha = 128) collapsed every baseline but RMU.
- `multiplier` (the bench's validation-world selection; 1 elsewhere) then multiplies every rule-set LR alike.

The resolved values and the factor are recorded in run.json (`lr_rule`) and, through it, in the
service's adapter hyperparameters. With a checkpoint dir the rule is saved there, so a resumed run reuses it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from blade_service.contracts.methods import CONFIGS

ADAM_LR_FIELDS: tuple[str, ...] = ("lr", "lora_lr", "eta_out")  # baselines: lr, lora_lr; BLADE: eta_out
SGD_LR_FIELDS: tuple[str, ...] = ("eta_in",)  # BLADE's inner plain-SGD step
LR_FIELDS: tuple[str, ...] = ADAM_LR_FIELDS + SGD_LR_FIELDS
TOFU_FINETUNE_LR = 1e-5  # TOFU's target fine-tuning LR (Maini et al. 2024; OpenUnlearning finetune.yaml)
RULE_FILE = "lr_rule.json"  # in the checkpoint dir: what a resumed run reuses

# Each baseline's best multiple of the factor-scaled `lora_lr` in the service's LoRA setting (LORA_PRESET:
# r = alpha = 128, 5 epochs at 4 x 4 rows): mean HM over seeds 42, 123 and 456 on the quick bench's
# validation world (seed 1000, forget05; never reported), grid x1/128 ... x1 in steps of 2. At x1/2 and x1
# every method but RMU scored HM 0. docs/results.md, "The baselines' LoRA setting on a built model".
LORA_LR_ON_BUILT_MODELS: dict[str, float] = {
    "grad_ascent": 1 / 64,
    "grad_diff": 1 / 64,
    "npo": 1 / 64,
    "simnpo": 1 / 8,
    "rmu": 1 / 2,
    "pdu": 1 / 8,
    "blur_npo": 1 / 64,
}


def auto_lr_scale(model: str | Path) -> float:
    """factor = (the model's training LR in build_info.json) / TOFU_FINETUNE_LR; 1.0 without one.

    A two-stage build (pretrain, then fine-tune on the world) names its fine-tuning LR `finetune_lr`."""
    try:
        recipe = json.loads((Path(model) / "build_info.json").read_text())["recipe"]
        return float(recipe.get("finetune_lr") or recipe["lr"]) / TOFU_FINETUNE_LR
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 1.0


def resolve_learning_rates(
    config: Any, *, factor: float, multiplier: float = 1.0, explicit: Iterable[str] = ()
) -> tuple[dict[str, float], dict[str, Any]]:
    """(the rule's value of each LR field of `config` not set explicitly, the record for run.json)."""
    explicit = set(explicit)
    lora = _lora_multiplier(config) if factor != 1.0 else None
    values: dict[str, float] = {}
    for f in dataclasses.fields(config):
        if f.name in explicit or f.name not in LR_FIELDS:
            continue
        scale = factor if f.name in ADAM_LR_FIELDS else 1.0  # SGD fields: the published value
        if f.name == "lora_lr" and lora is not None:
            scale *= lora
        values[f.name] = getattr(config, f.name) * scale * multiplier
    record: dict[str, Any] = {
        "factor": factor,
        "multiplier": multiplier,
        "sgd_rule": "published",
        "learning_rates": dict(values),
        "explicit": sorted(explicit & set(LR_FIELDS)),
    }
    if lora is not None and "lora_lr" in values:  # only then: every other run's record stays as it was
        record["lora_lr_on_built_model"] = lora
    return values, record


def _lora_multiplier(config: Any) -> float | None:
    """`LORA_LR_ON_BUILT_MODELS` of the config's method when the run trains LoRA at `lora_lr`."""
    if not getattr(config, "use_lora", False) or not hasattr(config, "lora_lr"):
        return None
    name = next((n for n, c in CONFIGS.items() if type(config) is c), None)
    return LORA_LR_ON_BUILT_MODELS.get(name) if name else None


def apply_lr_rule(
    config: Any,
    *,
    model: str | Path,
    lr_scale: float | None = None,
    multiplier: float = 1.0,
    explicit: Iterable[str] = (),
    state_dir: Path | None = None,
) -> tuple[Any, dict[str, Any]]:
    """`config` with the rule's learning rates (factor = lr_scale, or auto_lr_scale(model) when None), and
    the record for run.json. A rule saved in `state_dir` by an earlier attempt with the same factor and
    multiplier is reused as is (so a resumed run's config matches its checkpoint)."""
    factor = auto_lr_scale(model) if lr_scale is None else float(lr_scale)
    saved_path = Path(state_dir) / RULE_FILE if state_dir is not None else None
    record = None
    if saved_path is not None and saved_path.is_file():
        try:
            record = json.loads(saved_path.read_text())
        except ValueError:
            record = None
    if not record or (record.get("factor"), record.get("multiplier")) != (factor, multiplier):
        _, record = resolve_learning_rates(config, factor=factor, multiplier=multiplier, explicit=explicit)
        if saved_path is not None:
            saved_path.parent.mkdir(parents=True, exist_ok=True)
            saved_path.write_text(json.dumps(record, indent=1))
    return dataclasses.replace(config, **record["learning_rates"]), record
