"""The package's shape: short functions, layers that import downwards only, and no module
reaching into Precision's masters or loss scaler."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "recognition"
PRECISION = PACKAGE / "precision"
MAX_FUNCTION_LINES = 100

# Lower layers must not import the upper ones.
LOWER = (
    "data",
    "models",
    "heads",
    "config/",
    "distributed.py",
    "precision/",
    "sharded.py",
    "pipeline.py",
)
UPPER = ("recognition.evaluation", "recognition.training", "recognition.checkpoint")


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + [ROOT / "train.py", ROOT / "evaluate.py"]


def test_no_function_is_longer_than_100_lines():
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_lower_layers_do_not_import_upper_ones():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith(LOWER):
            continue
        for name in imported_modules(ast.parse(path.read_text())):
            if name.startswith(UPPER):
                wrong.append(f"{relative} imports {name}")
    assert not wrong, wrong


def test_only_precision_touches_its_masters_and_scaler():
    wrong = []
    for path in sources():
        if path.is_relative_to(PRECISION):  # the package's own modules
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("masters", "scaler"):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not wrong, wrong
