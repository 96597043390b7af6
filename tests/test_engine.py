"""The training loop end to end on a tiny image folder: smoke run, resume, failure modes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch

from recognition import checkpoint as ckpt
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.precision import Precision
from recognition.training import TrainingError, train, train_step


def tiny_config(image_folder: Path, out: Path, *extra: str):
    return helpers.tiny_config(
        image_folder, out, "train.epochs=2", "optim.warmup_epochs=0.5", *extra
    )


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def dir_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_smoke_run_writes_the_run_directory(image_folder, tmp_path):
    run_dir = train(tiny_config(image_folder, tmp_path / "run"))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # 72 images / batch 8 = 9 steps per epoch, 2 epochs.
    assert [r["step"] for r in records] == list(range(1, 19))
    for key in ("step", "epoch", "loss", "lr", "samples_per_sec"):
        assert all(key in r for r in records)
    assert all(np.isfinite(r["loss"]) for r in records)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert (run_dir / "classes.txt").read_text().split() == [f"id{c:02d}" for c in range(12)]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert ckpt.latest_checkpoint(run_dir).name == "step_00000018"
    model_cfg, image_size, state = ckpt.load_backbone_file(run_dir / "backbone.pt")
    assert model_cfg["backbone"] == "iresnet18" and image_size == 32
    assert all(v.dtype != torch.float16 for v in state.values())


@pytest.mark.parametrize("level, sample_rate", [("O0", 1.0), ("O2", 1.0), ("O0", 0.5)])
def test_resume_continues_the_same_loss_curve(image_folder, tmp_path, level, sample_rate):
    common = (
        f"precision.level={level}",
        "precision.dtype=bf16",
        "train.checkpoint_every=5",
        f"head.sample_rate={sample_rate}",
    )
    straight = train(
        tiny_config(image_folder, tmp_path / "straight", "train.max_steps=12", *common)
    )
    split = tmp_path / "split"
    train(tiny_config(image_folder, split, "train.max_steps=5", *common))
    train(tiny_config(image_folder, split, "train.max_steps=12", "train.resume=true", *common))
    a, b = losses(straight), losses(split)
    assert sorted(b) == list(range(1, 13))
    # Step 10 crosses an epoch boundary (9 steps per epoch) after the resume at step 5.
    for step in range(1, 13):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    wa = ckpt.load_backbone_file(straight / "backbone.pt")[2]
    wb = ckpt.load_backbone_file(split / "backbone.pt")[2]
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-5, atol=1e-6)


def test_existing_run_is_not_overwritten(image_folder, tmp_path):
    cfg = tiny_config(image_folder, tmp_path / "run", "train.max_steps=2")
    train(cfg)
    before = dir_bytes(ckpt.latest_checkpoint(tmp_path / "run"))
    with pytest.raises(TrainingError, match="already holds a run"):
        train(cfg)
    assert dir_bytes(ckpt.latest_checkpoint(tmp_path / "run")) == before


def test_resume_without_checkpoint_is_an_error(image_folder, tmp_path):
    with pytest.raises(TrainingError, match="no checkpoint"):
        train(tiny_config(image_folder, tmp_path / "none", "train.resume=true"))


def nan_after(monkeypatch, good_forwards: int) -> None:
    """Make the head's loss NaN after `good_forwards` forward passes."""
    real_forward = ShardedMarginSoftmax.forward
    calls = {"n": 0}

    def forward(self, embeddings, labels):
        calls["n"] += 1
        loss = real_forward(self, embeddings, labels)
        return loss * float("nan") if calls["n"] > good_forwards else loss

    monkeypatch.setattr(ShardedMarginSoftmax, "forward", forward)


def test_nonfinite_losses_stop_the_run_and_reach_no_weight(image_folder, tmp_path, monkeypatch):
    """Losses are NaN from step 5 on. A skipped step still counts (schedule and step), so
    the checkpoint of step 6 is written after two skipped steps: it must hold the weights
    and the optimizer state of step 4 exactly, and the run stops at step 7, the third in a
    row (read at the logging interval, every step here)."""
    nan_after(monkeypatch, 4)
    cfg = tiny_config(
        image_folder,
        tmp_path / "run",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=5",
        "train.max_nonfinite_steps=3",
    )
    with pytest.raises(TrainingError, match="3 non-finite losses in a row by step 7"):
        train(cfg)
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert latest.name == "step_00000006"
    assert ckpt.read_checkpoint(latest, ["progress"])["progress"]["step"] == 6
    # BatchNorm's running statistics move in every forward; parameters and momentum must not.
    moved_in_forward = ("running_mean", "running_var", "num_batches_tracked")
    parts = ("backbone/", "head/", "optimizer/state/")
    before = ckpt.read_checkpoint(ckpt.checkpoint_path(tmp_path / "run", 4), parts)
    after = ckpt.read_checkpoint(latest, parts)
    assert set(after) == set(before) and any(k.startswith("optimizer/state/") for k in after)
    for key, value in after.items():
        if torch.is_tensor(value) and not key.endswith(moved_in_forward):
            assert torch.isfinite(value).all(), key
            assert torch.equal(value, before[key]), key
    # The skipped steps are logged (no finite loss: null), and the schedule moved on.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = {r["step"]: r for r in map(json.loads, lines)}
    assert sorted(records) == list(range(1, 8))
    assert [records[s]["skipped_steps"] for s in range(1, 8)] == [0, 0, 0, 0, 1, 1, 1]
    assert [records[s]["loss"] is None for s in range(1, 8)] == [False] * 4 + [True] * 3
    assert records[7]["lr"] != records[4]["lr"]


def test_nonfinite_steps_are_counted_on_the_device_and_read_at_the_log_interval(
    image_folder, tmp_path, monkeypatch
):
    """NaN from step 3 on, logging every 4 steps: the limit of 3 in a row is reached at step
    5 but read at step 8, where the run stops having logged both windows."""
    nan_after(monkeypatch, 2)
    cfg = tiny_config(
        image_folder, tmp_path / "run", "train.log_every=4", "train.max_nonfinite_steps=3"
    )
    with pytest.raises(TrainingError, match="6 non-finite losses in a row by step 8"):
        train(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(4, 2), (8, 4)]
    assert np.isfinite(records[0]["loss"]) and records[1]["loss"] is None
    log = (tmp_path / "run" / "train.log").read_text()
    assert "steps 1-4: 2 non-finite losses" in log and "steps 5-8: 4 non-finite losses" in log


def test_train_step_accumulation_matches_one_big_batch():
    """Two micro-batches of 4 with the loss halved = one batch of 8 (no BatchNorm here)."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6)).double()
    head = ShardedMarginSoftmax(5, 6, build_margin("cosface")).double()
    images = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    results = []
    for batches in ([(images, labels)], [(images[:4], labels[:4]), (images[4:], labels[4:])]):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6)).double()
        model.load_state_dict(backbone.state_dict())
        margin_head = ShardedMarginSoftmax(5, 6, build_margin("cosface")).double()
        margin_head.load_state_dict(head.state_dict())
        precision = Precision("O0", "bf16", torch.device("cpu"))
        optimizer = torch.optim.SGD(
            list(model.parameters()) + list(margin_head.parameters()), lr=0.5
        )
        result = train_step(model, margin_head, batches, optimizer, precision, None)
        assert result.finite and result.stepped
        results.append((result, [p.detach().clone() for p in model.parameters()]))
    (one, p_one), (two, p_two) = results
    # The reported loss is the mean over micro-batches, the gradient that of the mean loss.
    assert float(two.loss) == pytest.approx(float(one.loss), rel=1e-12)
    for a, b in zip(p_one, p_two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# The losses and gradient norms (float.hex) of the first 6 steps of `tiny_config`'s run (the
# default config's model, head, optimizer and precision on the tiny folder) as the code gave
# them before the step's gradient norm became one multi-tensor norm (commit 8e7668e), with
# the CPU kernels pinned to AVX2 and one thread (GOLDEN_ENV): the step's numbers must not
# move when its host work changes. oneDNN's AVX-512 convolutions round differently, hence
# the pins; the run is a process of its own, since the pins act when torch starts.
GOLDEN_CURVE = [
    (1, "0x1.04b3720000000p+4", "0x1.fc28f639fba3bp+8"),
    (2, "0x1.c9c53c0000000p+3", "0x1.74b1d3a05f864p+8"),
    (3, "0x1.1384400000000p+4", "0x1.ffbde1590080ep+7"),
    (4, "0x1.26a9020000000p+3", "0x1.45c1c94d609e7p+7"),
    (5, "0x1.4d511a0000000p+2", "0x1.0438e296d9f7ap+7"),
    (6, "0x1.b62cb60000000p+2", "0x1.9b0a02a547572p+6"),
]
GOLDEN_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}
GOLDEN_RUN = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
sys.path.insert(0, "tests")
import helpers
from recognition.training import train
out = Path(sys.argv[1])
faces = helpers.make_image_folder(out / "faces")
run_dir = train(helpers.tiny_config(faces, out / "run", "train.max_steps=6"))
records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
curve = [[r["step"], float(r["loss"]).hex(), float(r["grad_norm"]).hex()] for r in records]
print(json.dumps(curve))
"""


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the golden curve was recorded with x86-64's AVX2 kernels",
)
def test_the_default_run_keeps_its_curve_bit_for_bit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", GOLDEN_RUN, str(tmp_path)],
        cwd=helpers.REPO, env={**helpers.child_env(), **GOLDEN_ENV},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    curve = [tuple(step) for step in json.loads(done.stdout.strip().splitlines()[-1])]
    assert curve == GOLDEN_CURVE


def test_the_gradient_norm_is_the_per_tensor_norms_summed_in_float64():
    """global_grad_norm against its definition, one tensor at a time: the norm of each
    gradient (in fp32 at least), then the float64 sum of their squares in parameter order,
    with fp32 and bf16 gradients interleaved (O2's BatchNorm among half weights)."""
    from recognition.training import global_grad_norm

    generator = torch.Generator().manual_seed(0)
    params = []
    for index in range(40):
        dtype = torch.bfloat16 if index % 3 == 1 else torch.float32
        shape = (1 + index % 7, 1 + (5 * index) % 11)
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        param.grad = (torch.randn(shape, generator=generator) * 10.0 ** (index % 7 - 3)).to(dtype)
        params.append(param)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: not counted
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params[:-1]]
    total = torch.zeros((), dtype=torch.float64)
    for norm in norms:
        total = total + norm.double() ** 2
    got = global_grad_norm(params)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(total.sqrt().item(), rel=1e-15, abs=0)
    # Bit for bit against the same sum as one reduction in parameter order (the run's
    # numbers depend on it): not the groups' order, nor any other.
    assert got.item() == torch.stack([n.double() for n in norms]).square().sum().sqrt().item()


def test_nonfinite_stop_says_no_checkpoint_exists_and_advises_only_what_is_unset(
    image_folder, tmp_path, monkeypatch
):
    nan_after(monkeypatch, 1)
    cfg = tiny_config(
        image_folder,
        tmp_path / "run",
        "train.max_nonfinite_steps=2",
        "optim.grad_clip=5",
        "precision.level=O1",
        "precision.dtype=bf16",
    )
    with pytest.raises(TrainingError) as caught:
        train(cfg)
    message = str(caught.value)
    assert "2 non-finite losses in a row" in message
    assert "No checkpoint was written" in message and "is intact" not in message
    assert "grad_clip" not in message and "precision.level" not in message  # already so
    assert "optim.lr" in message
    assert ckpt.latest_checkpoint(tmp_path / "run") is None


def test_nonfinite_stop_names_the_intact_checkpoint_and_suggests_clipping(
    image_folder, tmp_path, monkeypatch
):
    nan_after(monkeypatch, 4)
    cfg = tiny_config(
        image_folder,
        tmp_path / "run",
        "train.checkpoint_every=2",
        "train.max_nonfinite_steps=2",
        "optim.grad_clip=null",
    )
    with pytest.raises(TrainingError) as caught:
        train(cfg)
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert f"The last checkpoint, {latest}, is intact" in str(caught.value)
    assert "optim.grad_clip" in str(caught.value)


def damage_item(data_file: Path, which: str) -> None:
    """Overwrite the first bytes ("start") or the last ones ("end") of the middle item of a
    checkpoint's data file, keeping the file's size."""
    from recognition.checkpoint.planners import SafeReader

    metadata = SafeReader(data_file.parent).read_metadata()
    extents = sorted(
        (info.offset, info.length)
        for info in metadata.storage_data.values()
        if info.relative_path == data_file.name
    )
    offset, length = extents[len(extents) // 2]
    data = bytearray(data_file.read_bytes())
    at = offset if which == "start" else offset + length - 30
    data[at : at + 30] = bytes(30)
    data_file.write_bytes(bytes(data))


# Damage anywhere in the file: its first item (cut to 100 bytes), only its last item (one
# byte cut), a middle item's start or end (overwritten, the size unchanged), the file
# gone, the index unreadable. A check of the first item alone passes the second and third.
DAMAGES = ["truncate", "cut_last_item", "middle_item_start", "middle_item_end", "delete",
           "metadata"]  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_auto_skips_a_damaged_newest_checkpoint(image_folder, tmp_path, damage):
    common = ("train.checkpoint_every=2", "train.keep_checkpoints=3")
    run_dir = tmp_path / "run"
    train(tiny_config(image_folder, run_dir, "train.max_steps=4", *common))
    newest = ckpt.latest_checkpoint(run_dir)
    assert newest.name == "step_00000004"
    data_file = next(newest.glob("*.distcp"))
    if damage == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:100])
    elif damage == "cut_last_item":
        data_file.write_bytes(data_file.read_bytes()[:-1])
    elif damage.startswith("middle_item"):
        damage_item(data_file, damage.rpartition("_")[2])
    elif damage == "delete":
        data_file.unlink()
    else:
        (newest / ".metadata").write_bytes(b"\x80\x04not a pickle")
    assert ckpt.verify_checkpoint(newest) is not None
    assert ckpt.verify_checkpoint(ckpt.checkpoint_path(run_dir, 2)) is None
    train(tiny_config(image_folder, run_dir, "train.max_steps=6", "train.resume=auto", *common))
    assert "step_00000004 is damaged" in (run_dir / "train.log").read_text()
    # Resumed at step 2: steps 3-6 were trained again and logged once each.
    assert sorted(losses(run_dir)) == list(range(1, 7))
    assert ckpt.latest_checkpoint(run_dir).name == "step_00000006"


def test_an_explicitly_named_damaged_checkpoint_is_refused(image_folder, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(image_folder, run_dir, "train.max_steps=2"))
    latest = ckpt.latest_checkpoint(run_dir)
    data_file = next(latest.glob("*.distcp"))
    whole = data_file.read_bytes()
    damage_item(data_file, "start")  # a middle item: by name, before any tensor is read
    with pytest.raises(TrainingError, match=r"is damaged: its data file .* is damaged in item"):
        train(tiny_config(image_folder, tmp_path / "other", f"train.resume={latest}"))
    data_file.write_bytes(whole[:-1])  # only the last item
    with pytest.raises(TrainingError, match=r"is damaged: its data file .* is truncated"):
        train(tiny_config(image_folder, tmp_path / "other", f"train.resume={latest}"))
    data_file.unlink()
    with pytest.raises(TrainingError, match=r"is damaged: its data file .* is missing"):
        train(tiny_config(image_folder, tmp_path / "other", f"train.resume={latest}"))


def test_deterministic_mode_is_on_during_the_run_and_restored_after(image_folder, tmp_path):
    import os

    import recognition.training.loop as loop

    seen = {}
    real = loop._train

    def spy(cfg, *args):
        seen["algorithms"] = torch.are_deterministic_algorithms_enabled()
        seen["cudnn"] = torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        return real(cfg, *args)

    before = torch.are_deterministic_algorithms_enabled()
    loop._train = spy
    try:
        train(
            tiny_config(
                image_folder, tmp_path / "run", "train.max_steps=2", "train.deterministic=true"
            )
        )
    finally:
        loop._train = real
    assert seen == {"algorithms": True, "cudnn": True, "cublas": ":4096:8"}
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_backbone_trains_like_the_eager_one(image_folder, tmp_path, scope):
    """train.compile=true, by blocks or whole: the same losses as eager over a few steps,
    checkpoints under the same names. The aot_eager backend traces the backbone as inductor
    would (dynamo, AOT autograd) without generating kernels, which take minutes to build on
    2 CPU cores; inductor itself (whose reordered float32 arithmetic gave the same losses
    within 4e-4 over 3 steps here) is measured by benchmarks/compile_cpu.py."""
    steps = ("train.max_steps=3",)
    eager = train(tiny_config(image_folder, tmp_path / "eager", *steps))
    compiled = train(
        tiny_config(
            image_folder,
            tmp_path / "compiled",
            *steps,
            "train.compile=true",
            "train.compile_backend=aot_eager",
            f"train.compile_scope={scope}",
        )
    )
    a, b = losses(eager), losses(compiled)
    assert sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    names = ckpt.read_checkpoint(ckpt.latest_checkpoint(compiled)).keys()
    assert names == ckpt.read_checkpoint(ckpt.latest_checkpoint(eager)).keys()
    assert "compiling the backbone took" in (compiled / "train.log").read_text()


def test_compiling_by_blocks_compiles_each_kind_of_block_once():
    """train.compile_scope=blocks on IResNet-34 (16 blocks: in each of the 4 stages a first
    block that changes the shape and others alike): 8 graphs, the blocks compiled in place
    (the parameters keep their names), forward and gradients as eager's; a backbone without
    blocks is compiled whole."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from recognition.config import load_config
    from recognition.models import build_backbone
    from recognition.training.build import compile_model

    cfg = load_config(
        "default",
        ["train.compile=true", "train.compile_backend=aot_eager", "train.compile_scope=blocks"],
    )
    torch.manual_seed(0)
    model = build_backbone("iresnet34", image_size=32, embedding_size=16, width=0.125)
    reference = build_backbone("iresnet34", image_size=32, embedding_size=16, width=0.125)
    reference.load_state_dict(model.state_dict())
    names = list(model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_model(model, cfg, torch.device("cpu"))
    assert compiled is model and len(model.blocks()) == 16
    x = torch.randn(4, 3, 32, 32)
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert counters["stats"]["unique_graphs"] == 8
    assert list(model.state_dict()) == names
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert isinstance(compile_model(plain, cfg, torch.device("cpu")), torch._dynamo.OptimizedModule)


def test_blocks_are_compiled_with_static_shapes():
    """train.compile_scope=blocks: each kind of block's graph has the sizes it runs at, also
    the kinds after the first (whose other sizes Dynamo would otherwise compile with
    symbolic sizes, which Inductor's convolution lowering specialises back: slower to
    compile). Seen by a backend that records the graphs' inputs."""
    import torch._dynamo

    from recognition.config import load_config
    from recognition.models import build_backbone
    from recognition.training.build import compile_model

    graphs = []

    def recording(gm, example_inputs):
        # What each input of the graph is while traced: a tensor's sizes, or a size itself.
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append([tuple(v.shape) if isinstance(v, torch.Tensor) else (v,) for v in values])
        return gm.forward

    cfg = load_config("default", ["train.compile=true", "train.compile_scope=blocks"])
    cfg.train.compile_backend = recording  # a callable backend, as torch.compile takes one
    torch.manual_seed(0)
    model = build_backbone("iresnet34", image_size=32, embedding_size=16, width=0.125)
    torch._dynamo.reset()
    compile_model(model, cfg, torch.device("cpu"))
    with torch.no_grad():
        model(torch.randn(4, 3, 32, 32))
    assert len(graphs) == 8
    symbolic = [s for shapes in graphs for shape in shapes for s in shape if not isinstance(s, int)]
    assert symbolic == [], graphs


def test_blocks_stay_compiled_after_head_only_steps_and_in_evaluation():
    """Every block of a class shares one forward code object, and Dynamo's recompile limit
    (8) counts that object's graphs: IResNet-34's 8 kinds of block held in eval mode without
    gradients first (train.head_only_steps, evaluation) and then trained make 16. Each
    block's forward runs a compiled graph in both, counted by a backend whose graphs count
    their calls (at the limit Dynamo would run the blocks eagerly, silently)."""
    import torch._dynamo

    from recognition.config import load_config
    from recognition.models import build_backbone
    from recognition.models.units import UnitChain
    from recognition.training.build import compile_model

    calls = {"graphs": 0, "runs": 0}

    def counting(gm, example_inputs):
        calls["graphs"] += 1

        def run(*args):
            calls["runs"] += 1
            return gm.forward(*args)

        return run

    cfg = load_config("default", ["train.compile=true", "train.compile_scope=blocks"])
    cfg.train.compile_backend = counting
    torch.manual_seed(0)
    model = build_backbone("iresnet34", image_size=32, embedding_size=16, width=0.125)
    blocks = len(next(m for m in model.modules() if isinstance(m, UnitChain)).blocks())
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        compile_model(model, cfg, torch.device("cpu"))
        images = torch.randn(4, 3, 32, 32)
        for mode in ("held", "trained", "held"):
            calls["runs"] = 0
            model.train(mode == "trained")
            with torch.set_grad_enabled(mode == "trained"):
                model(images).sum().backward() if mode == "trained" else model(images)
            assert calls["runs"] == blocks, (mode, calls)
    torch._dynamo.reset()
    assert calls["graphs"] == 16


def test_training_uses_one_loader_iterator_across_epochs(image_folder, tmp_path, monkeypatch):
    """The loop never re-creates the DataLoader iterator at an epoch boundary, so its
    workers keep loading ahead into the next epoch."""
    from torch.utils.data import DataLoader

    calls = []
    real_iter = DataLoader.__iter__
    monkeypatch.setattr(DataLoader, "__iter__", lambda self: calls.append(1) or real_iter(self))
    run_dir = train(
        tiny_config(image_folder, tmp_path / "run", "train.max_steps=12")
    )  # 9 per epoch
    assert (run_dir / "metrics.jsonl").read_text().count('"loss"') == 12
    assert len(calls) == 1


def draw_class_rows_on_the_cpu(monkeypatch) -> None:
    """Heads draw their class rows with the CPU's generator on any device (and copy them
    there): a CUDA generator draws other rows, which moves this tiny run's losses by 1-30 %."""
    draw = ShardedMarginSoftmax.reset_parameters

    def on_the_cpu(self) -> None:
        device = self.weight.device
        self.weight.data = self.weight.data.cpu()
        draw(self)
        self.weight.data = self.weight.data.to(device)

    monkeypatch.setattr(ShardedMarginSoftmax, "reset_parameters", on_the_cpu)


@helpers.needs_cuda
def test_training_on_cuda_follows_the_cpu_run(image_folder, tmp_path, monkeypatch):
    # Same seed, same batches (decoded on the CPU in both runs), the same class rows; the
    # GPU differs by its kernels' rounding (cuDNN convolutions run in TF32 by default, 10
    # mantissa bits), so the loss curves agree to a tolerance. At lr 0.01: this tiny run
    # is chaotic at the default 0.1 (inputs changed by 1e-4 move its 4th loss by 12 %),
    # while at 0.01 a change of 1e-3 stays below 1 % and an update half or twice as large
    # moves the losses after the first by 3-13 % (both measured on the CPU).
    draw_class_rows_on_the_cpu(monkeypatch)
    steps = ("train.max_steps=4", "optim.lr=0.01", "data.decode=cpu")
    cpu = losses(train(tiny_config(image_folder, tmp_path / "cpu", "train.device=cpu", *steps)))
    cuda = losses(train(tiny_config(image_folder, tmp_path / "cuda", "train.device=cuda", *steps)))
    assert list(cuda) == list(cpu) == [1, 2, 3, 4]
    for step, loss in cpu.items():
        assert cuda[step] == pytest.approx(loss, rel=2e-2)


@helpers.needs_cuda
def test_deterministic_training_on_cuda_repeats_exactly(image_folder, tmp_path):
    extra = ("train.device=cuda", "train.deterministic=true", "train.max_steps=6")
    first = losses(train(tiny_config(image_folder, tmp_path / "a", *extra)))
    second = losses(train(tiny_config(image_folder, tmp_path / "b", *extra)))
    assert first == second
