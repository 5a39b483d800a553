"""`blade unlearn`: one unlearning run, writing a PEFT adapter dir plus `history.json`.

    blade unlearn --model M --forget F --retain R --out DIR [--method blade] [--preset P] [--adapter A]...
                  [--set key=value]... [--max-steps T] [--seed S]

`--adapter` (repeatable) stacks previously trained adapters underneath, active and frozen; `--set` overrides a
field of the method's config by name (e.g. `--set tau=0.6 --set eps_mul=1.0`). A progress bar shows step/T,
lambda, L_fgt and L_ret; a summary follows. The exit status is non-zero when the run collapsed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "unlearn",
        help="one unlearning run: writes a PEFT adapter dir + history.json",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="base model: a Hugging Face model dir or hub id")
    p.add_argument("--forget", required=True, type=Path, help="forget set: QA (question/answer) or text rows")
    p.add_argument("--retain", required=True, type=Path, help="retain set: QA or text rows")
    p.add_argument("--out", required=True, type=Path, help="output dir for the adapter and history.json")
    p.add_argument(
        "--method",
        default="blade",
        help="blade (default), grad_ascent, grad_diff, npo, simnpo, rmu, pdu, blur_npo",
    )
    p.add_argument(
        "--preset",
        help="named hyperparameter preset of the method (blade: tofu, tofu_3b, "
        "tofu_forget10, muse, knowundo; every baseline: lora, the LoRA adapter the service trains)",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="a previously trained adapter to stack underneath, frozen (repeatable, in order)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override a config field by name (repeatable)",
    )
    p.add_argument("--max-steps", type=int, help="T, the cap on outer steps")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: CUDA when present)")
    p.add_argument(
        "--checkpoint-dir", type=Path, help="save checkpoints here and resume from the latest one found there"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['tau=0.6', ...] -> {'tau': '0.6'}; values stay strings, the config builder converts them per field."""
    from blade_service.cli.main import CliError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--set {item!r}: expected KEY=VALUE, e.g. --set tau=0.6")
        out[key.strip()] = value.strip()
    return out


def run(args: argparse.Namespace) -> int:
    from blade_service.cli.main import CliError

    for flag, path in (("--forget", args.forget), ("--retain", args.retain)):
        if not path.is_file():
            raise CliError(f"{flag} {path}: no such file")
    if args.max_steps is not None and args.max_steps < 1:
        raise CliError(f"--max-steps must be a positive integer, got {args.max_steps}")
    overrides = parse_overrides(args.overrides)

    from blade_core.methods.base import Hooks
    from blade_core.unlearn import build_config, run_unlearning

    build_config(args.method, args.preset, overrides, args.max_steps, args.seed)  # fail fast, before loading
    output = run_unlearning(
        model=args.model,
        forget=args.forget,
        retain=args.retain,
        out_dir=args.out,
        method=args.method,
        preset=args.preset,
        adapters=args.adapter,
        overrides=overrides,
        max_steps=args.max_steps,
        seed=args.seed,
        hooks=Hooks(checkpoint_dir=args.checkpoint_dir),
        device=args.device,
        progress=not args.no_progress,
    )
    print(summary(output))
    for warning in output.warnings:
        print(f"blade unlearn: warning: {warning}", file=sys.stderr)
    if output.status == "collapsed":
        print(f"blade unlearn: error: {output.message}", file=sys.stderr)
        return 1
    return 0


def summary(output: Any) -> str:
    """A few lines on how the run ended and where its files are."""
    hist = output.history
    lines = [f"status: {output.status} after {len(hist)} steps in {output.elapsed_s:.1f}s"]
    lines += [text for text in (output.message, output.saved) if text]
    if hist:
        first, last = hist[0], hist[-1]
        lines.append(
            f"L_fgt {_f(first.get('L_fgt'))} -> {_f(last.get('L_fgt'))}   "
            f"L_ret {_f(first.get('L_ret'))} -> {_f(last.get('L_ret'))}"
        )
        if last.get("epsilon") is not None:
            lines.append(
                f"epsilon {_f(last['epsilon'])}   lambda {_f(last.get('lambda'))}   "
                f"T_trans {last.get('t_trans')}"
            )
        if last.get("H_fgt") is not None:
            lines.append(f"forget-token entropy / log V: {_f(first.get('H_fgt'))} -> {_f(last['H_fgt'])}")
    rule = getattr(output, "lr_rule", None) or {}
    if rule.get("learning_rates"):
        rates = ", ".join(f"{k} {v:.3g}" for k, v in sorted(rule["learning_rates"].items()))
        lines.append(
            f"learning rates: {rates} (LR factor {rule['factor']:g}, eta_in rule {rule['sgd_rule']})"
        )
    prob = getattr(output, "forget_prob", None) or {}
    if prob.get("before") is not None:
        lines.append(f"forget Prob: {prob['before']:.3f} -> {prob['after']:.3f}")
    if output.peak_mem_mb is not None:
        lines.append(f"peak GPU memory: {output.peak_mem_mb:.0f} MiB")
    lines.append(
        f"wrote {output.adapter_dir}/ ({'full model' if output.full_model else 'PEFT adapter'}, "
        "history.json, run.json)"
    )
    return "\n".join(lines)


def _f(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}"
