"""Evaluation benchmark (not a test): what one bench evaluation (`evaluate_split`, 200 greedy tokens per ROUGE
row as OpenUnlearning generates them) costs with our generation, which retires a row from its batch once it
has emitted eos, against transformers' `generate`, which feeds finished rows padding until the batch's last
row finishes. Both run in this process, one after the other, on the same models and rows, and must produce the
same generations.

    .venv/bin/python benchmarks/evaluation.py --data DIR --model DIR            # e.g. a bench cache's world
    .venv/bin/python benchmarks/evaluation.py --data DIR --model DIR --methods npo,grad_ascent

The models measured: `--model` itself (a target: its answers end with eos after a few tokens) and that model
after a run of each of `--methods` on the split's forget rows with the method's defaults and published
schedule (what a bench evaluates: answers that may ramble after unlearning, all of them to the cap when the
model has collapsed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from blade_core.bench.models import split_paths  # noqa: E402
from blade_core.evaluation import generation  # noqa: E402
from blade_core.evaluation.tofu import evaluate_split  # noqa: E402
from blade_core.lora import load_with_stack  # noqa: E402
from blade_core.unlearn import run_unlearning  # noqa: E402


def transformers_batch(
    model: torch.nn.Module, tokenizer: Any, batch: Any, pad: int, device: torch.device, max_new_tokens: int
) -> list[str]:
    """The reference: one left-padded batch through `model.generate`, greedy (what we used before)."""
    from transformers import GenerationConfig

    input_ids, attention = generation.left_padded(batch, pad, device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    out = model.generate(  # type: ignore[operator]
        input_ids=input_ids, attention_mask=attention, generation_config=config
    )
    return tokenizer.batch_decode(
        out[:, input_ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


@contextmanager
def counted(decoder: Any, tally: dict[str, Any]) -> Iterator[None]:
    """Route every batch through `decoder`, adding its seconds, decoded tokens and texts to `tally`."""
    ours = generation._generate_batch

    def timed(model, tokenizer, batch, pad, device, max_new_tokens):
        started = time.perf_counter()
        texts = decoder(model, tokenizer, batch, pad, device, max_new_tokens)
        tally["generate_s"] += time.perf_counter() - started
        tally["tokens"] += sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
        tally["texts"].extend(texts)
        return texts

    generation._generate_batch = timed
    try:
        yield
    finally:
        generation._generate_batch = ours


def measure(model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace, decoder: Any) -> dict[str, Any]:
    tally: dict[str, Any] = {"generate_s": 0.0, "tokens": 0, "texts": []}
    with counted(decoder, tally):
        started = time.perf_counter()
        result = evaluate_split(
            model,
            tokenizer,
            args.data,
            args.split,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
        )
        tally["eval_s"] = time.perf_counter() - started
    return {**tally, "HM": result["HM"]}


def unlearned(args: argparse.Namespace, method: str, work: Path) -> tuple[Path, list[Path]]:
    """(model, adapters) of a `method` run on the split's forget rows."""
    forget, retain = split_paths(Path(args.data), args.split)
    out = run_unlearning(
        model=args.model,
        forget=forget,
        retain=retain,
        out_dir=work,
        method=method,
        seed=0,
        device="cpu",
    )
    return (out.adapter_dir, []) if out.full_model else (Path(args.model), [out.adapter_dir])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="a TOFU-format directory (e.g. a bench cache's world)")
    parser.add_argument("--model", required=True, help="a model dir (e.g. the bench's target)")
    parser.add_argument("--split", default="forget05")
    parser.add_argument("--batch-size", type=int, default=32, help="the bench's eval batch (default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=generation.ROUGE_MAX_NEW_TOKENS)
    parser.add_argument("--methods", default="npo", help="comma-separated; '': the model only (default npo)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as one bench job)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        models: dict[str, tuple[Path, list[Path]]] = {"model": (Path(args.model), [])}
        for method in filter(None, args.methods.split(",")):
            models[f"after {method}"] = unlearned(args, method, Path(tmp) / method)
        rows = []
        for name, (ref, stack) in models.items():
            model, tokenizer = load_with_stack(ref, stack, "cpu")
            theirs = measure(model, tokenizer, args, transformers_batch)
            ours = measure(model, tokenizer, args, generation._generate_batch)
            rows.append((name, theirs, ours))
    print(f"\nevaluate_split on {args.split}, {args.max_new_tokens} new tokens, batch {args.batch_size}:")
    print(f"{'model':<24} {'decoder':<14} {'eval s':>8} {'generate s':>11} {'tokens':>8} {'tok/s':>7}  HM")
    for name, theirs, ours in rows:
        for label, m in (("transformers", theirs), ("ours (retire)", ours)):
            print(
                f"{name:<24} {label:<14} {m['eval_s']:8.1f} {m['generate_s']:11.1f} {m['tokens']:8d} "
                f"{m['tokens'] / m['generate_s']:7.0f}  {m['HM']:.4f}"
            )
        same = theirs["texts"] == ours["texts"] and theirs["HM"] == ours["HM"]
        print(
            f"{name:<24} ours / transformers: eval {ours['eval_s'] / theirs['eval_s']:.2f}x, generation "
            f"{ours['generate_s'] / theirs['generate_s']:.2f}x; same generations and HM: {same}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
