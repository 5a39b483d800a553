"""`blade bench`: learning rates selected on a validation world, then methods x splits x seeds on the test
world, or the sequential / scaled experiments (blade_core.bench: selection.py, stream.py, text.py)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark unlearning methods side by side",
        description="Selects each method's learning-rate multiplier on a separate validation world, then "
        "runs methods x splits x seeds on the test world's target with equal data; writes results.json, "
        "results.md (Table 1 shape, mean ± std) and training-dynamics plots to --out. --sequential N and "
        "--scale 1,2,4 run the stacked-requests and larger-forget-set experiments instead.",
    )
    source = p.add_mutually_exclusive_group()  # one is required for --suite tofu (checked in run)
    source.add_argument("--data", type=Path, help="a TOFU-format directory")
    source.add_argument(
        "--synthetic",
        action="store_true",
        help="synthesise a world and build its target and gold models (cached under --cache)",
    )
    p.add_argument("--quick", action="store_true", help="the small preset (a few minutes on 2 CPU cores)")
    p.add_argument("--methods", help="comma-separated method names (default: all eight)")
    p.add_argument("--splits", help="comma-separated forget splits (default: forget01,forget05,forget10)")
    p.add_argument(
        "--seeds",
        type=int,
        help="seeds per (method, split): 42,123,456,789,1024 in order (default 5; 1 with --quick)",
    )
    p.add_argument(
        "--seed-list",
        help="instead of --seeds, exactly these seeds, e.g. 456,789,1024: the rest of a run made elsewhere "
        "(join the two with `blade bench-merge`)",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--max-steps",
        type=int,
        help="a common step cap on every method (default: each method's published schedule; --quick caps)",
    )
    p.add_argument(
        "--lr-scale",
        type=float,
        help="the LR rule's factor on Adam learning rates (default: the target's training LR / 1e-5, "
        "TOFU's fine-tuning LR; 1 = the published values)",
    )
    p.add_argument(
        "--lr-grid", help="LR multipliers the selection tries, e.g. 0.25,0.5,1,2,4 (default: the preset's)"
    )
    p.add_argument(
        "--lr-grid-extend",
        type=int,
        help="points the selection tries past an edge of the grid when the best HM sits on it (default 2; 0: "
        "the grid only)",
    )
    p.add_argument(
        "--selection-split", help="the validation world's split for the selection (default forget05)"
    )
    p.add_argument(
        "--selection-seeds",
        type=int,
        help="seeds each multiplier runs at on the validation world, scored by their mean HM (default 1: "
        "42; N: the first N of 42,123,456,789,1024)",
    )
    p.add_argument(
        "--validation-data",
        type=Path,
        help="--data: a TOFU-format validation world for the selection (default with --data: no selection)",
    )
    p.add_argument("--validation-target", type=Path, help="--validation-data: its target model dir")
    p.add_argument(
        "--sequential",
        type=int,
        nargs="?",
        const=4,
        metavar="N",
        help="N stacked forget requests on disjoint author sets (default N: 4), instead of the splits grid",
    )
    p.add_argument(
        "--select-on",
        choices=("request", "sequence"),
        default="request",
        help="what the selection scores on the validation world: HM after one request (default), or, with "
        "--sequential N, HM over every forget set after N stacked requests",
    )
    p.add_argument(
        "--scale", help="forget-set multiples, e.g. 1,2,4 (more authors, all else fixed), instead of the grid"
    )
    p.add_argument("--authors", type=int, help="--synthetic: authors in the world (default: the preset's)")
    p.add_argument(
        "--model-size",
        choices=("test", "quick", "default", "large"),
        help="size of the built models (large: 64 M parameters, for --build-device cuda)",
    )
    p.add_argument(
        "--build-device",
        help="where the target and gold models train: cpu (default) or an accelerator, e.g. cuda",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="METHOD.FIELD=VALUE",
        help="a config field of one method for all its runs, selection included, e.g. blade.grad_accum=1 "
        "(repeatable; recorded in results.json, and a run cached without it is not reused)",
    )
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
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs made side by side, each in its own process with an equal share of the CPU threads "
        "(default 1; 0: one per CPU core)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--suite",
        choices=("tofu", "muse", "knowundo"),
        default="tofu",
        help="tofu: the QA bench (default); muse / knowundo: a text world with MUSE's metrics "
        "(blade_core/bench/text.py; --synthetic implied)",
    )
    p.add_argument("--kind", choices=("books", "news"), help="--suite muse|knowundo: the text world's kind")
    p.set_defaults(func=run)

    m = subparsers.add_parser(
        "bench-merge",
        help="join bench runs made in several invocations into one table",
        description="Joins the results.json of `blade bench` invocations that each ran part of one "
        "protocol (other methods, other seeds: --seed-list) into one results.json and results.md, with mean "
        "± std over every seed. Refuses inputs of another world, target, settings or model build, a method "
        "chosen at two multipliers, and a run present twice (unless --replace).",
    )
    m.add_argument(
        "inputs", nargs="+", type=Path, help="results.json files, or the --out directories of bench runs"
    )
    m.add_argument("--out", type=Path, required=True, help="output directory")
    m.add_argument(
        "--seed-list", help="keep only these seeds' runs, e.g. the seeds every method ran (default: all)"
    )
    m.add_argument(
        "--replace",
        action="store_true",
        help="a run (method, split, seed) in two inputs is taken whole from the later one, e.g. seeds re-run "
        "under a corrected setup; results.json `replaced` lists each (default: refuse runs present twice)",
    )
    m.set_defaults(func=merge)


def _floats(text: str, flag: str) -> tuple[float, ...]:
    from blade_service.cli.main import CliError

    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise CliError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values or any(not v > 0 for v in values):
        raise CliError(f"{flag} {text!r}: expected positive numbers")
    return values


def _seed_list(text: str | None, count: int | None) -> list[int] | None:
    """`--seed-list`: its seeds, distinct non-negative integers in the order given; None when not given."""
    from blade_service.cli.main import CliError

    if text is None:
        return None
    if count is not None:
        raise CliError("--seeds and --seed-list: give one (a count, or the seeds themselves)")
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CliError(f"--seed-list {text!r}: expected comma-separated integers, e.g. 456,789") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise CliError(f"--seed-list {text!r}: expected distinct non-negative integers")
    return seeds


def run(args: argparse.Namespace) -> int:
    from blade_core import bench
    from blade_core.bench.measure import machine, numpy_narrower_hint
    from blade_service.cli.main import CliError

    if args.suite != "tofu":
        return _run_text(args)
    if args.data is None and not args.synthetic:
        raise CliError("one of --data or --synthetic is required (--suite tofu)")

    if args.data is None and (args.target or args.gold or args.validation_data or args.validation_target):
        raise CliError(
            "--target, --gold, --validation-data and --validation-target go with --data "
            "(--synthetic builds its own models)"
        )
    if args.validation_target and not args.validation_data:
        raise CliError("--validation-target goes with --validation-data")
    for name in ("seeds", "max_steps", "authors", "eval_max_rows", "sequential", "selection_seeds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    seeds = _seed_list(args.seed_list, args.seeds)
    if args.select_on == "sequence" and not args.sequential:
        raise CliError("--select-on sequence goes with --sequential N (it scores N stacked requests)")
    if args.lr_grid_extend is not None and args.lr_grid_extend < 0:
        raise CliError(f"--lr-grid-extend must be 0 or a positive integer, got {args.lr_grid_extend}")
    if args.jobs < 0:
        raise CliError(f"--jobs must be 0 (one per CPU core) or a positive integer, got {args.jobs}")
    scales = [int(v) for v in _floats(args.scale, "--scale")] if args.scale else []
    if args.scale and any(v != int(v) for v in _floats(args.scale, "--scale")):
        raise CliError(f"--scale {args.scale!r}: expected whole multiples, e.g. 1,2,4")
    if args.selection_split:
        bench.parse_list(args.selection_split, bench.SPLITS, "split")
    try:
        settings = bench.settings_for(
            args.quick,
            max_steps=args.max_steps,
            authors=args.authors,
            model_size=args.model_size,
            eval_max_rows=args.eval_max_rows,
            seeds=args.seeds,
            lr_scale=args.lr_scale,
            lr_grid=_floats(args.lr_grid, "--lr-grid") if args.lr_grid else None,
            selection_split=args.selection_split,
            selection_seeds=args.selection_seeds,
            lr_grid_extend=args.lr_grid_extend,
            build_device=args.build_device,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _check_build_device(settings.build_device)
    if args.lr_scale is not None and not args.lr_scale > 0:
        raise CliError(f"--lr-scale must be > 0, got {args.lr_scale}")
    methods = bench.parse_list(args.methods, bench.METHOD_NAMES, "method")
    overrides = _method_overrides(args.set, methods)
    splits = bench.parse_list(args.splits, bench.SPLITS, "split")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    box = machine()
    log(
        f"on {box['summary']}; CPU kind {box['cpu_identity']}: the models built here match another box's bit "
        "for bit only where that box is of the same kind (docs/results.md); numpy SIMD "
        f"{' '.join(box['numpy_simd']) or 'baseline only'}: the metrics' last digits match where that is the "
        "same too"
    )
    if hint := numpy_narrower_hint(box["cpu_identity"], box["numpy_simd"]):
        log(hint)
    progress = not args.no_progress
    validation = None
    gold_splits = [] if (args.sequential or scales) else splits  # no gold for the drawn author sets
    if args.synthetic:
        if settings.validation_world_seed == settings.world_seed:
            raise CliError("the validation world's seed must differ from the test world's")
        # The validation world first: the selection must not depend on anything built from the test world.
        v_data, v_target, _ = bench.prepare_synthetic(
            args.cache, settings, [], log, progress, world_seed=settings.validation_world_seed
        )
        # One selection cache per world and model size: `--quick` and the default build different targets
        # from the same validation world, and their runs must not overwrite each other's.
        runs_dir = args.cache / "selection" / bench.model_set_name(v_data, settings)
        validation = bench.ValidationWorld(
            v_data, v_target, settings.validation_world_seed, runs_dir=runs_dir
        )
        data_dir, target, golds = bench.prepare_synthetic(args.cache, settings, gold_splits, log, progress)
    else:
        if not args.data.is_dir():
            raise CliError(f"--data {args.data}: not a directory")
        if args.validation_data is not None:
            if not args.validation_data.is_dir():
                raise CliError(f"--validation-data {args.validation_data}: not a directory")
            v_target = args.validation_target
            if v_target is None:
                _, built_v_target, _ = bench.prepare_models(
                    args.validation_data, args.cache, settings, [], log=log, progress=progress
                )
                assert built_v_target is not None  # build_target defaults to True
                v_target = built_v_target
            validation = bench.ValidationWorld(Path(args.validation_data), Path(v_target))
        data_dir, target, golds = args.data, args.target, {}
        for item in args.gold:
            split, sep, directory = item.partition("=")
            if not sep or split not in bench.SPLITS:
                raise CliError(
                    f"--gold {item!r}: expected SPLIT=DIR with SPLIT one of {', '.join(bench.SPLITS)}"
                )
            golds[split] = Path(directory)
        if target is None or any(sp not in golds for sp in gold_splits):
            missing = [sp for sp in gold_splits if sp not in golds]
            if target is not None and missing:
                log(
                    f"no --gold for {', '.join(missing)}: building it from --data under {args.cache} (the "
                    "base model, pretrained there unless cached, fine-tuned without the split); --gold "
                    "SPLIT=DIR reuses one"
                )
            _, built_target, built_golds = bench.prepare_models(
                args.data,
                args.cache,
                settings,
                missing,
                build_target=target is None,
                log=log,
                progress=progress,
            )
            if target is None:
                assert built_target is not None  # build_target=True when there was no --target
                target = built_target
            golds.update(built_golds)
    for path in [target, *golds.values(), *([validation.target] if validation else [])]:
        if not (Path(path) / "config.json").is_file():
            raise CliError(f"{path}: not a model directory (no config.json)")
    plan = bench.BenchPlan(
        data_dir=Path(data_dir),
        target=Path(target),
        golds=golds,
        out_dir=args.out,
        methods=methods,
        splits=splits,
        seeds=seeds or bench.seed_list(settings.seeds),
        settings=settings,
        command="blade " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        progress=progress,
        validation=validation,
        sequential=args.sequential,
        scales=scales,
        select_on=args.select_on,
        jobs=args.jobs or os.cpu_count() or 1,
        overrides=overrides,
    )
    try:
        bench.run_bench(plan, log)
    except ValueError as exc:  # e.g. a world too small for --sequential / --scale, or one world for both
        raise CliError(str(exc)) from None
    print(args.out / "results.md")
    return 0


def _run_text(args: argparse.Namespace) -> int:
    """`--suite muse|knowundo`: blade_core/bench/text.py."""
    from blade_core import bench
    from blade_core.bench.text import run_text_bench
    from blade_service.cli.main import CliError

    if args.data is not None:
        raise CliError(f"--suite {args.suite} synthesises its own text world; --data is for --suite tofu")
    if args.seed_list is not None:
        raise CliError(f"--seed-list goes with --suite tofu; --suite {args.suite} takes --seeds N")
    for flag, given in (("--set", args.set), ("--build-device", args.build_device)):
        if given:
            raise CliError(f"{flag} goes with --suite tofu")
    for name in ("seeds", "max_steps", "eval_max_rows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    try:
        methods = bench.parse_list(args.methods, bench.METHOD_NAMES, "method")
    except ValueError as exc:
        raise CliError(f"--methods: {exc}") from None
    results = run_text_bench(
        suite=args.suite,
        out=args.out,
        cache=args.cache,
        quick=args.quick,
        methods=methods,
        kind=args.kind,
        sequential=args.sequential or 0,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        max_steps=args.max_steps,
        seeds=args.seeds,
        model_size=args.model_size,
        eval_max_rows=args.eval_max_rows,
        lr_grid=_floats(args.lr_grid, "--lr-grid") if args.lr_grid else None,
    )
    print((args.out / "results.md").read_text())
    print(
        f"{len(results['rows'])} runs in {results['time_s']} s; {args.out / 'results.json'}", file=sys.stderr
    )
    return 0


def _method_overrides(items: list[str], methods: list[str]) -> dict[str, dict[str, Any]]:
    """`--set METHOD.FIELD=VALUE` items as {method: {field: value}}, checked as a request's params are."""
    from blade_service.cli.main import CliError
    from blade_service.contracts.errors import ParamError
    from blade_service.contracts.params import check_params

    given: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        method, dot, name = key.partition(".")
        if not (eq and dot and method and name):
            raise CliError(f"--set {item!r}: expected METHOD.FIELD=VALUE, e.g. blade.grad_accum=1")
        if method not in methods:
            raise CliError(
                f"--set {item!r}: {method!r} is not one of this bench's methods ({', '.join(methods)})"
            )
        given.setdefault(method, {})[name] = value
    try:
        return {method: check_params(method, fields, text=True) for method, fields in given.items()}
    except ParamError as exc:
        raise CliError(f"--set: {exc}") from None


def _check_build_device(name: str) -> None:
    """`--build-device`: the CPU, or an accelerator torch can see here."""
    import torch

    from blade_service.cli.main import CliError

    try:
        device = torch.device(name)
    except RuntimeError:
        raise CliError(f"--build-device {name!r}: expected cpu or an accelerator such as cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--build-device {name}: torch sees no CUDA device on this machine")
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--build-device {name!r}: expected cpu or cuda[:N]")


def merge(args: argparse.Namespace) -> int:
    from blade_core.bench.merge import load_results, merge_results, write_merged

    paths = [p / "results.json" if p.is_dir() else p for p in args.inputs]
    only_seeds = _seed_list(args.seed_list, None)
    results = [load_results(p) for p in paths]
    carried = sum(len(r.get("replaced", [])) for r in results)
    merged = merge_results(results, [str(p) for p in paths], only_seeds=only_seeds, replace=args.replace)
    for path in write_merged(args.out, merged):
        print(path)
    seeds = ", ".join(map(str, merged["settings"]["seeds"]))
    methods = len(merged["settings"]["methods"])
    replaced = ""
    if args.replace:
        replaced = f"; {len(merged.get('replaced', [])) - carried} runs replaced"
        replaced += f" ({carried} more carried from the inputs)" if carried else ""
    print(f"{len(merged['rows'])} runs of {methods} methods, seeds {seeds}{replaced}", file=sys.stderr)
    return 0
