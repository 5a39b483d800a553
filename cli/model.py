"""`blade model build`: train a tokenizer and a small Llama from scratch until it memorises a TOFU-format dir.

    blade model build --data DIR --out DIR [--exclude-split forget10] [--seed 0] [--size quick|default]

Trains on every QA row except the holdout splits (retain90 + forget10 + the two probe sets); with
`--exclude-split` that forget split's rows are left out, which gives the gold "retrained" model. Writes a
Hugging Face model dir plus `build_info.json` (data hash, size, steps, time, answer Prob and ROUGE-L on the
forget split). A rebuild with the same data and settings is a cache hit and returns at once.
See `blade_core/build.py`.
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=build)


def build(args: argparse.Namespace) -> int:
    from cli.main import CliError

    if not args.data.is_dir():
        raise CliError(f"--data {args.data}: no such directory")
    from blade_core.build import build_model

    def say(message: str) -> None:
        print(f"[model build] {message}", file=sys.stderr, flush=True)

    result = build_model(
        args.data,
        args.out,
        exclude_split=args.exclude_split,
        seed=args.seed,
        size=args.size,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        log=say,
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
    print(json.dumps(info.get("metrics", {})), file=sys.stderr)
    return 0
