"""What a bench holds fixed and what one invocation runs on: `BenchSettings` and its presets (`--quick`), the
plan (`BenchPlan`, `ValidationWorld`), the seeds, and the parsing of `--methods`/`--splits` lists."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from blade_core.lr_scale import auto_lr_scale

SPLITS: tuple[str, ...] = ("forget01", "forget05", "forget10")
ROW_KEYS: tuple[str, ...] = (
    "method",
    "split",
    "seed",
    "MU",
    "Prob",
    "ROUGE",
    "HM",
    "forget_quality",
    "privleak",
    "steps",
    "time_s",
    "peak_mem_mb",
)
DYNAMICS_METHODS: tuple[str, ...] = ("blade", "pdu")  # methods with a multiplier and a T_trans to plot
PAPER_SEEDS: tuple[int, ...] = (42, 123, 456, 789, 1024)  # the BLADE paper's five seeds
RESULTS_VERSION = 4  # bump when a run row is computed differently (invalidates cached runs); 4: issue 9

Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchSettings:
    """What a bench run holds fixed across methods. Presets in PRESETS; `--quick` picks the small one."""

    authors: int  # synthetic world size (`--synthetic` only)
    model_size: str  # `blade model build` size of target and gold models (`--synthetic` only)
    # Two-stage targets (blade_core/pretrain.py): a base pretrained once on a corpus without the world's
    # authors, fine-tuned 5 epochs on the world as TOFU fine-tunes Llama; False: trained from scratch.
    pretrained: bool = True
    # Where target and gold models train: the CPU (default: bit-for-bit per CPU kind, docs/results.md), or
    # an accelerator, e.g. `cuda`, for the sizes a CPU cannot pretrain in useful time (`large`).
    build_device: str = "cpu"
    # None: every method runs its own published schedule (baselines: 10 epochs at batch 32; BLADE: to its
    # convergence stop under its cap); an int: a common step cap on every method (an option, not the default)
    max_steps: int | None = None
    batch_size: int | None = None  # None: each method's published batch; an int: the same for every method
    max_length: int = 256  # tokens per row, every method (MethodConfig default)
    seeds: int = 5  # the first `seeds` of PAPER_SEEDS (the BLADE paper: all five)
    eval_max_rows: int | None = None  # cap on rows per evaluation set (None: all of them)
    eval_max_new_tokens: int = 200  # greedy ROUGE generation length (OpenUnlearning generation/default.yaml)
    eval_batch_size: int = 32
    world_seed: int = 0  # the test world, the one reported
    build_seed: int = 0
    # The engine's LR factor on Adam learning rates (blade_core/lr_scale.py). None: the target's training LR
    # over TOFU's fine-tuning LR; 1.0: the published values as they are.
    lr_scale: float | None = None
    validation_world_seed: int = 1000  # the selection's world: never reported
    selection_split: str = "forget05"  # the validation world's split the selection runs on
    # Seeds each grid point runs at on the validation world (the first of PAPER_SEEDS), scored by their mean
    # HM. One by default, as the issue-9 protocol was run; more where one seed cannot separate the
    # multipliers (stacked requests: docs/results.md, "Sequential requests").
    selection_seeds: int = 1
    # Multipliers of the rule's learning rates tried on the validation world, the same for every method:
    # log-spaced around the rule's value (1.0).
    lr_grid: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    lr_grid_extend: int = 2  # points tried past either edge of lr_grid when the best sits on it
    sequential_split: str = "forget10"  # `--sequential`/`--scale` draw their author sets from this split


PRESETS: dict[str, BenchSettings] = {
    # 40 selection runs (8 methods x 5 multipliers) then 120 runs (8 methods x 3 splits x 5 seeds).
    "default": BenchSettings(authors=40, model_size="default", seeds=5),
    # Under ten minutes on 2 CPU cores: a 3-point grid, one seed, a common step cap, a smaller world and
    # capped evaluation sets.
    "quick": BenchSettings(
        authors=20,
        model_size="quick",
        max_steps=30,
        seeds=1,
        eval_max_rows=20,
        eval_max_new_tokens=32,
        lr_grid=(0.25, 1.0, 4.0),
    ),
}


# Fields added after results were published, with the value every earlier run had: left out of a run's
# record while they hold it, so earlier results.json files and cached runs still compare equal
# (`blade bench-merge`, the run cache).
_LATER_FIELDS: dict[str, Any] = {"build_device": "cpu"}


def settings_record(settings: BenchSettings) -> dict[str, Any]:
    """`settings` as results.json and the run cache record them."""
    return {k: v for k, v in asdict(settings).items() if _LATER_FIELDS.get(k, object()) != v}


def seed_list(n: int) -> list[int]:
    """The first n of PAPER_SEEDS, then 1025, 1026, ... beyond five."""
    return list(PAPER_SEEDS[:n]) + [PAPER_SEEDS[-1] + i for i in range(1, n - len(PAPER_SEEDS) + 1)]


@dataclass
class BenchPlan:
    """Everything one bench invocation runs on."""

    data_dir: Path
    target: Path
    golds: dict[str, Path]  # split -> gold model dir (missing: forget quality None, PrivLeak vs AUC 0.5)
    out_dir: Path
    methods: list[str]
    splits: list[str]
    seeds: list[int]
    settings: BenchSettings
    command: str = ""
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # method -> config fields (bench-wide)
    progress: bool = True
    validation: ValidationWorld | None = None  # where learning rates are selected (None: the rule's value)
    multipliers: dict[str, float] = field(default_factory=dict)  # method -> chosen LR multiplier (default 1)
    sequential: int | None = None  # `--sequential N`: N stacked requests instead of the splits grid
    scales: list[int] = field(default_factory=list)  # `--scale 1,2,4`: forget-set multiples
    jobs: int = 1  # `--jobs N`: runs made side by side in N processes (parallel.py)
    # What the selection scores (selection.py): "request", HM of one request on the selection split;
    # "sequence" (`--select-on sequence`, with --sequential N), HM_all after N stacked requests.
    select_on: str = "request"

    def runs_name(self, method: str) -> str:
        """The directory a method's cached runs live under: its name, plus a digest of its `--set` fields when
        it has any, so benches that change a method's config never store runs over each other's (the
        selection's cache is shared by every bench on one cache dir)."""
        if not (fields := self.overrides.get(method)):
            return method
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
        return f"{method}-set-{digest[:10]}"

    @property
    def run_threads(self) -> int:
        """Torch CPU threads of each run (`worker_threads`). A float sum split over more threads rounds
        differently, so it is in every run's fingerprint: a cached run is reused at the same count only."""
        return worker_threads(self.jobs)

    @property
    def lr_scale(self) -> float:
        """settings.lr_scale, or the automatic one for this target (see BenchSettings.lr_scale)."""
        scale = self.settings.lr_scale
        return auto_lr_scale(self.target) if scale is None else scale


def worker_threads(jobs: int) -> int:
    """Torch threads per run with `jobs` runs side by side: OMP_NUM_THREADS when set, else the cores shared
    out (`--jobs 2` on 2 cores: 1 each); with one job, this process's own count.

    The variable is read, not this process's count: torch reads it once, at import, so a process that set it
    later (a test) keeps its import-time count, and children handed that count would do other arithmetic
    than the runs asked for."""
    if (asked := _omp_threads()) is not None:
        return asked
    if jobs <= 1:
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // jobs)


def _omp_threads() -> int | None:
    """OMP_NUM_THREADS's thread count (its first, outermost level), or None when unset or not a count."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


@dataclass(frozen=True)
class ValidationWorld:
    """The world learning rates are selected on: a TOFU-format dir of its own seed and its target model."""

    data_dir: Path
    target: Path
    world_seed: int | None = None
    # where its selection runs are cached (None: OUT/selection/); a synthesised world keeps them in the bench
    # cache beside it, so a later bench with another --out reuses them instead of repeating the selection
    runs_dir: Path | None = None


def settings_for(quick: bool, **changes: Any) -> BenchSettings:
    """The preset (`quick` or `default`) with the given fields replaced (None values ignored)."""
    base = PRESETS["quick" if quick else "default"]
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


def parse_list(text: str | None, allowed: Sequence[str], what: str) -> list[str]:
    if not text:
        return list(allowed)
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in allowed]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return items
