"""Batched greedy generation with left padding (ROUGE, robustness probes, the service's /generate task).

Prompts are tokenised the way training tokenises a `format_qa` prompt (special tokens added unless the
tokenizer has a chat template, whose rendered text already carries them), sorted by length, left-padded with
an attention mask and decoded greedily until eos or `max_new_tokens`; the continuation is decoded without
special tokens, cut at the first stop string (if any are given) and stripped. Order of the outputs is the
order of the prompts.

OpenUnlearning's TOFU ROUGE metrics (`configs/eval/tofu_metrics/*_ROUGE.yaml`) take their generation
arguments from `configs/generation/default.yaml`: greedy, `max_new_tokens: 200`, no stop words, so its
`eval_text_similarity` cuts a generation only at the decoded eos. `ROUGE_MAX_NEW_TOKENS` and an empty `stop`
reproduce that. Stop words appear only in its MUSE knowmem configs (`QA_STOP_STRINGS`, with 32 new tokens).

    python -c "from blade_core.evaluation.generation import generate; help(generate)"
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from blade_core.evaluation.scoring import eval_mode, max_positions, model_device, pad_id_of

ROUGE_MAX_NEW_TOKENS = 200  # OpenUnlearning configs/generation/default.yaml, used by every TOFU ROUGE metric
# OpenUnlearning's MUSE knowmem stop words (configs/eval/muse_metrics/*_knowmem_ROUGE.yaml generation_args);
# its TOFU ROUGE metrics use none. Here only for checks that want one short answer (`blade_core.build`).
QA_STOP_STRINGS: tuple[str, ...] = ("\n\n", "\nQuestion", "Question:")


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt, special tokens as `blade_core.data.encode_qa` adds them."""
    add_special = not getattr(tokenizer, "chat_template", None)
    return list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])


def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = ROUGE_MAX_NEW_TOKENS,
    batch_size: int = 16,
    stop: Sequence[str] = (),
) -> list[str]:
    """Greedy continuation of each prompt (text after the prompt only, cut at the first `stop` string)."""
    return generate_from_ids(
        model,
        tokenizer,
        [prompt_ids(tokenizer, p) for p in prompts],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        stop=stop,
    )


def generate_from_ids(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = ROUGE_MAX_NEW_TOKENS,
    batch_size: int = 16,
    stop: Sequence[str] = (),
) -> list[str]:
    """`generate` for already tokenised prompts. Prompts longer than the model's context minus
    `max_new_tokens` keep their last tokens."""
    if not prompts:
        return []
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    room = max(1, max_positions(model) - max_new_tokens)
    start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    # an empty prompt starts from bos (else eos): generation needs at least one token of context
    prompts = [list(p)[-room:] or [int(start_id or 0)] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    outputs: list[str] = [""] * len(prompts)
    device = model_device(model)
    pad = pad_id_of(tokenizer)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = [prompts[i] for i in chunk]
            texts = _generate_batch(model, tokenizer, batch, pad, device, max_new_tokens)
            for index, text in zip(chunk, texts, strict=True):
                outputs[index] = cut_at_stop(text, stop)
    return outputs


def left_padded(
    batch: Sequence[Sequence[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the prompts left-padded to the longest, on `device`."""
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        if ids:
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[i, width - len(ids) :] = 1
    return input_ids.to(device), attention.to(device)


def _generate_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    batch: Sequence[Sequence[int]],
    pad: int,
    device: torch.device,
    max_new_tokens: int,
) -> list[str]:
    """Greedy decoding of one left-padded batch with a KV cache, as `model.generate(do_sample=False)` decodes
    it, except that a row which has emitted eos leaves the batch (its cache rows dropped) instead of being fed
    padding until the last row finishes: a rambling row no longer makes the finished ones cost 200 steps."""
    input_ids, attention = left_padded(batch, pad, device)
    # positions count real tokens only (left padding), as generate's prepare_inputs_for_generation sets them
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    eos = tokenizer.eos_token_id
    # a retired row's remaining places hold eos, which decoding skips (no eos: no row retires early)
    new_tokens = torch.full((len(batch), max_new_tokens), pad if eos is None else eos, device=device)
    alive = torch.arange(len(batch), device=device)  # the batch rows still decoding
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    cache, cache_argument = _kv_cache(out), _cache_argument(model)
    for step in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)
        new_tokens[alive, step] = token
        if step == max_new_tokens - 1:
            break
        running = token != eos if eos is not None else None
        if running is not None and not bool(running.all()):
            if not bool(running.any()):
                break
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            alive, token, attention = alive[keep], token[keep], attention[keep]
        attention = torch.cat([attention, attention.new_ones((len(alive), 1))], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=attention.sum(-1, keepdim=True) - 1,
            use_cache=True,
            **{cache_argument: cache},
        )
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _cache_argument(model: torch.nn.Module) -> str:
    """The forward keyword that takes the KV cache: `cache` in the transformers releases that renamed it
    (`past_key_values` still works there, with a FutureWarning), `past_key_values` before."""
    get_base = getattr(model, "get_base_model", None)  # a PEFT wrapper forwards **kwargs
    base = get_base() if callable(get_base) else model
    return _cache_keyword(type(base).forward)


@functools.cache
def _cache_keyword(forward: Callable[..., Any]) -> str:
    """`_cache_argument` for one model class's forward (its signature read once)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _kv_cache(out: Any) -> Any:
    """The KV cache of a forward's output, under either of its names (`_cache_argument`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cut_at_stop(text: str, stop: Sequence[str] = ()) -> str:
    """`text` up to the first occurrence of any stop string, stripped."""
    for s in stop:
        if s and s in text:
            text = text.split(s, 1)[0]
    return text.strip()
