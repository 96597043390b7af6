"""benchmarks/compare_commits.py's --tree: a folder, with overrides of its own after '@'."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.compare_commits import parse_tree


def test_a_tree_alone_has_no_overrides():
    assert parse_tree(".bisect/f2782d6") == (Path(".bisect/f2782d6"), [])


def test_a_tree_carries_its_overrides_after_the_at_sign():
    path, overrides = parse_tree(".@train.compile_scope=blocks,train.compile_mode=default")
    assert path == Path(".")
    assert overrides == ["train.compile_scope=blocks", "train.compile_mode=default"]


def test_an_override_without_a_value_is_refused_naming_the_tree():
    with pytest.raises(ValueError, match=r"--tree \.@blocks"):
        parse_tree(".@blocks")
