"""`blade data synth`: write a deterministic fictitious-author benchmark in TOFU format.

    blade data synth --out DIR [--authors 200] [--seed 0]

The files are those of CONTRACT.md "Files" (forget/retain/holdout splits and the two probe sets) plus
`world.json` describing the run; the same arguments give byte-identical files. See `blade_core/synth.py`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("data", help="benchmark data: `blade data synth`")
    verbs = group.add_subparsers(dest="data_command", required=True)
    p = verbs.add_parser(
        "synth",
        help="write a synthetic fictitious-author world in TOFU format",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="directory to write (created; files overwritten)")
    p.add_argument("--authors", type=int, default=200, help="authors trained on (default: 200, as TOFU)")
    p.add_argument("--seed", type=int, default=0, help="world seed (default: 0)")
    p.add_argument(
        "--kind",
        choices=("qa", "books", "news"),
        default="qa",
        help="qa: TOFU-format authors (default); books/news: a MUSE-style text world (text_world.py)",
    )
    p.add_argument("--docs", type=int, help="books: works (default 4); news: articles (default 60)")
    p.set_defaults(func=synth)


def synth(args: argparse.Namespace) -> int:
    from blade_core.synth import split_counts, write_world
    from blade_service.cli.main import CliError

    if args.kind != "qa":
        return _synth_text(args)

    if args.authors < 2:
        raise CliError(f"--authors must be at least 2 (one to forget, one to retain), got {args.authors}")
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out {args.out}: exists and is not a directory")
    counts = write_world(args.out, authors=args.authors, seed=args.seed)
    split = split_counts(args.authors)
    for name, rows in counts.items():
        print(f"{args.out / name}: {rows} rows")
    print(
        f"{args.authors} authors (+{split[10]} holdout); forget01/05/10 = "
        f"{split[1]}/{split[5]}/{split[10]} authors",
        file=sys.stderr,
    )
    return 0


def _synth_text(args: argparse.Namespace) -> int:
    from blade_core.text_world import write_text_world
    from blade_service.cli.main import CliError

    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out {args.out}: exists and is not a directory")
    try:
        counts = write_text_world(args.out, args.kind, args.docs, args.seed)
    except ValueError as exc:
        raise CliError(f"--docs: {exc}") from None
    for name, rows in counts.items():
        print(f"{args.out / name}: {rows} rows")
    return 0
