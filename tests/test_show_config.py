"""`train.py --show-config` and docs/configuration.md: both from the field docstrings."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

import train
from recognition.config import EvalTarget, ExperimentConfig, load_config
from recognition.config.reference import PAGE, REGENERATE, field_docs, reference_page


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # A string that reads as a number unquoted ('2024'), a space, a YAML 1.1 float.
        ("default", ["output_dir='2024'", "data.root=/my faces", "optim.lr=1e-3"]),
        ("ms1m_arcface", ["eval.every_steps=500", "data.image_size=[112, 96]"]),
        ("folder", ["train.resume=auto", "head.m=0.4"]),
    ],
)
def test_show_config_round_trips(name, overrides, tmp_path, capsys):
    assert train.main(["--show-config", "--config", name, *overrides]) == 0
    shown = capsys.readouterr().out
    assert "# The run's name" in shown and "  root: " in shown
    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    assert load_config(str(path)) == load_config(name, overrides)


def test_every_key_has_a_doc():
    missing = []

    def walk(cls: type, prefix: str) -> None:
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif not docs.get(f.name):
                missing.append(prefix + f.name)

    walk(ExperimentConfig, "")
    walk(EvalTarget, "eval.targets[i].")
    assert not missing, f"config keys without a docstring: {missing}"


def test_the_reference_page_is_the_code():
    assert PAGE.read_text() == reference_page(), (
        f"{PAGE.name} disagrees with the config's docstrings: run `{REGENERATE}`"
    )
    assert "| `eval.holdout` | float | `0.05` |" in PAGE.read_text()


def page_defaults() -> dict[str, object]:
    """{dotted key: its default} as docs/configuration.md's tables print them."""
    import re

    import yaml

    keys = PAGE.read_text().partition("\n## Names")[0]  # not the registry's tables
    rows = re.findall(r"^\| `([a-z_.]+)` \| [^|]+ \| `([^`]*)` \|", keys, re.M)
    return {key: yaml.safe_load(value) for key, value in rows}


def test_the_documented_defaults_are_what_python_train_py_runs():
    # One set of defaults: the page's "default" column, key for key, is the config of
    # `python train.py` (and of any file that names no base).
    cfg = dataclasses.asdict(load_config("default"))
    documented = page_defaults()
    assert len(documented) > 80
    differ = []
    for key, value in documented.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        if key != "name" and node != value:
            differ.append(f"{key}: page {value!r}, python train.py {node!r}")
    assert not differ, differ


def test_show_config_says_which_file_set_each_value(capsys):
    assert train.main(["--show-config", "--config", "ms1m_arcface", "optim.lr=0.2"]) == 0
    lines: dict[str, str] = {}  # the first line of each key name (data.root before ...)
    for line in capsys.readouterr().out.splitlines():
        lines.setdefault(line.strip().split(":", 1)[0], line)
    assert "# [configs/ms1m_arcface.yaml]" in lines["root"]  # the experiment file
    assert "# [configs/face_base.yaml]" in lines["margin"]  # its base
    assert "# [command line]" in lines["lr"]
    assert "# [" not in lines["flip"] and "# [" not in lines["sampler"]  # defaults


def test_the_docs_spell_null_as_yaml_does():
    # A YAML file or a key=value writes null; Python's None in a key's doc misleads.
    said = [line for line in PAGE.read_text().splitlines() if re.search(r"\bNone\b", line)]
    assert not said, said
