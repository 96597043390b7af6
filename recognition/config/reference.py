"""Every config key with its doc: `--show-config`'s commented YAML of a resolved config, and
the reference page docs/configuration.md, both from the dataclasses' field docstrings (the
string literal under each field, read from the source with `ast`; `{margins}`,
`{backbones}` and `{formats}` in one become the names in recognition/registry.py).

    python -m recognition.config.reference --write    # regenerates docs/configuration.md
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import types
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from recognition import registry
from recognition.config.eval import EvalTarget
from recognition.config.experiment import ExperimentConfig

# The names a field's doc lists, read from the registry when the doc is (never cached, so
# that a name added at run time is listed too).
TABLES = {
    "{margins}": registry.MARGINS,
    "{backbones}": registry.BACKBONES,
    "{formats}": registry.FORMATS,
    "{protocols}": registry.PROTOCOLS,
}


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of the dataclass `cls`, its bases' fields included (a
    subclass's own docstring wins), the registry's names in place of `{margins}` ...; a
    field without one is left out."""
    docs = dict(_source_docs(cls))
    for name, doc in docs.items():
        for placeholder, table in TABLES.items():
            doc = doc.replace(placeholder, registry.names(table))
        docs[name] = doc
    return docs


@cache
def _source_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} as written in the source of `cls` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:] + [None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def one_line(doc: str | None) -> str:
    """The first sentence of `doc`, on one line ("" for none)."""
    text = " ".join((doc or "").split())
    # A full stop before a capital ends it; "e.g." and "i.e." do not.
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.\s(?=[A-Z`])", text)
    return text[: match.start() + 1] if match else text


def _flow(value: Any) -> str:
    """`value` (plain data) as one line of flow YAML that yaml.safe_load reads back."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def commented_yaml(
    section: Any, indent: int = 0, sources: dict[str, str] | None = None, prefix: str = ""
) -> list[str]:
    """The lines of `section` (a config dataclass) as YAML, each key's one-line doc beside it,
    after `[what set it]` for the dotted keys (`prefix` + name) that `sources` names."""
    docs = field_docs(type(section))
    lines = []
    pad = "  " * indent
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            doc = one_line(docs.get(f.name) or type(value).__doc__)
            lines.append(f"{pad}{f.name}:" + (f"  # {doc}" if doc else ""))
            lines += commented_yaml(value, indent + 1, sources, f"{prefix}{f.name}.")
            continue
        plain = _plain(value)
        doc = one_line(docs.get(f.name))
        source = (sources or {}).get(prefix + f.name)
        if source is not None:
            doc = f"[{source}] {doc}".rstrip()
        lines.append(f"{pad}{f.name}: {_flow(plain)}" + (f"  # {doc}" if doc else ""))
    return lines


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def show_config(cfg: ExperimentConfig, source: str, sources: dict[str, str] | None = None) -> str:
    """`python train.py --show-config`: the resolved `cfg` as YAML that `--config` takes back,
    every key with its one-line doc, after what set it for the keys `sources` names ({dotted
    key: a file or "command line"}, `load_config_sources`). `source` says where it came from
    (the first line)."""
    header = [
        f"# The resolved config of {source}: a file --config takes as it is.",
        "# After each key, [the file or the command line that set it] (none: the default,",
        "# docs/configuration.md) and the first sentence of its doc.",
    ]
    shown = {key: _shown_path(where) for key, where in (sources or {}).items()}
    return "\n".join(header + commented_yaml(cfg, sources=shown)) + "\n"


def _shown_path(where: str) -> str:
    """A source path relative to the working directory when it lies under it."""
    path = Path(where)
    if not path.is_absolute():
        return where
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return where


# ------------------------------------------------------------------------- the reference page

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m recognition.config.reference --write"

INTRO = f"""# Configuration reference

Every config key: its type, its default and what it does, from the field docstrings of
`recognition/config/`. Generated: `{REGENERATE}`
writes this page again (a test fails when it and the code disagree). Back to the
[README](../README.md).

The defaults here are the built-in run's: `python train.py` runs exactly them (its
`configs/default.yaml` sets nothing), and so does any config file for the keys it leaves out.
A file sets its own over them (the face experiments over `configs/face_base.yaml`, which a
`base:` names), and `key=value` on the command line wins over both. `python train.py
--show-config` (with `--config NAME` and `key=value` overrides as for training) prints the
config a run would use, each key with the file or the command line that set it and the first
sentence of its doc, as YAML that `--config` takes back
([training.md](training.md#the-config)). The names that `head.margin`, `model.backbone`,
`data.format` and the kinds of `eval.targets` take are listed [at the end](#names).
"""

NAMES_INTRO = """## Names

What `head.margin`, `model.backbone`, `data.format` and an evaluation target's kind may be
named: the tables of `recognition/registry.py`, where a new one is added
([extending.md](extending.md)).
"""


def names_section() -> list[str]:
    """The reference page's last section: each registry table, a name and its words a row."""
    out = [NAMES_INTRO]
    for title, table in (
        ("`head.margin`", registry.MARGINS),
        ("`model.backbone`", registry.BACKBONES),
        ("`data.format` (besides `auto`)", registry.FORMATS),
        ("`eval.targets[i]` kinds (the key that names the input)", registry.PROTOCOLS),
    ):
        out += [f"### {title}", "", "| name | what | code |", "|---|---|---|"]
        out += [f"| `{name}` | {e.about} | `{e.code}` |" for name, e in table.items()]
        out.append("")
    return out


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field, instance: object | None) -> str:
    """The value a config gets for `f` when it sets nothing: the field of `instance` (a
    default-built section, whose null keys a preset may have resolved, as data.augment's),
    else the field's own default."""
    if instance is not None:
        value = getattr(instance, f.name)
    elif f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"`{_flow(_plain(value))}`"


Section = tuple[type, str, object | None]
"""A section's class, its dotted prefix and its default-built instance (None: none)."""


def _table(cls: type, prefix: str, instance: object | None) -> tuple[list[str], list[Section]]:
    """The rows of `cls`'s plain keys, and its sub-sections."""
    docs, hints = field_docs(cls), get_type_hints(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sub = None if instance is None else getattr(instance, f.name)
            sections.append((tp, f"{prefix}{f.name}", sub))
            continue
        doc = " ".join(docs.get(f.name, "").split()).replace("|", "\\|")
        default = _default(f, instance)
        rows.append(f"| `{prefix}{f.name}` | {_type_name(tp)} | {default} | {doc} |")
    return rows, sections


def reference_page() -> str:
    """docs/configuration.md: a table per section (the top level, then each section)."""
    out = [INTRO]
    # The defaults as a config that sets nothing resolves them (python train.py's).
    todo: list[Section] = [(ExperimentConfig, "", ExperimentConfig())]
    while todo:
        cls, name, instance = todo.pop(0)
        rows, sections = _table(cls, f"{name}." if name else "", instance)
        if name == "eval":  # a target's keys, under eval.targets[i]
            sections.append((EvalTarget, "eval.targets[i]", None))
        title = f"`{name}`" if name else "The top level"
        out += [f"## {title}", "", " ".join(inspect.cleandoc(cls.__doc__ or "").split()), ""]
        if rows:
            out += ["| key | type | default | what it does |", "|---|---|---|---|", *rows, ""]
        todo = sections + todo
    out += names_section()
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recognition.config.reference",
        description="Print (or --write) docs/configuration.md.",
    )
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.name} in docs/")
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(reference_page(), encoding="utf-8")
    else:
        sys.stdout.write(reference_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
