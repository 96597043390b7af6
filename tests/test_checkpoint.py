"""Checkpoints in one process: DCP directories written atomically, retention, class rows
loaded into any split, objects read as data only, the training state round trip, the
backbone export, clear errors. (Several ranks and other world sizes: test_distributed_training.)
"""

from __future__ import annotations

import contextlib
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from recognition import checkpoint as ckpt
from recognition.checkpoint import files as ckpt_files
from recognition.config import OptimConfig
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.optim import build_optimizer, param_groups
from recognition.precision import Precision
from recognition.training.state import load_training_state, training_state


def test_atomic_save_leaves_old_file_when_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "backbone.pt"
    ckpt.atomic_save({"a": torch.ones(3)}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_save({"a": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(ckpt.load_file(path)["a"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_keep_newest_and_latest(tmp_path):
    for step in (5, 10, 15, 20):
        ckpt.save_checkpoint(tmp_path, step, {"progress": {"step": step}}, keep=2)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step_00000015", "step_00000020"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000020"
    assert ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path)) == {"progress": {"step": 20}}


def test_a_save_killed_midway_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 1, {"w": torch.ones(4)}, keep=3)
    real_save = dcp.save

    def dies_after_writing(state, *, storage_writer, **kwargs):
        real_save(state, storage_writer=storage_writer, **kwargs)
        (storage_writer.fs.concat_path(storage_writer.path, ".metadata")).unlink()  # partial
        raise KeyboardInterrupt  # the process is stopped before the rename

    monkeypatch.setattr(dcp, "save", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, {"w": torch.zeros(4)}, keep=3)
    monkeypatch.undo()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert (tmp_path / "checkpoints" / ".tmp-step_00000002").is_dir()  # ignored, not loaded
    assert torch.equal(ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path))["w"], torch.ones(4))
    # The next save replaces the leftover.
    ckpt.save_checkpoint(tmp_path, 3, {"w": torch.full((4,), 3.0)}, keep=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000001",
        "step_00000003",
    ]


def test_rows_load_into_any_split(tmp_path):
    full = torch.arange(30, dtype=torch.float32).view(10, 3)
    path = ckpt.save_checkpoint(tmp_path, 1, {"rows": ckpt.rows_of(full, 0, 10)}, keep=1)
    # The shards of 3 ranks (4, 3, 3 rows) read back the rows they stand for.
    for start, count in ((0, 4), (4, 3), (7, 3)):
        local = torch.zeros(count, 3)
        ckpt.load_checkpoint(path, {"rows": ckpt.rows_of(local, start, 10)})
        assert torch.equal(local, full[start : start + count])
        assert not hasattr(local, "global_shape")  # the view carried the marks, not `local`
    with pytest.raises(ValueError, match="do not fit"):
        ckpt.rows_of(torch.zeros(4, 3), 8, 10)


def test_mismatched_or_missing_entries_are_named(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, {"w": torch.ones(4), "meta": {"a": 1}}, keep=1)
    with pytest.raises(ValueError, match=r"entry 'w' has shape \(4,\), expected \(5,\)"):
        ckpt.load_checkpoint(path, {"w": torch.zeros(5)})
    with pytest.raises(ValueError, match="no entry 'other'"):
        ckpt.load_checkpoint(path, {"other": None})
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ckpt.read_checkpoint(tmp_path / "nowhere")
    (path / ".metadata").unlink()
    with pytest.raises(ValueError, match="no .metadata"):
        ckpt.read_checkpoint(path)


def test_objects_are_data_not_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    path = ckpt.save_checkpoint(tmp_path, 1, {"x": Evil()}, keep=1)
    with pytest.raises(ValueError, match="step_00000001"):
        ckpt.read_checkpoint(path)


def test_a_crafted_metadata_file_runs_no_code(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    path = ckpt.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, keep=1)
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match="builtins.print is not allowed"):
        ckpt.read_checkpoint(path)
    assert "executed" not in capsys.readouterr().out


class FakeCudaStreams:
    """torch.cuda's RNG calls over `count` fake devices, `current` this process's, while
    `active()`: each device's state a distinct byte tensor; setting one on a device that
    does not exist raises, as torch does. (Only around the RNG calls: DCP itself uses CUDA
    streams when torch.cuda says it is available.)"""

    def __init__(self, count: int, current: int) -> None:
        self.count, self.current, self.restored = count, current, {}

    @contextlib.contextmanager
    def active(self):
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {
                "is_available": lambda: True,
                "device_count": lambda: self.count,
                "current_device": lambda: self.current,
                "get_rng_state": self.get,
                "set_rng_state": self.set,
                "get_rng_state_all": lambda: [self.get(i) for i in range(self.count)],
                "set_rng_state_all": lambda states: [self.set(x, i) for i, x in enumerate(states)],
            }.items():
                patch.setattr(torch.cuda, name, value)
            yield

    def get(self, device=0) -> torch.Tensor:
        return torch.full((16,), int(device) + 1, dtype=torch.uint8)

    def set(self, state: torch.Tensor, device=0) -> None:
        if not 0 <= int(device) < self.count:
            raise RuntimeError(f"invalid device ordinal {device}")
        self.restored[int(device)] = int(state[0]) - 1


def test_rng_state_keeps_the_ranks_own_cuda_stream_on_another_placement(tmp_path):
    # Rank 5 of 8 on one node of 8 GPUs (its device: 5), resumed as local rank 1 on a node
    # of 4: the stream it drew from is its device's, restored to its new device.
    cuda = FakeCudaStreams(count=8, current=5)
    with cuda.active():
        state = ckpt.rng_state()
    path = ckpt.save_checkpoint(tmp_path, 1, {"rng/5": state}, keep=1)
    saved = ckpt.read_checkpoint(path)["rng/5"]
    cuda.count, cuda.current = 4, 1
    with cuda.active():
        ckpt.set_rng_state(saved)
    assert cuda.restored == {1: 5}


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    path = ckpt.save_checkpoint(tmp_path, 1, {"rng/0": ckpt.rng_state()}, keep=1)
    expected = (torch.rand(3), random.random(), np.random.rand(3))
    ckpt.set_rng_state(ckpt.read_checkpoint(path)["rng/0"])
    again = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(expected[0], again[0])
    assert expected[1] == again[1]
    assert np.array_equal(expected[2], again[2])


def test_unreadable_backbone_file_is_named(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        ckpt.load_file(bad)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        ckpt.load_file(tmp_path / "missing.pt")


def build(level: str):
    """A tiny backbone, a 7-class head, SGD with momentum, at precision `level`."""
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4))
    head = ShardedMarginSoftmax(7, 4, build_margin("cosface"))
    precision = Precision(level, "bf16", torch.device("cpu"))
    precision.prepare(backbone, head)
    groups = param_groups([backbone, head], 5e-4)
    optimizer = build_optimizer(precision.param_groups(groups), OptimConfig(lr=0.1))
    return backbone, head, optimizer, precision


def take_step(backbone, head, optimizer, precision, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(6, 3, 2, 2, generator=generator)
    labels = torch.randint(0, 7, (6,), generator=generator)
    precision.zero_grad(optimizer)
    with precision.autocast():
        loss = head(backbone(precision.cast_inputs(images)), labels)
    precision.backward(loss)
    precision.step(optimizer)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_training_state_round_trip(tmp_path, level):
    torch.manual_seed(0)
    parts = build(level)
    take_step(*parts, seed=1)
    state = training_state(*parts)
    state["progress"] = {"step": 1}
    path = ckpt.save_checkpoint(tmp_path, 1, state, keep=1)
    # The class rows and their momentum are stored as one (num_classes, D) tensor each.
    whole = ckpt.read_checkpoint(path)
    assert whole["head/weight"].shape == (7, 4)
    momentum = [k for k in whole if k.startswith("optimizer/state/") and whole[k].shape == (7, 4)]
    assert len(momentum) == 1
    assert any(k.startswith("precision/masters/") for k in whole) == (level == "O2")

    torch.manual_seed(1)  # other initial weights, an optimizer with no state yet
    fresh = build(level)
    loaded = load_training_state(path, *fresh, objects=["progress", "absent"])
    assert loaded == {"progress": {"step": 1}, "absent": None}
    for a, b in zip(parts[0].state_dict().values(), fresh[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(parts[1].weight, fresh[1].weight)
    for (_, _, a), (_, _, b) in zip(parts[3].masters(), fresh[3].masters(), strict=True):
        assert torch.equal(a, b)
    # The next step is the same from the original and from the restored state.
    take_step(*parts, seed=2)
    take_step(*fresh, seed=2)
    assert torch.equal(parts[1].weight, fresh[1].weight)
    for a, b in zip(parts[0].parameters(), fresh[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_training_state_refuses_another_class_count(tmp_path):
    parts = build("O0")
    path = ckpt.save_checkpoint(tmp_path, 1, training_state(*parts), keep=1)
    backbone, _, _, precision = build("O0")
    head = ShardedMarginSoftmax(9, 4, build_margin("cosface"))
    optimizer = torch.optim.SGD(list(backbone.parameters()) + list(head.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"class matrix is \(7, 4\).*\(9, 4\)"):
        load_training_state(path, backbone, head, optimizer, precision)


def test_backbone_from_a_training_checkpoint_prefers_fp32_masters(tmp_path):
    parts = build("O2")
    take_step(*parts, seed=1)
    state = training_state(*parts)
    state["meta"] = {"config": {"model": {"backbone": "x"}, "data": {"image_size": 2}}}
    path = ckpt.save_checkpoint(tmp_path, 1, state, keep=1)
    model_cfg, image_size, weights = ckpt.load_backbone_file(path)
    assert model_cfg == {"backbone": "x"} and image_size == 2
    masters = {key.removeprefix("0."): m for key, _, m in parts[3].masters() if key[0] == "0"}
    assert weights["1.weight"].dtype == torch.float32
    assert torch.equal(weights["1.weight"], masters["1.weight"])  # not the bf16 weight
    assert weights.keys() == parts[0].state_dict().keys()


@pytest.mark.parametrize(
    "stored, loaded", [(112, 112), ((256, 128), (256, 128)), ([64, 32], (64, 32))]
)
def test_backbone_export_keeps_its_image_size(tmp_path, stored, loaded):
    # An int (every export before [H, W] sizes) loads as an int; [H, W] as (H, W).
    ckpt.export_backbone(tmp_path / "b.pt", nn.Linear(2, 2), {"backbone": "x"}, stored)
    _, image_size, _ = ckpt.load_backbone_file(tmp_path / "b.pt")
    assert image_size == loaded and type(image_size) is type(loaded)


def test_training_checkpoint_gives_height_width(tmp_path):
    state = {"backbone": nn.Linear(2, 2).state_dict()}
    state["meta"] = {"config": {"model": {"backbone": "x"}, "data": {"image_size": [64, 32]}}}
    path = ckpt.save_checkpoint(tmp_path, 1, state, keep=1)
    assert ckpt.load_backbone_file(path)[1] == (64, 32)


def to_dev_full(real_open):
    """An `open` that sends writes of files named like checkpoint data to /dev/full."""

    def fake_open(file, mode="r", *args, **kwargs):
        if "w" in mode and (str(file).endswith(".distcp") or ".tmp" in Path(file).name):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    return fake_open


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_exporting_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    import builtins

    path = tmp_path / "backbone.pt"
    ckpt.atomic_save({"a": torch.ones(3)}, path)
    monkeypatch.setattr(ckpt_files, "open", to_dev_full(builtins.open), raising=False)
    with pytest.raises(OSError, match=rf"writing {path} failed: no space left on device"):
        ckpt.atomic_save({"a": torch.zeros(1000)}, path)
    monkeypatch.undo()
    assert torch.equal(ckpt.load_file(path)["a"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["backbone.pt"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    ckpt.save_checkpoint(tmp_path, 1, {"w": torch.ones(4)}, keep=3)
    real_stream = FileSystem.create_stream

    def full_stream(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            return real_stream(self, "/dev/full", mode)
        return real_stream(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full_stream)
    with pytest.raises(OSError, match=r"step_00000002 failed: no space left on device"):
        ckpt.save_checkpoint(tmp_path, 2, {"w": torch.zeros(4)}, keep=3)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]
    assert torch.equal(ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path))["w"], torch.ones(4))
