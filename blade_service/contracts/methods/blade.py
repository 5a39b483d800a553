"""BLADE's config and the presets of the paper's table (the loop: `blade_core/methods/blade.py`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods.base import BIG, CONFIG, MethodConfig


@dataclass(config=CONFIG)
class BladeConfig(MethodConfig):
    """BLADE hyperparameters (paper symbol, source). Defaults are the paper's TOFU setting."""

    grad_accum: Annotated[int, Field(ge=1, le=1024, description="micro-batches per optimiser step")] = (
        4  # reference, TOFU: 4 rows x 4 micro-batches = 16 rows per inner and outer step (TOFU_BATCH below)
    )
    inner_steps: Annotated[int, Field(ge=1, le=1000, description="K: inner SGD steps per outer step")] = (
        3  # paper Sec. 4 / reference
    )
    # eta_in's upper bound is wide: plain SGD on a model's own loss scale (blade_core/lr_scale.py).
    eta_in: Annotated[float, Field(gt=0, le=BIG, description="eta_in: inner plain-SGD learning rate")] = (
        2e-4  # no momentum (reference)
    )
    eta_out: Annotated[float, Field(gt=0, le=1, description="eta_out: outer Adam learning rate")] = (
        5e-5  # paper Table, TOFU
    )
    tau: Annotated[float, Field(gt=0, le=1, description="tau: entropy target as a fraction of log V")] = (
        0.7  # paper
    )
    rho: Annotated[float, Field(gt=0, le=BIG, description="rho: augmented-Lagrangian penalty")] = 0.1  # paper
    lambda0: Annotated[
        float, Field(gt=0, le=BIG, description="lambda_0: initial multiplier (>= lambda_min)")
    ] = 1.0  # paper
    alpha: Annotated[float, Field(ge=0, le=1, description="down-step factor of the dual update")] = (
        0.1  # asymmetric dual update (reference); not LoRA's alpha
    )
    lambda_min: Annotated[float, Field(gt=0, le=BIG, description="floor of lambda")] = 0.1  # reference
    lambda_max: Annotated[float | None, Field(gt=0, le=1e9, description="cap of lambda (null: none)")] = (
        None  # reference: none
    )
    eps_mul: Annotated[
        float, Field(gt=0, le=100, description="epsilon as a multiple of the first retain loss")
    ] = 0.85  # epsilon = eps_mul x mean first-inner-loop retain loss (paper Table, TOFU)
    epsilon: Annotated[
        float | None, Field(gt=0, le=BIG, description="fixed retain bound (null: automatic)")
    ] = None  # None = automatic (above)
    clip_norm: Annotated[
        float, Field(gt=0, le=BIG, description="gradient-norm clip of inner and outer steps")
    ] = 1.0  # reference
    recovery_factor: Annotated[
        int, Field(ge=0, le=100, description="recovery spends at most recovery_factor*K extra inner steps")
    ] = 3  # reference
    recovery_threshold: Annotated[
        float, Field(gt=0, le=BIG, description="recovery runs while L_ret > recovery_threshold*epsilon")
    ] = 2.0  # reference
    collapse_loss: Annotated[float, Field(gt=0, le=BIG, description="L_ret above this stops the run")] = (
        10.0  # reference
    )
    calibrate_lr: Annotated[
        bool, Field(description="one-shot eta_out calibration after max(5, 0.1T) steps")
    ] = True  # reference
    early_stop: Annotated[bool, Field(description="convergence stop before max_steps")] = True  # reference
    patience: Annotated[
        int, Field(ge=1, le=100_000, description="steps the convergence condition must hold")
    ] = 8  # reference; 20 for MUSE/KnowUnDo
    stop_needs_retain_met: Annotated[
        bool, Field(description="the convergence stop also needs r <= 0 on each of its patience steps")
    ] = False  # not in the reference, whose stop can fire with retain repair unfinished: docs/results.md
    ema_beta: Annotated[float, Field(gt=0, le=1, description="EMA weight of L_fgt and its velocity")] = (
        0.15  # reference
    )
    forget_tokens: Annotated[
        Literal["all", "answer"], Field(description="tokens the clamped entropy counts")
    ] = "all"  # reference: all
    loss_chunk: Annotated[int, Field(ge=1, le=1 << 20, description="positions per chunk of the losses")] = (
        256  # memory O(chunk x V)
    )
    gradient_checkpointing: Annotated[bool, Field(description="on CUDA only")] = (
        True  # CPU runs keep fp32 and no checkpointing
    )
    stacked_forward: Annotated[
        Literal["auto", "on", "off"],
        Field(
            description="each step's micro-batches through one forward, every loss still per micro-batch"
            " (auto: on CUDA)"
        ),
    ] = "auto"  # the same update either way (docs/performance.md): fewer launches, more activation memory

    @model_validator(mode="after")
    def _lambda_bounds(self) -> BladeConfig:
        if self.lambda0 < self.lambda_min:
            raise ParamError(
                "lambda0", f"must be >= lambda_min ({self.lambda_min:g}), got {self.lambda0!r}", "BladeConfig"
            )
        if self.lambda_max is not None and self.lambda_max < self.lambda_min:
            raise ParamError(
                "lambda_max",
                f"must be >= lambda_min ({self.lambda_min:g}), got {self.lambda_max!r}",
                "BladeConfig",
            )
        return self


# Presets from the paper's hyperparameter table; values not listed keep the defaults above.
# Batches are the reference's (authors' OpenUnlearning fork), 16 rows per outer step in each benchmark:
# TOFU configs/experiment/unlearn/tofu/lora_bial_{1b,3b}.yaml: per_device_train_batch_size 4 x
# gradient_accumulation_steps 4; MUSE lora_bial_adaptive_books.yaml and KnowUnDo blade.yaml: 2 x 8.
TOFU_BATCH: dict[str, Any] = {"batch_size": 4, "grad_accum": 4}
MUSE_BATCH: dict[str, Any] = {"batch_size": 2, "grad_accum": 8}
PRESETS: dict[str, dict[str, Any]] = {
    "tofu": {"eta_out": 5e-5, "eps_mul": 0.85, "lora_r": 8, "lora_alpha": 16, "max_steps": 250, **TOFU_BATCH},
    "tofu_3b": {
        "eta_out": 5e-5,
        "eps_mul": 0.85,
        "lora_r": 16,
        "lora_alpha": 32,
        "max_steps": 250,
        **TOFU_BATCH,
    },
    "tofu_forget10": {
        "eta_out": 5e-5,
        "eps_mul": 0.85,
        "lora_r": 8,
        "lora_alpha": 16,
        "max_steps": 500,
        **TOFU_BATCH,
    },
    "muse": {
        "eta_out": 3e-5,
        "eps_mul": 3.2,
        "lora_r": 16,
        "lora_alpha": 32,
        "max_steps": 250,
        "patience": 20,
        **MUSE_BATCH,
    },
    "knowundo": {
        "eta_out": 3e-5,
        "eps_mul": 3.2,
        "lora_r": 16,
        "lora_alpha": 32,
        "max_steps": 150,
        "patience": 20,
        **MUSE_BATCH,
    },
}
