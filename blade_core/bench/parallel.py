"""`--jobs N`: a bench's independent runs (the selection grid, the test grid) spread over N worker processes.

Every run loads its own copy of the target, trains, evaluates and writes its own run dir, so runs share
nothing but the read-only models and data. Runs already cached are answered in the calling process; the rest
go to a pool of spawned processes, started once per bench, each with an equal share of the CPU's threads
(unless OMP_NUM_THREADS says otherwise). Results come back in the order of the specs, whatever order the
runs finish in, and a run that fails cancels the runs not yet started and raises in the caller. `jobs=1`
runs everything in order in the calling process, as before. `--sequential`'s sequences go through the same
pool (`stream.run_sequences`): one sequence's requests in order in one process, sequences side by side.

    blade bench --synthetic --jobs 2 --out out/bench    # 2 CPU cores: one single-threaded run on each
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from blade_core.bench.cache import cached_result, fresh_run
from blade_core.bench.settings import BenchPlan, Log, worker_threads
from blade_core.build_common import torch_threads

RunResult = tuple[dict[str, Any], list[dict[str, Any]]]  # (results row, history)


@dataclass(frozen=True)
class RunSpec:
    """One run of a bench: `fresh_run`'s arguments."""

    plan: BenchPlan
    method: str
    split: str
    seed: int
    gold_ref: dict[str, Any] | None = None
    multiplier: float | None = None
    tag: str = ""

    @property
    def label(self) -> str:
        suffix = f" {self.tag}" if self.tag else ""
        return f"{self.method} {self.split} seed {self.seed}{suffix}"


class Labelled(Protocol):
    @property
    def label(self) -> str: ...


Spec = TypeVar("Spec", bound=Labelled)
Result = TypeVar("Result")


def run_all(specs: Sequence[RunSpec], *, jobs: int, log: Log, desc: str, progress: bool) -> list[RunResult]:
    """Each spec's (row, history), in the order of `specs`, made (or reused) by up to `jobs` processes."""
    return made(specs, _cached_run, _run, jobs=jobs, log=log, desc=desc, progress=progress)


def made(
    specs: Sequence[Spec],
    cached: Callable[[Spec], Result | None],
    make: Callable[[Spec, Log], Result],
    *,
    jobs: int,
    log: Log,
    desc: str,
    progress: bool,
) -> list[Result]:
    """`make(spec, log)` of every spec `cached` does not answer, in the calling process (`jobs` 1, or one
    spec to make) or in the pool (`make` must then be a module-level function); results in spec order."""
    results: list[Result | None] = [cached(s) for s in specs]
    todo = [i for i, r in enumerate(results) if r is None]
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc=desc, unit="run", disable=not progress)
    try:
        if jobs <= 1 or len(todo) <= 1:
            with torch_threads(worker_threads(jobs)):  # a lone run of a pool's bench: the pool's count
                for i in todo:
                    bar.set_postfix_str(specs[i].label)
                    results[i] = make(specs[i], log)
                    bar.update()
        else:
            _make_in_pool(specs, make, todo, results, jobs, log, bar)
    finally:
        bar.close()
    assert all(r is not None for r in results)
    return cast(list[Result], results)


def _make_in_pool(
    specs: Sequence[Spec],
    make: Callable[[Spec, Log], Result],
    todo: list[int],
    results: list[Result | None],
    jobs: int,
    log: Log,
    bar: tqdm,
) -> None:
    pool, threads = _pool(jobs)
    log(f"{len(todo)} runs on {jobs} processes ({threads} torch thread(s) each)")
    futures: dict[Future[Result], int] = {pool.submit(make, specs[i], _log_to_stderr): i for i in todo}
    try:
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            bar.update()
    except BaseException:
        for future in futures:
            future.cancel()
        close_pool()
        raise


_pools: dict[int, tuple[ProcessPoolExecutor, int]] = {}


def _pool(jobs: int) -> tuple[ProcessPoolExecutor, int]:
    """The bench's pool of `jobs` worker processes (started once, kept until `close_pool`: starting one
    costs each process a torch import) and the torch threads each uses."""
    if jobs not in _pools:
        close_pool()
        threads = worker_threads(jobs)
        pool = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=multiprocessing.get_context("spawn"),  # no forked torch or tqdm state
            initializer=_start_worker,
            initargs=(threads,),
        )
        _pools[jobs] = (pool, threads)
    return _pools[jobs]


def close_pool() -> None:
    """Stop the worker processes (`run_bench` calls it when it ends, however it ends)."""
    while _pools:
        _, (pool, _) = _pools.popitem()
        pool.shutdown(wait=True, cancel_futures=True)


def _cached_run(spec: RunSpec) -> RunResult | None:
    return cached_result(
        spec.plan, spec.method, spec.split, spec.seed, multiplier=spec.multiplier, tag=spec.tag
    )


def _run(spec: RunSpec, log: Log) -> RunResult:
    """The spec's run, made afresh (`run_all` has found no cached one)."""
    return fresh_run(
        spec.plan,
        spec.method,
        spec.split,
        spec.seed,
        spec.gold_ref,
        log,
        multiplier=spec.multiplier,
        tag=spec.tag,
    )


def _start_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model load would drown the log


def _log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
