"""Checkpoint layout versions: a checkpoint written before the format carried a version
(tests/data/checkpoint_v1, saved by the code of that time) still loads into today's parts,
and one from a newer format is refused with a message that says so.

tests/data/checkpoint_v1 holds one step of a tiny O2 (bf16) run: backbone Flatten -> Linear(12,
4) -> BatchNorm1d(4), a 7-class CosFace head with partial FC (sample_rate 0.5, seed 3) whose
sampling step was 2, SGD with momentum after two steps; "progress" kept the sampling step
(`head_sampling_step`), as that format did.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from recognition import checkpoint as ckpt
from recognition.checkpoint import store
from recognition.config import OptimConfig
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.optim import build_optimizer, param_groups
from recognition.precision import Precision
from recognition.training.state import load_training_state

V1 = Path(__file__).parent / "data" / "checkpoint_v1"


def build_parts():
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4))
    head = ShardedMarginSoftmax(7, 4, build_margin("cosface"), sample_rate=0.5, seed=3)
    precision = Precision("O2", "bf16", torch.device("cpu"))
    precision.prepare(backbone, head)
    groups = precision.param_groups(param_groups([backbone, head], 5e-4))
    optimizer = build_optimizer(groups, OptimConfig(lr=0.1))
    head.attach_optimizer(optimizer, precision.optimizer_param(head.weight))
    return backbone, head, optimizer, precision


def test_a_version_1_checkpoint_loads_into_todays_parts(tmp_path):
    path = tmp_path / "step_00000002"
    shutil.copytree(V1, path)
    assert ckpt.checkpoint_version(path) == 1
    # The stored entries, read back whole by DCP alone: the reference for what must load.
    stored = ckpt.read_checkpoint(path)
    backbone, head, optimizer, precision = build_parts()
    objects = load_training_state(path, backbone, head, optimizer, precision, ["progress"])
    assert objects["progress"]["step"] == 2
    for name, value in backbone.state_dict().items():
        assert torch.equal(value, stored[f"backbone/{name}"]), name
    assert torch.equal(head.weight, stored["head/weight"])
    assert torch.equal(precision.optimizer_param(head.weight), stored["precision/masters/1.weight"])
    assert head.sampling_step == 2  # from the version-1 "progress" entry
    momentum = optimizer.state[precision.optimizer_param(head.weight)]["momentum_buffer"]
    stored_momentum = [
        v for k, v in stored.items() if k.startswith("optimizer/state/") and v.shape == (7, 4)
    ]
    assert len(stored_momentum) == 1 and torch.equal(momentum, stored_momentum[0])


def test_a_checkpoint_of_a_newer_format_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "FORMAT_VERSION", 99)
    path = ckpt.save_checkpoint(tmp_path, 1, {"progress": {"step": 1}}, keep=1)
    monkeypatch.undo()
    assert ckpt.checkpoint_version(path) == 99
    with pytest.raises(ValueError, match=r"format version 99, this code reads versions up to 2"):
        ckpt.load_checkpoint(path, {"progress": None})


def test_todays_checkpoints_record_their_version(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, {"progress": {"step": 1}}, keep=1)
    assert ckpt.checkpoint_version(path) == ckpt.FORMAT_VERSION == 2
    assert ckpt.read_checkpoint(path) == {"progress": {"step": 1}}
