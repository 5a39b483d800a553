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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

FILENAME = "checkpoint.pt"


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def has_checkpoint(directory: str | Path | None) -> bool:
    return directory is not None and checkpoint_path(directory).is_file()


def config_fingerprint(config: Any) -> Any:
    """The config as plain JSON (tuples as lists) minus `checkpoint_every`: what a checkpoint must match."""
    return json.loads(json.dumps({k: v for k, v in asdict(config).items() if k != "checkpoint_every"}))


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
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` wrote into the given objects; returns the saved `state`."""
    path = checkpoint_path(directory)
    payload = torch.load(path, map_location="cpu", weights_only=True)
    params = dict(model.named_parameters())
    missing = [n for n in payload["weights"] if n not in params]
    if missing:
        raise ValueError(
            f"{path}: checkpoint does not match the model (unknown parameters, e.g. {missing[0]})"
        )
    with torch.no_grad():
        for name, value in payload["weights"].items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    for key, opt in optimizers.items():
        opt.load_state_dict(payload["optimizers"][key])
    for key, stream in streams.items():
        stream.load_state_dict(payload["streams"][key])
    set_rng_state(payload["rng"])
    return payload["state"]
