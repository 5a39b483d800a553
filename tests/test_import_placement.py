"""Imports sit at the top of a module unless a function-level one keeps a heavy module out of a process.

The rule (issue 12): an import inside a function is allowed only when
(a) it imports a heavy library that the enclosing process may not need (`HEAVY`), or any `blade_core` module
    from `blade_service/` (the API, the maintenance and inference workers, the prefork parent and the CLI's
    `--help` must not load the engine), or, in `blade_service/cli/`, any module outside the standard
    library: every `blade` command runs in one process, so each verb loads only what it uses (`blade --help`
    and the client verbs start in a tenth of a second, not paying for the database and server stack), or
(b) the import carries a trailing `# lazy: <why>` comment (a cycle that could not be broken, ...).
Every other import belongs at module level, where the module's dependencies can be read in one place.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("blade_core", "blade_service")
HEAVY = frozenset(
    {
        "torch",
        "transformers",
        "peft",
        "huggingface_hub",
        "safetensors",
        "accelerate",
        "numpy",
        "scipy",
        "sklearn",
        "matplotlib",
        "nltk",
        "rouge_score",
        "uvicorn",
        "playwright",
    }
)
LAZY_COMMENT = re.compile(r"#\s*lazy:\s*\S")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute module names an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not node.level:
        return [node.module or ""]
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return [".".join([*base, node.module] if node.module else base)]


def _allowed(target: str, module: str) -> bool:
    top = target.split(".")[0]
    if top in HEAVY:
        return True
    if module.startswith("blade_service.cli.") and top not in sys.stdlib_module_names:
        return True
    return top == "blade_core" and module.startswith("blade_service.")


def _lazy_lines(source: str) -> set[int]:
    comments = (
        t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT
    )
    return {t.start[0] for t in comments if LAZY_COMMENT.search(t.string)}


def function_level_imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, statement) of every import inside a function of `source` that the rule does not allow."""
    lazy = _lazy_lines(source)
    lines = source.splitlines()

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[int, str]]:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                targets = _imported(child, module, is_package)
                span = range(child.lineno, (child.end_lineno or child.lineno) + 1)
                if not all(_allowed(t, module) for t in targets) and not lazy.intersection(span):
                    yield child.lineno, lines[child.lineno - 1].strip()
            yield from walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    yield from walk(ast.parse(source), False)


def test_function_level_imports_keep_a_heavy_module_out_or_say_why():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            for line, statement in function_level_imports(
                path.read_text(), module, is_package=path.name == "__init__.py"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {statement}")
    assert not offenders, (
        f"{len(offenders)} imports inside functions neither keep a heavy module out of a process nor say why "
        "(`# lazy: <why>`); move them to the top of the module:\n" + "\n".join(offenders)
    )


def test_the_rule_flags_a_plain_import_and_allows_the_exceptions():
    source = (
        "def f():\n"
        "    import json\n"
        "    import torch\n"
        "    from . import sibling\n"
        "    from blade_core import lora\n"
        "    import celery\n"
        "    from blade_service.persistence import db  # lazy: an import cycle with db\n"
        "    from blade_service.persistence import (  # lazy:\n"
        "        jobs,\n"
        "    )\n"
    )
    found = list(function_level_imports(source, "blade_service.worker.tasks"))
    assert [line for line, _ in found] == [2, 4, 6, 8]
    in_core = function_level_imports("def f():\n    from blade_core import lora\n", "blade_core.bench.run")
    assert list(in_core) == [(2, "from blade_core import lora")]
    in_cli = function_level_imports(
        "def f():\n    import celery\n    import json\n", "blade_service.cli.worker"
    )
    assert list(in_cli) == [(3, "import json")]
    at_top = list(function_level_imports("import json\n\nclass C:\n    import os\n", "blade_core.x"))
    assert at_top == []
