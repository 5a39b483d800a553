"""`blade bench`: methods x splits x seeds on one harness (blade_core.bench)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark unlearning methods side by side",
        description="Runs methods x splits x seeds on one target model with equal data and step caps; writes "
        "results.json, results.md (Table 1 shape) and training-dynamics plots to --out.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="a TOFU-format directory")
    source.add_argument(
        "--synthetic",
        action="store_true",
        help="synthesise a world and build its target and gold models (cached under --cache)",
    )
    p.add_argument("--quick", action="store_true", help="the small preset (a few minutes on 2 CPU cores)")
    p.add_argument("--methods", help="comma-separated method names (default: all eight)")
    p.add_argument("--splits", help="comma-separated forget splits (default: forget01,forget05,forget10)")
    p.add_argument("--seeds", type=int, help="seeds per (method, split) (default: 3; 1 with --quick)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--max-steps", type=int, help="step cap for every method (default: the preset's)")
    p.add_argument(
        "--lr-scale",
        type=float,
        help="factor on every method's learning rates (default: the target's training LR / 1e-5, "
        "TOFU's fine-tuning LR; 1 = the published values)",
    )
    p.add_argument("--authors", type=int, help="--synthetic: authors in the world (default: the preset's)")
    p.add_argument("--model-size", choices=("test", "quick", "default"), help="size of the built models")
    p.add_argument("--eval-max-rows", type=int, help="rows per evaluation set (default: the preset's)")
    p.add_argument("--target", type=Path, help="--data: the target model dir (default: build it from --data)")
    p.add_argument(
        "--gold",
        action="append",
        default=[],
        metavar="SPLIT=DIR",
        help="--data: the gold model of a split (repeatable; default: build it from --data)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=Path(".cache/bench"),
        help="where synthesised worlds and built models are kept (default: .cache/bench)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blade_core import bench
    from cli.main import CliError

    if args.data is None and (args.target or args.gold):
        raise CliError("--target and --gold go with --data (--synthetic builds its own models)")
    for name in ("seeds", "max_steps", "authors", "eval_max_rows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    settings = bench.settings_for(
        args.quick,
        max_steps=args.max_steps,
        authors=args.authors,
        model_size=args.model_size,
        eval_max_rows=args.eval_max_rows,
        seeds=args.seeds,
        lr_scale=args.lr_scale,
    )
    if args.lr_scale is not None and not args.lr_scale > 0:
        raise CliError(f"--lr-scale must be > 0, got {args.lr_scale}")
    methods = bench.parse_list(args.methods, bench.METHOD_NAMES, "method")
    splits = bench.parse_list(args.splits, bench.SPLITS, "split")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    progress = not args.no_progress
    if args.synthetic:
        data_dir, target, golds = bench.prepare_synthetic(args.cache, settings, splits, log, progress)
    else:
        if not args.data.is_dir():
            raise CliError(f"--data {args.data}: not a directory")
        data_dir, target, golds = args.data, args.target, {}
        for item in args.gold:
            split, sep, directory = item.partition("=")
            if not sep or split not in bench.SPLITS:
                raise CliError(
                    f"--gold {item!r}: expected SPLIT=DIR with SPLIT one of {', '.join(bench.SPLITS)}"
                )
            golds[split] = Path(directory)
        if target is None or any(sp not in golds for sp in splits):
            _, built_target, built_golds = bench.prepare_models(
                args.data,
                args.cache,
                settings,
                [sp for sp in splits if sp not in golds],
                build_target=target is None,
                log=log,
                progress=progress,
            )
            target = target or built_target
            golds.update(built_golds)
    for path in [target, *golds.values()]:
        if not (Path(path) / "config.json").is_file():
            raise CliError(f"{path}: not a model directory (no config.json)")
    plan = bench.BenchPlan(
        data_dir=Path(data_dir),
        target=Path(target),
        golds=golds,
        out_dir=args.out,
        methods=methods,
        splits=splits,
        seeds=list(range(settings.seeds)),
        settings=settings,
        command="blade " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        progress=progress,
    )
    bench.run_bench(plan, log)
    print(args.out / "results.md")
    return 0
