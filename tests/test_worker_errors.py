"""A failed task names its cause by the exception's type (`worker.errors.classify`), never by its message
text: a CUDA out-of-memory error is `out_of_memory` whatever it says, a RuntimeError that merely mentions
memory is not; and the unlearn task records the code `classify` gives."""

from __future__ import annotations

import pytest
import torch

from blade_service.contracts.errors import BaseModelUnavailable
from blade_service.contracts.records import DatasetError
from blade_service.persistence.storage import StorageError
from blade_service.worker.errors import classify, is_accelerator_oom


def test_cuda_out_of_memory_is_classified_by_its_type():
    oom = torch.cuda.OutOfMemoryError("CUDA error: tried to allocate 2.00 GiB")
    assert is_accelerator_oom(oom)
    code, message = classify(oom)
    assert code == "out_of_memory" and "tried to allocate 2.00 GiB" in message


def test_message_text_never_decides_the_code():
    class OutOfMemoryError(Exception):  # the same name as torch's, another type
        pass

    for exc in (
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        ValueError("out of memory"),
        OutOfMemoryError("out of memory"),
        MemoryError(),
        FileNotFoundError("/models/x: no config.json"),
    ):
        assert not is_accelerator_oom(exc)
        assert classify(exc)[0] == "internal_error", exc
    assert classify(RuntimeError("boom"))[1] == "RuntimeError: boom"


def test_each_typed_error_has_its_code():
    assert classify(BaseModelUnavailable("/models/x: no config.json"))[0] == "base_model_unavailable"
    assert classify(StorageError("s3: access denied"))[0] == "storage_error"
    bad_rows = DatasetError("forget.jsonl", "invalid JSON", line=3)
    assert classify(bad_rows) == ("invalid_dataset", str(bad_rows))


@pytest.mark.services
@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (torch.cuda.OutOfMemoryError("CUDA error: tried to allocate 2.00 GiB"), "out_of_memory"),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), "internal_error"),
    ],
)
def test_the_unlearn_task_records_the_code_of_the_type(
    worker_settings, make_request, monkeypatch, raised, code
):
    from blade_service.persistence.db import session_scope
    from blade_service.persistence.models import UnlearnRequest
    from blade_service.worker import unlearn_task

    queued_request = make_request()

    def fail(*_args, **_kwargs):
        raise raised

    monkeypatch.setattr(unlearn_task, "get_settings", lambda: worker_settings)
    monkeypatch.setattr(unlearn_task, "load_context", fail)
    result = unlearn_task.unlearn(request_id=queued_request)
    assert result["outcome"] == "failed"
    with session_scope(worker_settings) as s:
        req = s.get(UnlearnRequest, queued_request)
        assert (req.status, req.error_code) == ("failed", code)
        assert str(raised) in req.error_message
