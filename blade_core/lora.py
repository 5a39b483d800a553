"""All LoRA wiring (peft) in one place: target discovery, the trainable adapter, the frozen stack, saving.

Stacking keeps every adapter separate and un-merged: each stacked adapter is loaded under its own name
(`stack0`, `stack1`, ...) and all of them plus the new one are *active* at once (peft sums the LoRA deltas of
the active adapters), with only the new adapter's parameters trainable. Nothing is merged into the base
weights, so there is no bf16 rounding of a merged copy, and the stacked adapters' files are only ever read:
they stay byte-identical. The price is one extra low-rank matmul per stacked adapter and target layer.

Trainable parameters are found by name (`lora_` and `.{adapter}.`), never by a hand-written list.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch import nn

from blade_core.methods.base import MethodConfig
from blade_core.modeling import load_model_and_tokenizer, pick_device

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STACK_PREFIX = "stack"


def _linear_types() -> tuple[type, ...]:
    try:  # GPT-2-style models use transformers' Conv1D (a transposed linear), which peft also adapts
        from transformers.pytorch_utils import Conv1D

        return (nn.Linear, Conv1D)
    except ImportError:  # pragma: no cover
        return (nn.Linear,)


def default_target_modules(model: nn.Module) -> list[str]:
    """q/k/v/o/gate/up/down projections when present, else every linear leaf name except the LM head."""
    from peft.tuners.lora import LoraLayer

    kinds = (*_linear_types(), LoraLayer)  # a layer already carrying a stacked adapter is still a target
    names = set()
    for name, mod in model.named_modules():
        parts = name.split(".")
        if any(p.startswith("lora_") or p == "base_layer" for p in parts):
            continue  # the insides of a LoRA layer
        if isinstance(mod, kinds):
            names.add(parts[-1])
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output = get_output_embeddings() if get_output_embeddings is not None else None
    out_names = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if mod is output}
    llama = [n for n in LLAMA_TARGETS if n in names]
    if llama:
        return llama
    found = sorted(names - out_names - {"lm_head"})
    if not found:
        raise ValueError(f"{type(model).__name__}: no nn.Linear layers to put LoRA adapters on")
    return found


def is_peft(model: nn.Module) -> TypeGuard[PeftModel]:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_names(model: nn.Module) -> list[str]:
    return list(model.peft_config) if is_peft(model) else []


def _activate(model: PeftModel, names: Sequence[str], trainable: str | None) -> None:
    """Make `names` the active adapters (all summed) and freeze every parameter except `trainable`'s LoRA
    ones."""
    tuner = cast("LoraModel", model.base_model)  # its set_adapter takes several names; PeftModel's one
    tuner.set_adapter(list(names))
    mark_trainable(model, trainable)


def mark_trainable(model: nn.Module, adapter: str | None) -> list[str]:
    """requires_grad only on LoRA parameters of `adapter` (by name prefix); returns their names."""
    marker = f".{adapter}." if adapter else None
    names = []
    for name, param in model.named_parameters():
        param.requires_grad = (
            marker is not None and "lora_" in name and (marker in name or name.endswith(f".{adapter}"))
        )
        if param.requires_grad:
            names.append(name)
    return names


def lora_config(model: nn.Module, config: MethodConfig) -> Any:
    from peft import LoraConfig

    targets = list(config.lora_target_modules) if config.lora_target_modules else None
    method_targets = getattr(config, "lora_targets", None)  # a method that trains named modules only (RMU)
    if targets is None and callable(method_targets):
        targets = method_targets(model)
    targets = targets or default_target_modules(model)
    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        bias="none",
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def attach_adapter(model: nn.Module, config: MethodConfig, name: str = "unlearn") -> nn.Module:
    """A PeftModel with a fresh trainable LoRA adapter `name` on top of whatever stack `model` carries
    (frozen)."""
    from peft import get_peft_model

    if is_peft(model):
        if name in model.peft_config:
            raise ValueError(f"adapter name {name!r} is already in use")
        model.add_adapter(name, lora_config(model.get_base_model(), config))
        peft_model = model
    else:
        with _no_peft_deprecation_warning():
            peft_model = get_peft_model(model, lora_config(model, config), adapter_name=name)
    _activate(peft_model, adapter_names(peft_model), trainable=name)
    return peft_model


@contextlib.contextmanager
def _no_peft_deprecation_warning() -> Iterator[None]:
    """PEFT reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning on
    every wrap: one line per run that no user of ours can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def check_adapter_dir(path: str | Path) -> Path:
    path = Path(path)
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: not a PEFT adapter directory (missing {', '.join(missing)})")
    return path


def load_stack(model: nn.Module, adapter_dirs: Sequence[str | Path]) -> nn.Module:
    """`model` with each adapter dir loaded (in order, names stack0..), all active, every parameter frozen."""
    from peft import PeftModel

    if not adapter_dirs:
        return model
    names = []
    for i, directory in enumerate(adapter_dirs):
        directory, name = check_adapter_dir(directory), f"{STACK_PREFIX}{i}"
        with _no_peft_deprecation_warning():
            if is_peft(model):
                model.load_adapter(str(directory), adapter_name=name, is_trainable=False)
            else:
                model = PeftModel.from_pretrained(
                    model, str(directory), adapter_name=name, is_trainable=False
                )
        names.append(name)
    _activate(cast("PeftModel", model), adapter_names(model), trainable=None)  # a PeftModel once one loaded
    return model


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_adapter(model: nn.Module, out_dir: str | Path, name: str = "unlearn") -> Path:
    """Write adapter `name` as a top-level PEFT adapter dir (adapter_config.json, adapter_model.safetensors).

    PeftModel.save_pretrained puts non-default adapters in a sub-folder; we write the two files directly so
    `PeftModel.from_pretrained(base, out_dir)` loads it as is.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model, adapter_name=name)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = cast("PeftModel", model).peft_config[name]
    config.save_pretrained(str(out_dir))
    # peft records the adapter's own inference_mode; a saved adapter is loaded for inference by default.
    cfg_path = out_dir / "adapter_config.json"
    data = json.loads(cfg_path.read_text())
    data["inference_mode"] = True
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return out_dir


def load_with_stack(
    model_ref: str | Path, adapter_dirs: Sequence[str | Path] = (), device: str | torch.device | None = None
) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer): base model plus the given adapters, all active, frozen."""
    model, tokenizer = load_model_and_tokenizer(model_ref, pick_device(device))
    model = load_stack(model, adapter_dirs)
    model.eval()
    return model, tokenizer
