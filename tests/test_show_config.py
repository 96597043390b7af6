"""`train.py --show-config` and docs/configuration.md: both from the field docstrings."""

from __future__ import annotations

import dataclasses
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
