"""Loading models from more than one thread of a process, as the embedded worker's thread pool does (a
/generate beside a request's load)."""

from __future__ import annotations

import threading

import torch


def test_threads_loading_at_once_each_get_their_tied_weights(tiny_model_dir):
    from transformers import PreTrainedModel

    from blade_core.modeling import load_model

    failures: list[str] = []

    def load_repeatedly() -> None:
        for _ in range(8):
            try:
                model = load_model(tiny_model_dir, torch.device("cpu"))
                if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                    failures.append("untied")
            except Exception as exc:  # a race shows as the meta tensor left where the tie should be
                failures.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=load_repeatedly) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert PreTrainedModel.tie_weights.__name__ == "tie_weights"  # not left patched out for the process
    assert load_model(tiny_model_dir, torch.device("cpu")).config.tie_word_embeddings
