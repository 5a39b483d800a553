"""RMU (Li et al. 2024, WMDP "Representation Misdirection for Unlearning"), as OpenUnlearning runs it on TOFU.

    L_fgt = mean_{answer tokens of D_f} mean_d (h^l_theta - c u)^2
    L_ret = mean_{answer tokens of D_r} mean_d (h^l_theta - h^l_ref)^2
    min_theta  gamma * L_fgt + alpha * L_ret

h^l is the output of decoder layer l, u a fixed random unit vector (drawn once per run from `seed`), c the
steering coefficient, h_ref the frozen starting model. Layer l is scaled to depth: OpenUnlearning steers
layer 7 of Llama-3.2-1B's 16, so a model with L layers uses round(7/16 * L). All parameters train
(OpenUnlearning's TOFU setting `trainable_params_regex: .*`; WMDP's original trains only three MLP
down-projections). Departures from OpenUnlearning: see `_loop.py`. Run it: `blade unlearn --model M --forget
F --retain R --out DIR --method rmu`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blade_core.baseline_losses import masked_activation_mse, rmu_control_vector, rmu_layer_index
from blade_core.methods._loop import (
    BaselineConfig,
    Batch,
    Reference,
    capture_output,
    decoder_layers,
    run_loop,
    weighted_step,
)
from blade_core.methods.base import Method, RunResult, UnlearnTask

IGNORE_INDEX = -100


@dataclass
class RMUConfig(BaselineConfig):
    steering_coeff: float = 2.0  # c (OpenUnlearning configs/trainer/RMU.yaml)
    reference_layer: int = 7  # steered layer of the reference depth (OpenUnlearning RMU.yaml: model.layers.7)
    reference_depth: int = 16  # depth that layer index refers to (Llama-3.2-1B, OpenUnlearning's TOFU model)
    layer: int | None = None  # explicit layer index; None: reference_layer scaled to this model's depth
    gamma: float = 1.0  # forget-loss weight (OpenUnlearning RMU.yaml preferences[0])
    alpha: float = 1.0  # retain-loss weight (OpenUnlearning RMU.yaml preferences[1])

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.steering_coeff > 0:
            raise ValueError(f"RMUConfig.steering_coeff must be > 0, got {self.steering_coeff!r}")


def train(task: UnlearnTask, config: RMUConfig) -> RunResult:
    layers = decoder_layers(task.model)
    index = (
        config.layer
        if config.layer is not None
        else rmu_layer_index(len(layers), config.reference_layer, config.reference_depth)
    )
    if not 0 <= index < len(layers):
        raise ValueError(f"RMUConfig.layer={index} is out of range for a model with {len(layers)} layers")
    reference = Reference(task.model, config.use_lora)
    layer, ref_layer = layers[index], decoder_layers(reference.module)[index]
    hidden_size = task.model.config.hidden_size
    generator = torch.Generator().manual_seed(config.seed)
    control = rmu_control_vector(hidden_size, config.steering_coeff, generator).to(task.device)  # (1, 1, D)

    def hidden(model: torch.nn.Module, module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with capture_output(module) as cache:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return cache[0]  # (B, T, D)

    def objective(forget: Batch, retain: Batch):
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

    def step(micro):
        stats = weighted(micro)
        stats.extra["layer"] = index
        return stats

    return run_loop(task, config, step, name="rmu")


METHOD = Method(
    name="rmu",
    config_class=RMUConfig,
    train=train,
    summary="steer a middle layer's forget activations to a random vector, keep retain ones (full-parameter)",
)
