"""The code's shape: short functions, classes and files, floors that import downwards only,
no import circle, and no module reaching into Precision's masters or loss scaler.

The limits (a file at most 600 lines, a class 200, a function 80) hold in recognition/,
benchmarks/, train.py and evaluate.py: past them, a concern gets a module of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from code_walk import Walk, walk_from

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "recognition"
PRECISION = PACKAGE / "precision"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 200
MAX_FILE_LINES = 600

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
# What the config describes it owns: it imports none of the code that takes it.
CONFIG_MUST_NOT_IMPORT = (
    "recognition.data", "recognition.models", "recognition.heads", *UPPER,
)  # fmt: skip


def sources() -> list[Path]:
    """recognition/, benchmarks/, train.py and evaluate.py."""
    return (
        sorted(PACKAGE.rglob("*.py"))
        + sorted((ROOT / "benchmarks").rglob("*.py"))
        + [ROOT / "train.py", ROOT / "evaluate.py"]
    )


def test_no_file_class_or_function_is_past_its_limit():
    long = []
    for path in sources():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            limit = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            lines = node.end_lineno - node.lineno + 1 if limit else 0
            if limit and lines > limit:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, anywhere in it (a function's lazy import
    too). `from package import module` counts as the module, not the package."""
    modules = {module_name(path): path for path in sources()}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.append(full if full in modules else node.module)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def test_no_import_circle():
    graph = import_graph()
    circles = []
    for start in graph:  # a path back to `start`, depth first (the graph is small)
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for target in graph[node]:
                if target == start:
                    circles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert not circles, sorted(set(circles))[:10]


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_matching(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    """'<file> imports <module>' for each import of a `forbidden` prefix in `paths`."""
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in sorted(imported_modules(ast.parse(path.read_text())))
        if name.startswith(forbidden)
    ]


def test_lower_layers_do_not_import_upper_ones():
    lower = [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).as_posix().startswith(LOWER)
    ]
    wrong = imports_matching(lower, UPPER)
    assert not wrong, wrong


def test_the_config_imports_none_of_the_code_it_configures():
    wrong = imports_matching(sorted((PACKAGE / "config").rglob("*.py")), CONFIG_MUST_NOT_IMPORT)
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


# The walk of train(cfg) (tests/code_walk.py): 21 climbs back up when holding out and choosing
# the evaluation targets became one call (issue 39's count, with its own tool, was 22).
TRAIN_WALK = "recognition/training/loop.py:train:cfg"
MAX_TRAIN_WALK_CLIMBS = 21


def test_a_climb_is_a_way_back_up_that_goes_down_again():
    walk = Walk(start="a.py")
    walk.moves = [("down", "b.py"), ("down", "c.py"), ("up", "b.py"), ("up", "a.py")]
    assert walk.climbs == 0 and walk.rooms == ["a.py", "b.py", "c.py"]
    walk.moves += [("down", "d.py"), ("up", "a.py"), ("down", "b.py")]
    assert walk.climbs == 2 and walk.rooms == ["a.py", "b.py", "c.py", "d.py"]


def test_the_walk_of_train_follows_the_config_into_each_concern():
    rooms = walk_from(TRAIN_WALK).rooms
    for concern in (
        "recognition/training/build.py",
        "recognition/training/holdout.py",
        "recognition/data/build.py",
        "recognition/models/__init__.py",
        "recognition/heads/__init__.py",
        "recognition/optim.py",
        "recognition/training/hooks.py",
    ):
        assert concern in rooms, (concern, rooms)


def test_the_walk_of_train_climbs_back_up_no_more_than_its_bar():
    walk = walk_from(TRAIN_WALK)
    assert walk.climbs <= MAX_TRAIN_WALK_CLIMBS, (
        f"{TRAIN_WALK}: {walk.climbs} climbs back up (bar {MAX_TRAIN_WALK_CLIMBS}); "
        "`python tests/code_walk.py` shows the walk"
    )
