"""Self-describing adapter archives and one-file exports of an effective model (base + adapter stack).

Every adapter dir the service stores names its base model in `adapter_config.json`
(`base_model_name_or_path`: the hub id, or the registry name for a model that is a local dir or a storage
key; `revision` when the source pins one as `hub/id@revision`), and `run.json` carries ids, never a
worker-local path. `export_adapter` writes the effective model as one PEFT adapter (the exact compaction of
the stack, `blade_core.compaction`), which vLLM and LoRAX serve as one LoRA; `export_merged` writes full
merged weights (safetensors) plus the tokenizer.

    python -c "from blade_core.export import export_merged; help(export_merged)"
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from blade_core import lora
from blade_core.compaction import compact_adapters
from blade_core.modeling import load_model, load_tokenizer, pick_device

FORMATS = ("adapter", "merged")


def base_model_reference(name: str, source: str, *, source_is_local: bool) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for a registered base model: a hub id `org/model[@rev]` as is,
    the registry `name` for a local dir or a storage key (a worker-local path must never leave the worker)."""
    if source_is_local:
        return name, None
    hub_id, _, revision = source.partition("@")
    return hub_id, revision or None


def describe_adapter_dir(
    adapter_dir: str | Path,
    *,
    base_model: str,
    revision: str | None = None,
    run_fields: dict[str, Any] | None = None,
) -> Path:
    """Make an adapter dir self-describing: adapter_config.json names `base_model` (and `revision`), and
    run.json's path fields are replaced by `run_fields` (ids; e.g. {"base_model": ..., "stack": [ids]})."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    config = json.loads(cfg_path.read_text())
    config["base_model_name_or_path"] = base_model
    config["revision"] = revision
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    run_path = adapter_dir / "run.json"
    if run_path.is_file():
        run = json.loads(run_path.read_text())
        run.update({"base_model": base_model, "revision": revision, **(run_fields or {})})
        run_path.write_text(json.dumps(run, indent=1))
    return adapter_dir


def export_adapter(
    adapter_dirs: Sequence[str | Path], out_dir: str | Path, *, base_model: str, revision: str | None = None
) -> dict[str, Any]:
    """The stack as one exact PEFT adapter in `out_dir`; returns the compaction report."""
    report = compact_adapters(adapter_dirs, out_dir, base_model=base_model)
    describe_adapter_dir(out_dir, base_model=base_model, revision=revision)
    return report.as_dict()


def export_merged(
    base_ref: str | Path,
    adapter_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    device: str | None = None,
) -> dict[str, Any]:
    """Base + stack merged into full weights (fp32 merge, saved in the base model's dtype), safetensors +
    tokenizer + config, loadable with `AutoModelForCausalLM.from_pretrained(out_dir)`."""
    dev = pick_device(device)
    model = load_model(base_ref, dev, torch.float32)
    target_dtype = getattr(model.config, "torch_dtype", None) or getattr(model.config, "dtype", None)
    model = lora.load_stack(model, adapter_dirs)
    if lora.is_peft(model):
        model = model.merge_and_unload()
    if isinstance(target_dtype, torch.dtype) and target_dtype != torch.float32:
        model = model.to(target_dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    load_tokenizer(base_ref).save_pretrained(str(out_dir))
    # a local source path in the saved config would leak the worker's layout
    cfg_path = out_dir / "config.json"
    config = json.loads(cfg_path.read_text())
    config.pop("_name_or_path", None)
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return {"adapters": len(adapter_dirs), "dtype": str(model.dtype).removeprefix("torch.")}
