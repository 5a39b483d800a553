"""Fixtures for the engine tests (`tests/test_engine_*.py`).

- `one_thread`: torch on one intra-op thread for the test (tiny models run several times faster that way on
  a shared 2-core machine, and results do not depend on how busy the machine is); restored afterwards.
- `engine_world`: a session-wide directory with a tiny Llama that has memorised its forget and retain rows
  (so forgetting has something to remove), the two JSONL files, and a random-init tiny model.
- `step_lines_without_clock(mp)`: a heartbeat line after every step, reading 'label: i/N' (the real line's
  durations come from the clock; tests/test_heartbeat.py checks those for figures it passes in).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from blade_core import heartbeat


def step_lines_without_clock(mp: pytest.MonkeyPatch) -> None:
    """Through `mp`: a progress line after every step, with only its label, step and total."""
    mp.setattr(heartbeat, "EVERY_S", 0.0)
    mp.setattr(heartbeat, "progress_line", lambda label, step, total, elapsed_s: f"{label}: {step}/{total}")


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class EngineWorld:
    model: Path  # memorised tiny model dir
    forget: Path  # JSONL, 6 QA rows
    retain: Path  # JSONL, 24 QA rows
    random_model: Path  # random-init tiny model dir


@pytest.fixture(scope="session")
def engine_world(tmp_path_factory) -> EngineWorld:
    import torch

    from blade_core.testing import tiny_qa_rows, write_rows, write_tiny_model

    root = tmp_path_factory.mktemp("engine_world")
    forget, retain = tiny_qa_rows(6, seed=0, prefix="f"), tiny_qa_rows(24, seed=1, prefix="r")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = write_tiny_model(root / "model", fit_rows=forget + retain, fit_steps=200)
        random_model = write_tiny_model(root / "random")
    finally:
        torch.set_num_threads(before)
    return EngineWorld(
        model=model,
        forget=write_rows(root / "forget.jsonl", forget),
        retain=write_rows(root / "retain.jsonl", retain),
        random_model=random_model,
    )
