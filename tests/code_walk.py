"""A reader's walk through the code: follow one argument from a function down every call it is
passed to, and count the files ("rooms") entered and the climbs back up.

    python tests/code_walk.py recognition/training/loop.py:train:cfg      # the walk, file by file

From the start function, every call that hands the followed config on (an argument that
mentions the followed name: the name itself, a part of it such as `cfg.data`, or a local
bound to one, `data_cfg = cfg.data`, received by a parameter annotated with a config class:
`ExperimentConfig`, `DataConfig`, ...) is resolved through the module's imports (functions
and classes of the `recognition` package; a class is entered through its `__init__` /
`__post_init__` when it has one) and walked into, in source order, with the callee's
parameter that receives it followed next. Single values (`cfg.train.seed`) are not
followed, nor calls through objects (`self.f(cfg)`, `run.step(cfg)`), which cannot be
resolved statically. Each function is walked once per followed parameter.

The walk moves from file to file: into a callee's file, back to the caller's when it
returns. A room is a file the walk enters; a climb back up is a return after which the walk
goes down again into another callee (several returns in a row count once): the reader had
to come back up to learn where the next part of the argument's story is. A run whose
concerns each live behind one call climbs little; a function that hands the argument to
many files in turn climbs once per file after the first.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "recognition"


@dataclass
class Walk:
    """The walk's moves: ("down" | "up", file) in order, from the start function's file."""

    start: str
    moves: list[tuple[str, str]] = field(default_factory=list)

    @property
    def rooms(self) -> list[str]:
        seen = dict.fromkeys([self.start, *(f for _, f in self.moves)])
        return list(seen)

    @property
    def climbs(self) -> int:
        count, rising = 0, False
        for direction, _ in self.moves:
            if direction == "up":
                rising = True
            elif rising:
                count, rising = count + 1, False
        return count


def module_path(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@cache
def bindings(path: Path) -> dict[str, tuple[str, str | None]]:
    """Top-level names of the module: name -> (module, attribute or None for a module)."""
    names: dict[str, tuple[str, str | None]] = {}
    package = module_of(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_of(path)
    for node in parsed(path).body:
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, source] if source else base)
            for alias in node.names:
                names[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
    return names


def definition(module: str, name: str, depth: int = 0) -> tuple[Path, ast.AST] | None:
    """The function or class `name` of `module`, through re-exports."""
    path = module_path(module)
    if path is None or depth > 5:
        return None
    for node in parsed(path).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return path, node
    bound = bindings(path).get(name)
    if bound is None:
        return None
    source, attribute = bound
    if attribute is None:
        return None
    if module_path(f"{source}.{attribute}") is not None:
        return None  # a module, not a function
    return definition(source, attribute, depth + 1)


def resolve(path: Path, func: ast.expr) -> tuple[Path, ast.AST] | None:
    """The definition a call's callee names, within the package, if it can be told."""
    if isinstance(func, ast.Name):
        found = definition(module_of(path), func.id)
        return found if found and found[0].is_relative_to(ROOT / PACKAGE) else None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        bound = bindings(path).get(func.value.id)
        if bound is not None:
            source, attribute = bound
            module = source if attribute is None else f"{source}.{attribute}"
            if module.startswith(PACKAGE) and module_path(module) is not None:
                return definition(module, func.attr)
    return None


def entry(node: ast.AST) -> ast.FunctionDef | None:
    """The function a call runs: the function, or a class's __init__ / __post_init__."""
    if isinstance(node, ast.FunctionDef):
        return node
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name in ("__init__", "__post_init__"):
                return item
    return None


def root_name(expr: ast.expr) -> str | None:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def mentions(expr: ast.expr, followed: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in followed for n in ast.walk(expr))


def is_config(annotation: ast.expr | None) -> bool:
    """A parameter annotated with a config class (ExperimentConfig, DataConfig, ...)."""
    return annotation is not None and "Config" in ast.unparse(annotation)


def receiving(function: ast.FunctionDef, call: ast.Call, followed: set[str], is_class: bool):
    """The callee's config parameters that receive the followed argument."""
    args = [*function.args.posonlyargs, *function.args.args]
    if is_class or (args and args[0].arg in ("self", "cls")):
        args = args[1:]
    names = set()
    for index, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred) or index >= len(args) or not mentions(arg, followed):
            continue
        if is_config(args[index].annotation):
            names.add(args[index].arg)
    by_name = {a.arg: a for a in [*args, *function.args.kwonlyargs]}
    for keyword in call.keywords:
        param = by_name.get(keyword.arg or "")
        if param is not None and is_config(param.annotation) and mentions(keyword.value, followed):
            names.add(param.arg)
    return names


def calls_in_order(function: ast.FunctionDef) -> list[ast.Call]:
    found = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def aliases(function: ast.FunctionDef, followed: set[str]) -> set[str]:
    """The followed names and the locals bound to a part of them (`data = cfg.data`)."""
    names = set(followed)
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and root_name(node.value) in names:
            if isinstance(node.value, (ast.Name, ast.Attribute)):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def walk_function(path: Path, function: ast.FunctionDef, followed: set[str], walk: Walk, seen):
    key = (path, function.name, function.lineno, frozenset(followed))
    if key in seen:
        return
    seen.add(key)
    names = aliases(function, followed)
    for call in calls_in_order(function):
        args = [*call.args, *(k.value for k in call.keywords)]
        if not any(mentions(a, names) for a in args):
            continue
        found = resolve(path, call.func)
        if found is None:
            continue
        callee_path, node = found
        callee = entry(node)
        if callee is None:
            continue
        params = receiving(callee, call, names, isinstance(node, ast.ClassDef))
        if not params:
            continue
        here = str(path.relative_to(ROOT))
        there = str(callee_path.relative_to(ROOT))
        if there != here:
            walk.moves.append(("down", there))
        walk_function(callee_path, callee, params, walk, seen)
        if there != here:
            walk.moves.append(("up", here))


def walk_from(spec: str) -> Walk:
    """`file.py:function:parameter` -> its walk."""
    file, name, parameter = spec.split(":")
    path = (ROOT / file).resolve()
    node = next(
        n for n in ast.walk(parsed(path)) if isinstance(n, ast.FunctionDef) and n.name == name
    )
    walk = Walk(start=file)
    walk_function(path, node, {parameter}, walk, set())
    while walk.moves and walk.moves[-1][0] == "up":
        walk.moves.pop()  # the last way back up is no climb: nothing follows it
    return walk


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "recognition/training/loop.py:train:cfg"
    walk = walk_from(spec)
    depth = 0
    print(walk.start)
    for direction, file in walk.moves:
        depth += 1 if direction == "down" else -1
        print(f"{'  ' * depth}{'v' if direction == 'down' else '^'} {file}")
    print(f"{spec}: {len(walk.rooms)} rooms, {walk.climbs} climbs back up")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
