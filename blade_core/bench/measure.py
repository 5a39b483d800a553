"""What the bench measures around a run besides its metrics: peak memory (CUDA's allocator or the process RSS)
and the machine it ran on (results.json "machine")."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import resource
import threading
from collections.abc import Sequence
from typing import Any

from blade_core.build_common import cpu_identity, mkl_settings


def _release_free_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc `malloc_trim`), so RSS measures anew."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS deltas may understate reused memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory of a block in MB: CUDA's max allocated on GPU; on CPU, peak process RSS (sampled every 20
    ms)
    minus the RSS at entry, i.e. what the block added (model copies, optimiser state, activations)."""

    def __init__(self, device_type: str = "cpu", interval: float = 0.02):
        self.device_type, self.interval = device_type, interval
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss_mb() -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError, IndexError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def __enter__(self) -> PeakMemory:
        if self.device_type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
            self._base: float = torch.cuda.memory_allocated()
            return self
        _release_free_memory()  # else the run reuses freed heap pages and its growth barely shows in RSS
        self._base = self.rss_mb()
        self._max = self._base

        def sample() -> None:
            while not self._stop.wait(self.interval):
                self._max = max(self._max, self.rss_mb())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device_type == "cuda":
            import torch

            self.peak_mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._max = max(self._max, self.rss_mb())
        self.peak_mb = self._max - self._base


def numpy_simd() -> list[str]:
    """The SIMD targets numpy dispatches to on this CPU beyond its baseline, e.g. ['X86_V3', 'X86_V4'].

    The evaluation's means and exponentials run in numpy, whose AVX-512 kernels round some results
    differently in the last bit; `NPY_DISABLE_CPU_FEATURES` turns targets off (docs/results.md, "numpy's SIMD
    kernels change the metrics' last digit"). Models do not depend on it: training runs in torch."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # a numpy without the runtime dispatch tables
        return []
    return [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]


def numpy_narrower_hint(identity: str, simd: Sequence[str]) -> str | None:
    """A hint when torch was told to use AVX2 (`ATEN_CPU_CAPABILITY=avx2`: `identity` ends in AVX2) on a CPU
    whose numpy still dispatches to AVX-512 (`simd` has X86_V4): the models then match an AVX2 box's, the
    metrics' last digits may not."""
    if not identity.endswith("AVX2") or "X86_V4" not in simd:
        return None
    wide = " ".join(name for name in simd if name != "X86_V3")
    return (
        f"torch runs AVX2 here but numpy dispatches to {wide}: to match an AVX2 box's metrics to the last "
        f'digit, also set NPY_DISABLE_CPU_FEATURES="{wide}"'
    )


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    summary = (
        f"{cores} CPU cores ({cpu}), torch {torch.__version__} with {torch.get_num_threads()} threads, "
        + (f"GPU {gpu}" if gpu else "no GPU")
    )
    return {
        "cpu": cpu,
        "cpu_identity": cpu_identity(),  # with `mkl`, what a bit-for-bit comparison needs (as build keys)
        "mkl": mkl_settings(),
        "numpy_simd": numpy_simd(),  # the evaluation's last digits depend on it
        "cores": cores,
        "gpu": gpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "summary": summary,
    }
