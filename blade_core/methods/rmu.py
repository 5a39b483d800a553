"""RMU (Li et al. 2024, WMDP "Representation Misdirection for Unlearning"), as the BLADE paper's baseline
table and OpenUnlearning's `configs/trainer/RMU.yaml` run it on TOFU.

    L_fgt = mean_{answer tokens of D_f} mean_d (h^l_theta - c u)^2
    L_ret = mean_{answer tokens of D_r} mean_d (h^l_theta - h^l_ref)^2
    min_theta  gamma * L_fgt + alpha * L_ret,   theta = W_down of layers l-2, l-1, l only

h^l is the output of decoder layer l, u a fixed random unit vector (drawn once per run from `seed`), c the
steering coefficient, h_ref the frozen starting model. Only the MLP down-projection weights of the steered
layer and the two below it train (WMDP `layer_ids 5,6,7` / `param_ids 6`; RMU.yaml
`trainable_params_regex: model.layers.(5|6|7).mlp.down_proj.weight`); every other weight stays as it was.
Layer l is scaled to depth: OpenUnlearning steers layer 7 of Llama-3.2-1B's 16, so a model with L layers uses
round(7/16 * L). Through the service (`use_lora`) the adapter sits on those three down-projections only.

Departures: the schedule and optimiser are `_loop.py`'s (80 AdamW steps at effective batch 32 with
OpenUnlearning's warm-up and linear decay; WMDP's script uses a constant learning rate). Run it:
`blade unlearn --model M --forget F --retain R --out DIR --method rmu`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from blade_core.baseline_losses import masked_activation_mse, rmu_control_vector, rmu_layer_index
from blade_core.methods._loop import (
    Batch,
    Reference,
    StepStats,
    capture_output,
    decoder_layers,
    run_loop,
    weighted_step,
)
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_service.contracts.methods import baselines as contracts_baselines
from blade_service.contracts.methods.baselines import BASELINE_PRESETS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100
PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)


class RMUConfig(contracts_baselines.RMUConfig):
    """The contract's RMU config plus where its LoRA adapter goes (needs the model, so it lives here)."""

    def lora_targets(self, model: torch.nn.Module) -> list[str]:
        """The module names the service's LoRA adapter goes on (read by `blade_core.lora.lora_config`)."""
        return [name for name, _ in trained_modules(model, self)]


def steered_layer(config: RMUConfig, num_layers: int) -> int:
    index = (
        config.layer
        if config.layer is not None
        else rmu_layer_index(num_layers, config.reference_layer, config.reference_depth)
    )
    if not 0 <= index < num_layers:
        raise ValueError(f"RMUConfig.layer={index} is out of range for a model with {num_layers} layers")
    return index


def trained_modules(model: torch.nn.Module, config: RMUConfig) -> list[tuple[str, torch.nn.Module]]:
    """(name in `model`, module) of `trained_module` in the steered layer and the `trained_layers - 1`
    below it."""
    layers = decoder_layers(model)
    index = steered_layer(config, len(layers))
    names = {id(m): name for name, m in model.named_modules()}
    found = []
    for i in range(max(0, index - config.trained_layers + 1), index + 1):
        try:
            module = layers[i].get_submodule(config.trained_module)
        except AttributeError:
            raise ValueError(
                f"RMUConfig.trained_module={config.trained_module!r}: decoder layer {i} of "
                f"{type(model).__name__} has no such module"
            ) from None
        found.append((names[id(module)], module))
    return found


def select_trained_parameters(model: torch.nn.Module, config: RMUConfig) -> list[torch.nn.Parameter]:
    """Freeze everything but the trained modules' weights (their LoRA factors under `use_lora`); return
    those."""
    prefixes = tuple(f"{name}." for name, _ in trained_modules(model, config))
    chosen = []
    for name, param in model.named_parameters():
        if config.use_lora:
            keep = param.requires_grad and "lora_" in name and name.startswith(prefixes)
        else:
            keep = name.startswith(prefixes) and name.endswith(".weight") and "lora_" not in name
        param.requires_grad_(keep)
        if keep:
            chosen.append(param)
    if not chosen:
        raise ValueError(f"RMU: no trainable parameters in {', '.join(p.rstrip('.') for p in prefixes)}")
    return chosen


def train(task: UnlearnTask, config: RMUConfig) -> RunResult:
    reference = Reference(task.model, config.use_lora)
    params = select_trained_parameters(task.model, config)
    layers = decoder_layers(task.model)
    index = steered_layer(config, len(layers))
    layer, ref_layer = layers[index], decoder_layers(reference.module)[index]
    hidden_size: int = cast("PreTrainedModel", task.model).config.hidden_size
    generator = torch.Generator().manual_seed(config.seed)
    control = rmu_control_vector(hidden_size, config.steering_coeff, generator).to(task.device)  # (1, 1, D)

    def hidden(model: torch.nn.Module, module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with capture_output(module) as cache:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return cache[0]  # (B, T, D)

    def objective(forget: Batch, retain: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        l_fgt = masked_activation_mse(
            hidden(task.model, layer, forget), control, forget["labels"] != IGNORE_INDEX
        )
        with reference.active() as ref:
            ref_hidden = hidden(ref, ref_layer, retain)  # (B, T, D)
        l_ret = masked_activation_mse(
            hidden(task.model, layer, retain), ref_hidden, retain["labels"] != IGNORE_INDEX
        )
        return l_fgt, l_ret

    weighted = weighted_step(objective, config.gamma, config.alpha)

    def step(micro: Sequence[tuple[Batch, Batch]]) -> StepStats:
        stats = weighted(micro)
        stats.extra["layer"] = index
        return stats

    return run_loop(task, config, step, name="rmu", params=params)


METHOD = Method(
    name="rmu",
    config_class=RMUConfig,
    train=train,
    summary="steer a middle layer's forget activations to a random vector, keep retain ones "
    "(trains three MLP down-projections)",
)
