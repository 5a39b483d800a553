"""The worker's pool processes: their id, what each one sets up (signals) and how one frees the accelerator.

Importing this module connects the signals; `worker.tasks` does so for every worker process.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from typing import Any

from celery import signals

from blade_service.persistence import db

log = logging.getLogger("blade.worker")

WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


def worker_id() -> str:
    """host:pid of this process (renewed in each forked pool child)."""
    return WORKER_ID


@signals.worker_process_init.connect(weak=False)
def _after_fork(**_: Any) -> None:
    """A forked pool child must not reuse the parent's pooled database connections (close=False: the parent
    keeps using its own sockets)."""
    for engine in list(getattr(db, "_engines", {}).values()):
        engine.dispose(close=False)
    global WORKER_ID
    WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


# True in a worker whose prefork children run one task each (`--max-tasks-per-child 1`, the GPU queue's
# default, `cli.worker`): set in the main process before it forks them, so the children inherit it.
_ONE_TASK_PER_CHILD = False


@signals.worker_init.connect(weak=False)
def _note_pool(sender: Any = None, **_: Any) -> None:
    global _ONE_TASK_PER_CHILD
    _ONE_TASK_PER_CHILD = getattr(sender, "max_tasks_per_child", None) == 1


@signals.worker_init.connect(weak=False)
def _preload(**_: Any) -> None:
    """Import the ML stack once in the main process, so each forked pool child (one per task on the GPU queue)
    starts in milliseconds instead of re-importing torch. Importing torch does not initialise CUDA: that still
    happens only inside a task, in the child."""
    try:
        import peft  # noqa: F401  (`blade_core.lora` imports it where it loads a stack)
        from transformers.utils import logging as hf_logging

        import blade_core.evaluation.generation
        import blade_core.evaluation.request
        import blade_core.lora
        import blade_core.unlearn  # noqa: F401
        from blade_core.evaluation.metrics import rouge_l_scorer
    except ImportError as exc:  # the [ml] extra is missing: tasks will fail with a readable error
        log.warning("worker.preload_failed", extra={"error": repr(exc)})
        return
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model load is no line of a JSON log
    # Builds the ROUGE scorer once: importing rouge_score (nltk, scipy) cost each child 1.5 s of a request.
    rouge_l_scorer()
    # What the preload built lives as long as the process: the collector's permanent generation keeps it out
    # of every later collection (a full one walked its ~0.5 M objects in 0.4 s, `free_accelerator` between
    # a request's evaluations included), and a forked child leaves its pages shared.
    gc.collect()
    gc.freeze()


def free_accelerator() -> None:
    """Collect garbage and hand cached CUDA memory back, when torch is loaded and CUDA initialised. Nothing
    in a pool child that exits after its task (`_ONE_TASK_PER_CHILD`): the exit hands everything back, and a
    full collection of a heap holding torch and a trained model took about 1 s of a request on the CPU
    (docs/performance.md)."""
    if _ONE_TASK_PER_CHILD:
        return
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
