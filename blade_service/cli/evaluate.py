"""`blade eval`: TOFU-style metrics of a model (plus stacked adapters) on one forget split.

    blade eval --model M [--adapter A]... --data DIR --split forget01 [--gold G] --json OUT

`--gold` is either the gold (retrained) model's directory, evaluated here on the same rows (truth ratios and
MIA only), or the JSON a previous `blade eval` of the gold model wrote. With it the output carries forget
quality and a gold-based PrivLeak. The metrics are defined in `blade_core/evaluation/metrics.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="TOFU-style metrics of a model (+ adapters) on one forget split",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="base model: a Hugging Face model dir or hub id")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="DIR",
        help="a PEFT adapter dir stacked on the model, in order (repeatable)",
    )
    p.add_argument("--data", type=Path, required=True, help="a TOFU-format directory")
    p.add_argument("--split", default="forget01", help="forget01, forget05 or forget10 (default: forget01)")
    p.add_argument("--gold", help="the gold model's dir, or the JSON of a `blade eval` of it")
    p.add_argument("--json", type=Path, required=True, metavar="OUT", help="where to write the metrics")
    p.add_argument("--batch-size", type=int, default=16, help="rows per forward pass (default: 16)")
    p.add_argument("--max-rows", type=int, help="rows per set at most, a seeded sample (default: all)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        help="generation length for ROUGE (default: 200, OpenUnlearning's configs/generation/default.yaml)",
    )
    p.add_argument(
        "--robustness",
        action="store_true",
        help="also run the jailbreak, paraphrase and relearning probes (slower)",
    )
    p.add_argument("--seed", type=int, default=0, help="row sampling seed (default: 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: CUDA when present)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blade_service.cli.main import CliError

    if not args.data.is_dir():
        raise CliError(f"--data {args.data}: no such directory")
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--max-new-tokens", args.max_new_tokens),
        ("--max-rows", args.max_rows),
    ):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be a positive integer, got {value}")

    from blade_core.evaluation.tofu import as_gold, evaluate_split, reference_for_gold, split_suffix
    from blade_core.lora import load_with_stack

    split_suffix(args.split)  # ValueError naming the split before anything is loaded
    gold: dict[str, Any] | None = None
    if args.gold:
        gold_path = Path(args.gold)
        if gold_path.is_dir():
            _say(f"evaluating the gold model {gold_path} on {args.split}")
            gold_model, gold_tok = load_with_stack(gold_path, (), args.device)
            gold = reference_for_gold(
                gold_model,
                gold_tok,
                args.data,
                args.split,
                batch_size=args.batch_size,
                max_rows=args.max_rows,
                seed=args.seed,
            )
            del gold_model
        elif gold_path.is_file():
            gold = as_gold(gold_path)
        else:
            raise CliError(f"--gold {gold_path}: neither a model directory nor a JSON file")

    _say(f"loading {args.model}" + (f" with {len(args.adapter)} adapter(s)" if args.adapter else ""))
    model, tokenizer = load_with_stack(args.model, args.adapter, args.device)
    result = evaluate_split(
        model,
        tokenizer,
        args.data,
        args.split,
        gold=gold,
        batch_size=args.batch_size,
        robustness=args.robustness,
        max_rows=args.max_rows,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        log=lambda m: _say(f"  {m}"),
    )
    result["model"] = {"base": str(args.model), "adapters": [str(a) for a in args.adapter]}
    result["data"] = str(args.data)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    print(f"wrote {args.json}")
    return 0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _f(value: Any, digits: int = 3) -> str:
    return "  -  " if value is None else f"{value:.{digits}f}"


def summary(result: dict[str, Any]) -> str:
    """A readable table of an evaluate_split result."""
    n_forget = result["n"].get("forget", 0)
    lines = [
        f"{result['split']}: {n_forget} forget rows, evaluated in {result['time_s']:.1f}s",
        f"{'':14}{'Prob':>8}{'ROUGE':>8}{'TR':>8}{'Prob_n':>8}{'ES':>8}{'EM':>8}",
    ]
    for name in ("forget", "retain", "real_authors", "world_facts"):
        block = result.get(name)
        if block:
            lines.append(
                f"{name:14}"
                + "".join(
                    f"{_f(block.get(k)):>8}"
                    for k in (
                        "Prob",
                        "ROUGE",
                        "truth_ratio",
                        "Prob_normalised",
                        "extraction_strength",
                        "exact_memorization",
                    )
                )
            )
    lines.append(
        f"MU {_f(result['MU'])}   HM {_f(result['HM'])}   "
        f"forget quality {_f(result['forget_quality'], 4)}   "
        f"PrivLeak {_f(result['privleak'], 1)} (Min-K%, vs {result['privleak_reference']})"
    )
    mia = result["mia"]
    lines.append(
        f"MIA AUC forget vs {result.get('holdout_split', 'holdout')}: "
        + "   ".join(
            f"{label} {_f(mia.get(key))}"
            for key, label in (
                ("loss", "LOSS"),
                ("zlib", "ZLib"),
                ("min_k", "Min-K%"),
                ("min_k_plus_plus", "Min-K%++"),
                ("gradnorm", "GradNorm"),
            )
        )
    )
    rob = result.get("robustness")
    if rob:
        probes = {
            "plain": rob["plain"],
            **{f"jailbreak:{k}": v for k, v in rob["jailbreak"].items()},
            "paraphrased_question": rob.get("paraphrased_question"),
            "relearn": rob.get("relearn"),
        }
        lines.append(
            "robustness (forget Prob / ROUGE): "
            + "   ".join(f"{k} {_f(v['Prob'])}/{_f(v['ROUGE'])}" for k, v in probes.items() if v)
        )
    return "\n".join(lines)
