"""The `blade` command: a thin dispatcher over one module per command group.

Each module in `cli/` exposes `register(subparsers)`, adds its verbs and sets `func` on each parser.
Heavy imports (torch, the web stack) happen inside the verbs, so `blade --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

# Command-group modules, in help order.
COMMAND_MODULES = (
    "blade_service.cli.data",
    "blade_service.cli.model",
    "blade_service.cli.unlearn",
    "blade_service.cli.evaluate",
    "blade_service.cli.bench",
    "blade_service.cli.up",
    "blade_service.cli.api",
    "blade_service.cli.worker",
    "blade_service.cli.client_verbs",
    "blade_service.cli.certificate",
)


class CliError(Exception):
    """A user-facing failure: printed as one paragraph, exit status 2."""


def _version() -> str:
    try:
        return version("blade-service")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blade", description="BLADE unlearning: engine, benchmark, service."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that command group is not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if not sys.stderr.isatty():  # the hub's and transformers' bars (model loads and saves) only on a terminal
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("blade: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (`blade requests | head`): end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail
        return 141
    except (CliError, FileNotFoundError, ValueError) as exc:
        verb = " ".join(v for v in (args.command, getattr(args, "verb", None)) if v)  # base-models show
        print(f"blade {verb}: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)
