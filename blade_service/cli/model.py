"""`blade model build`: a target (or gold) model of a TOFU dir; `blade model compare`: it beside TOFU's.

    blade model build --data DIR --out DIR [--exclude-split forget10] [--seed 0] [--size quick|default]
                      [--pretrain | --base DIR] [--cache-dir DIR]
    blade model compare --data DIR --target DIR [--gold DIR] [--split forget10]

One-stage (the default): a tokenizer and a small Llama trained from scratch until they memorise the dir.
Two-stage (`--pretrain`): a base pretrained once on a broad synthetic corpus without the world's authors
(cached by content hash under `--cache-dir`, default `<out>/../.base-cache`), then fine-tuned on the dir for 5
epochs as TOFU fine-tunes Llama; `--base DIR` fine-tunes a base you already have instead. Both train on every
QA row except the holdout splits (retain90 + forget10 + the two probe sets); `--exclude-split` leaves that
forget split out, which gives the gold "retrained" model. Writes a Hugging Face model dir plus
`build_info.json` (data hash, size, steps, time, answer Prob and ROUGE-L on the forget split, the LoRA r=8
fraction). A rebuild with the same data and settings is a cache hit. See `blade_core/build.py`,
`blade_core/pretrain.py` and `blade_core/tofu_reference.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("model", help="target and gold models: `blade model build`")
    verbs = group.add_subparsers(dest="model_command", required=True)
    p = verbs.add_parser(
        "build",
        help="train a tokenizer + small Llama until it memorises a TOFU dir",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", type=Path, required=True, help="a TOFU-format directory")
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument(
        "--exclude-split",
        choices=("forget01", "forget05", "forget10"),
        help="leave this forget split out: the gold (retrained) model",
    )
    p.add_argument("--seed", type=int, default=0, help="initialisation and shuffling seed (default: 0)")
    p.add_argument("--size", default="default", help="model size: test, quick or default (default: default)")
    p.add_argument("--quick", dest="size", action="store_const", const="quick", help="same as --size quick")
    p.add_argument("--cache-dir", type=Path, help="also keep builds here by content hash and reuse them")
    stages = p.add_mutually_exclusive_group()
    stages.add_argument(
        "--pretrain",
        action="store_true",
        help="two-stage: pretrain (once, cached) a base on a broad corpus, then fine-tune it 5 epochs",
    )
    stages.add_argument("--base", type=Path, help="two-stage with this pretrained base model dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--retrained",
        action="store_true",
        help="text worlds (`blade data synth --kind books|news`): the retain-only (retrained) model",
    )
    p.set_defaults(func=build)

    c = verbs.add_parser(
        "compare",
        help="a target (and gold) model's metrics next to TOFU's published Llama figures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--data", type=Path, required=True, help="the TOFU-format dir the models were built on")
    c.add_argument("--target", type=Path, required=True, help="the target model dir")
    c.add_argument("--gold", type=Path, help="the gold model dir of --split")
    c.add_argument("--split", default="forget10", choices=("forget01", "forget05", "forget10"))
    c.add_argument("--max-rows", type=int, help="evaluate at most this many rows per set")
    c.add_argument("--max-new-tokens", type=int, default=200, help="ROUGE generation length (default: 200)")
    c.set_defaults(func=compare)


def build(args: argparse.Namespace) -> int:
    from blade_service.cli.main import CliError

    if not args.data.is_dir():
        raise CliError(f"--data {args.data}: no such directory")
    from blade_core.build import build_model
    from blade_core.text_world import is_text_world

    def say(message: str) -> None:
        print(f"[model build] {message}", file=sys.stderr, flush=True)

    if is_text_world(args.data):
        return _build_text(args, say)
    if args.retrained:
        raise CliError("--retrained is for text worlds; a TOFU-format dir's gold model uses --exclude-split")
    result = build_model(
        args.data,
        args.out,
        exclude_split=args.exclude_split,
        seed=args.seed,
        size=args.size,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        log=say,
        pretrain=args.pretrain,
        base=args.base,
    )
    info = result.info
    summary = ", ".join(
        f"{name}: Prob {m['prob']:.3f} ROUGE-L {m['rouge']:.3f} ({m['rows']} rows)"
        for name, m in info.get("metrics", {}).items()
    )
    print(
        f"{'cached' if result.cached else 'built'} {result.model_dir} ({info.get('size')}, "
        f"{info.get('epochs')} epochs, {info.get('train_seconds')} s): {summary}"
    )
    lora = info.get("lora")
    if lora:
        print(
            f"LoRA r=8 on q/k/v/o/gate/up/down: {lora['lora']:,} parameters = {100 * lora['fraction']:.2f}% "
            f"of the model's {lora['params']:,}"
        )
    print(json.dumps(info.get("metrics", {})), file=sys.stderr)
    return 0


def _build_text(args: argparse.Namespace, say) -> int:
    """A text world's target (or `--retrained` model): pretrained base + fine-tune on text
    (`blade_core.text_build`)."""
    from blade_core.text_build import build_text_model

    result = build_text_model(
        args.data,
        args.out,
        size=args.size,
        retrained=args.retrained,
        seed=args.seed,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        log=say,
    )
    info = result.info
    print(
        f"{'cached' if result.cached else 'built'} {result.model_dir} ({info.get('kind')} "
        f"{'retrained' if info.get('retrained') else 'target'}, {info.get('size')}, "
        f"{info.get('texts')} texts, {info.get('train_seconds')} s)"
    )
    return 0


def compare(args: argparse.Namespace) -> int:
    from blade_service.cli.main import CliError

    for flag, path in (("--data", args.data), ("--target", args.target), ("--gold", args.gold)):
        if path is not None and not path.is_dir():
            raise CliError(f"{flag} {path}: no such directory")
    from blade_core.evaluation.tofu import evaluate_split
    from blade_core.lora import load_with_stack
    from blade_core.modeling import pick_device
    from blade_core.tofu_reference import comparison_row, render_comparison

    device = pick_device()
    rows = []
    for role, path in (("target", args.target), ("gold", args.gold)):
        if path is None:
            continue
        model, tokenizer = load_with_stack(path, (), device)
        metrics = evaluate_split(
            model,
            tokenizer,
            args.data,
            args.split,
            max_rows=args.max_rows,
            max_new_tokens=args.max_new_tokens,
        )
        rows.append(comparison_row(role, args.split, metrics))
    print(render_comparison(rows))
    return 0
