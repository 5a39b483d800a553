"""`MethodConfig`: the fields every method shares, and how a config field is declared.

Every method's config is a pydantic dataclass: a real `dataclasses` dataclass (so `dataclasses.fields`,
`asdict` and `replace` work, and `replace` validates again) whose fields carry their bounds and help text in
`Annotated[type, Field(...)]` and their source in a trailing comment. The API, `blade unlearn --set` and the
engine all validate with these classes (`contracts.params`); nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

# The pydantic settings of every method config: unknown fields are errors, values stay as given otherwise.
CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=False)
BIG = 1e6  # upper bound of unbounded positive quantities: catches a typo (1e60) without limiting real use


@dataclass(config=CONFIG)
class MethodConfig:
    """Fields shared by every method; each method's config extends this with its own hyperparameters."""

    max_steps: Annotated[int, Field(ge=1, le=100_000, description="T: cap on outer steps")] = (
        250  # BLADE paper, TOFU preset
    )
    batch_size: Annotated[int, Field(ge=1, le=4096, description="rows per forget / retain micro-batch")] = (
        4  # OpenUnlearning TOFU: 32 = 4 x 8 accumulation
    )
    grad_accum: Annotated[int, Field(ge=1, le=1024, description="micro-batches per optimiser step")] = 1
    max_length: Annotated[int, Field(ge=8, le=32_768, description="tokens per row after the template")] = 256
    seed: Annotated[int, Field(ge=0, le=2**32 - 1, description="random seed")] = 0
    use_lora: Annotated[bool, Field(description="False: full-parameter fine-tuning")] = (
        True  # the baselines as published are full-parameter
    )
    lora_r: Annotated[int, Field(ge=1, le=1024, description="LoRA rank")] = 8  # BLADE paper, TOFU preset
    lora_alpha: Annotated[int, Field(ge=1, le=4096, description="LoRA alpha")] = (
        16  # BLADE paper, TOFU preset
    )
    lora_dropout: Annotated[float, Field(ge=0, lt=1, description="LoRA dropout")] = (
        0.0  # BLADE reference implementation
    )
    lora_target_modules: Annotated[
        tuple[str, ...] | None,
        Field(min_length=1, description="module names the adapter goes on (null: q/k/v/o/gate/up/down)"),
    ] = None  # None: q/k/v/o/gate/up/down, else discovered linears
    checkpoint_every: Annotated[
        int, Field(ge=1, le=100_000, description="outer steps between checkpoints (with a checkpoint dir)")
    ] = 25
