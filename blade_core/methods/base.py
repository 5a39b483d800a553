"""The one small interface every unlearning method implements.

A method is a module in `blade_core/methods/` that takes its typed config from the torch-free contracts layer
(`blade_service/contracts/methods/`: a pydantic dataclass extending `MethodConfig`), defines a `train(task,
config) -> RunResult` function, and exposes both as `METHOD`. The runner (`blade_core.unlearn`) prepares the
task (model with adapters wired, tokenised data, hooks); the method owns its optimisation loop and reports
every outer step through `task.hooks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from blade_service.contracts.methods import MethodConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from blade_core.data import TokenizedDataset

RunStatus = Literal["converged", "max_steps", "cancelled", "collapsed"]


@dataclass
class Hooks:
    """What the service plugs into a run: progress per step, cancellation between steps, checkpoints."""

    on_step: Callable[[dict[str, Any]], None] | None = None  # called with each history record
    should_stop: Callable[[], bool] | None = None  # polled between outer steps; True -> status 'cancelled'
    checkpoint_dir: Path | None = None  # save every config.checkpoint_every steps; resume if one exists


@dataclass
class UnlearnTask:
    """Everything a method trains on. `model` already carries the trainable adapter (or is the full model)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    forget: TokenizedDataset
    retain: TokenizedDataset
    device: torch.device
    hooks: Hooks = field(default_factory=Hooks)


@dataclass
class RunResult:
    history: list[dict[str, Any]]
    status: RunStatus
    message: str = ""
    summary: dict[str, Any] = field(default_factory=dict)  # e.g. optimiser steps, forget rows seen (run.json)


class TrainFn(Protocol):
    # positional-only: each method names its config parameter as it likes (BLADE's is `cfg`)
    def __call__(self, task: UnlearnTask, config: Any, /) -> RunResult: ...


@dataclass(frozen=True)
class Method:
    name: str
    config_class: type[MethodConfig]
    train: TrainFn
    summary: str = ""
