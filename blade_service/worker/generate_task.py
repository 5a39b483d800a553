"""The `generate` task (inference queue): a greedy completion by a base model and its active adapter stack;
the loaded model is cached per stack digest (the newest two per process)."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from typing import Any

from blade_service.contracts.names import TaskName
from blade_service.persistence.db import session_scope
from blade_service.persistence.settings import get_settings
from blade_service.persistence.storage import get_storage
from blade_service.worker.artifacts import active_stack, fetch_adapter, resolve_base_model, task_base_model
from blade_service.worker.celery_app import app
from blade_service.worker.errors import TaskFailure
from blade_service.worker.process import free_accelerator

log = logging.getLogger("blade.worker")

_MODEL_CACHE: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
_MODEL_CACHE_SIZE = 2
_MODEL_LOCK = threading.Lock()


@app.task(name=TaskName.GENERATE.value, soft_time_limit=300, time_limit=360)
def generate(
    *,
    prompt: str,
    base_model_id: str | None = None,
    base_model: str | None = None,
    max_new_tokens: int = 64,
    as_question: bool = False,
) -> dict[str, Any]:
    """Greedy completion by base + active stack; the model is cached per stack digest. With `as_question`,
    `prompt` is a question, asked the way training and evaluation ask it (`format_question`); the result's
    `prompt` is the text the model continued."""
    settings = get_settings()
    try:
        storage = get_storage(settings)
        with session_scope(settings) as session:
            base = task_base_model(session, base_model_id=base_model_id, base_model=base_model)
            if base is None:
                raise TaskFailure("not_found", f"no base model {base_model_id or base_model!r}")
            stack = [(a.id, a.storage_key, a.sha256) for a in active_stack(session, base_model_id=base.id)]
            source, revision = base.source, base.revision
        digest = hashlib.sha256("|".join([source, *(f"{i}:{s}" for i, _, s in stack)]).encode()).hexdigest()
        with _MODEL_LOCK:
            entry = _MODEL_CACHE.get(digest)
            if entry is None:
                from blade_core.lora import load_with_stack

                ref = resolve_base_model(storage, settings, source, revision)
                dirs = [fetch_adapter(storage, settings, adapter_id=i, key=k, sha256=s) for i, k, s in stack]
                entry = load_with_stack(ref, dirs, settings.device)
                _MODEL_CACHE[digest] = entry
                while len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
                    _MODEL_CACHE.popitem(last=False)
                    free_accelerator()
            _MODEL_CACHE.move_to_end(digest)
            model, tokenizer = entry
            from blade_core.data import format_question
            from blade_core.evaluation.generation import generate as greedy

            if as_question:
                prompt = format_question(tokenizer, prompt)
            text = greedy(
                model, tokenizer, [prompt], max_new_tokens=max(1, int(max_new_tokens)), batch_size=1
            )[0]
        return {
            "text": text,
            "prompt": prompt,
            "base_model": base.name,
            "stack": [i for i, _, _ in stack],
            "stack_digest": digest,
        }
    except TaskFailure as exc:  # not_found, or base_model_unavailable: the API answers 503, not 502
        log.warning("generate.failed", extra={"base_model_id": base_model_id, "code": exc.code})
        return {"error": {"code": exc.code, "message": exc.message}}
    except Exception as exc:
        log.exception("generate.error", extra={"base_model_id": base_model_id, "base_model": base_model})
        return {"error": {"code": "generate_failed", "message": f"{type(exc).__name__}: {exc}"}}
