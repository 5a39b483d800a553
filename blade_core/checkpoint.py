"""Checkpoints of a training loop: trainable weights, optimiser states, loop state, RNG and data-order state.

One file, `checkpoint.pt`, written atomically (temp file + rename) so a kill mid-write leaves the previous
one. Only trainable parameters are stored (the adapter, or every weight of a full fine-tune), keyed by name.
Resuming restores all of it, so the resumed run continues exactly where the saved one was (tested in
`tests/test_engine_resume.py`).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

import torch

FILENAME = "checkpoint.pt"


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def has_checkpoint(directory: str | Path | None) -> bool:
    return directory is not None and checkpoint_path(directory).is_file()


# when it saves, whether a bar is drawn, and how BLADE computes the same update
NOT_FINGERPRINTED = frozenset({"checkpoint_every", "show_progress", "stacked_forward"})


def config_fingerprint(config: Any) -> Any:
    """The config as plain JSON (tuples as lists) minus NOT_FINGERPRINTED: what a checkpoint must match."""
    return json.loads(json.dumps({k: v for k, v in asdict(config).items() if k not in NOT_FINGERPRINTED}))


def _default(field: Any) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return MISSING


def config_mismatch(saved: Mapping[str, Any] | None, config: Any) -> list[str]:
    """The fields on which a checkpoint's fingerprint and `config` disagree, as "name: saved -> now".

    A field the saved fingerprint lacks was added to the config after the checkpoint was written (an upgrade
    deployed while a request was paused); it matches when its value now is its default, which is why a new
    field must default to the behaviour the code had before it. A field the fingerprint holds and the config
    no longer has never matches: the code that read it is gone.
    """
    if saved is None:
        return ["(the checkpoint records no config)"]
    now = config_fingerprint(config)
    defaults = {f.name: _default(f) for f in fields(config)}
    diffs = []
    for name in sorted((set(now) | set(saved)) - NOT_FINGERPRINTED):  # older checkpoints saved them
        if name not in now:
            diffs.append(f"{name}: {saved[name]!r} -> (no longer a setting)")
        elif name not in saved:
            default = defaults[name]
            if default is MISSING or now[name] != json.loads(json.dumps(default)):
                diffs.append(f"{name}: (not a setting then; its default) -> {now[name]!r}")
        elif saved[name] != now[name]:
            diffs.append(f"{name}: {saved[name]!r} -> {now[name]!r}")
    return diffs


class CheckpointMismatch(ValueError):
    """A checkpoint this run cannot continue: written under another config, or for another model.

    `differences` lists what differs (`config_mismatch`'s "name: saved -> now" lines, or the parameter the
    model lacks); the message adds the checkpoint's directory."""

    def __init__(self, directory: str | Path, differences: list[str]):
        self.differences = differences
        super().__init__(f"{directory}: the checkpoint cannot continue this run ({'; '.join(differences)})")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizers: Mapping[str, Any],
    streams: Mapping[str, Any],
    state: Mapping[str, Any],
) -> Path:
    """Write trainable weights, optimiser and stream states, RNG states and `state` atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "weights": {n: p.detach().to("cpu").clone() for n, p in model.named_parameters() if p.requires_grad},
        "optimizers": {k: opt.state_dict() for k, opt in optimizers.items()},
        "streams": {k: s.state_dict() for k, s in streams.items()},
        "rng": rng_state(),
        "state": dict(state),
    }
    final = checkpoint_path(directory)
    tmp = final.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, final)
    return final


def load_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizers: Mapping[str, Any],
    streams: Mapping[str, Any],
    config: Any,
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` wrote into the given objects; returns the saved `state`.

    Raises CheckpointMismatch, before touching any of them, when the saved `state["config"]` differs from
    `config` (`config_mismatch`) or the checkpoint holds a parameter the model lacks."""
    payload = torch.load(checkpoint_path(directory), map_location="cpu", weights_only=True)
    diffs = config_mismatch(payload["state"].get("config"), config)
    if diffs:
        raise CheckpointMismatch(directory, diffs)
    params = dict(model.named_parameters())
    missing = [n for n in payload["weights"] if n not in params]
    if missing:
        raise CheckpointMismatch(directory, [f"the model has no parameter {missing[0]}"])
    with torch.no_grad():
        for name, value in payload["weights"].items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    for key, opt in optimizers.items():
        opt.load_state_dict(payload["optimizers"][key])
    for key, stream in streams.items():
        stream.load_state_dict(payload["streams"][key])
    set_rng_state(payload["rng"])
    return payload["state"]
