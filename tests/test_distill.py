"""Distillation (train.teacher): the loss and its gradient against float64 references, the
teacher's cached embeddings against the teacher itself (per view, per part, at the teacher's
own input size, ONNX included), a resumed run on its cache, a changed teacher refused, a
stale cache rebuilt, the planner's count of the teacher, and teachers that do not load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import make_image_folder, tiny_run_overrides
from test_cli_faults import one_error_line

import train
from recognition import checkpoint as ckpt
from recognition.config import ConfigError, ModelConfig, load_config
from recognition.data.build import build_loader, build_train_dataset
from recognition.data.sampler import EpochBatches, ResumableSampler, draw_flip, sample_seed
from recognition.data.teacher_table import TeacherTable, cached_views
from recognition.data.transforms import load_rgb, to_input_tensor
from recognition.heads.distill import FeatureDistillation
from recognition.models import build_backbone
from recognition.precision import Precision
from recognition.training import train as run_training
from recognition.training.distill import DistillTerm
from recognition.training.plan import plan_rank
from recognition.training.teacher import TeacherFile, build_teacher, read_teacher
from recognition.training.teacher_cache import RECORD_FILE, TEACHER_DIR, write_part


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def faces(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("distill") / "faces")


def write_teacher(path: Path, seed: int, embedding: int = 24) -> torch.nn.Module:
    """An IResNet-18 teacher at 1/8 width for 32x32 images, as a backbone export."""
    torch.manual_seed(seed)
    model = build_backbone("iresnet18", embedding_size=embedding, width=0.125, image_size=32)
    cfg = ModelConfig(backbone="iresnet18", embedding_size=embedding, width=0.125)
    ckpt.export_backbone(path, model.eval(), dataclasses.asdict(cfg), 32)
    return model


def student_args(faces: Path, out: Path, teacher: Path, *extra: str) -> list[str]:
    """A 1/8-width MobileFaceNet student (16-d) on the tiny folder, batches of 8."""
    return tiny_run_overrides(
        faces, out, "model.backbone=mbf", "train.batch_size=8", f"train.teacher={teacher}", *extra
    )


def write_onnx_teacher(path: Path, side: int, dim: int) -> np.ndarray:
    """A linear ONNX teacher for (B, 3, side, side) images: flatten, then a (3 side^2, dim)
    matrix, returned."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((3 * side * side, dim)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["images"], ["flat"], axis=1),
         helper.make_node("MatMul", ["flat", "w"], ["embeddings"])],
        "linear_teacher",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, side, side])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", dim])],
        [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return weight


# ---- the loss -------------------------------------------------------------------------------


def cosine_loss_reference(s, w, t):
    """1 - cos(W s_i, t_i) averaged, and its gradients by s and W, by hand in float64."""
    u = s @ w.T  # (B, Dt)
    nu, nt = u.norm(dim=1, keepdim=True), t.norm(dim=1, keepdim=True)
    cos = (u * t).sum(1, keepdim=True) / (nu * nt)
    loss = (1 - cos).mean()
    # d cos / d u = t / (|u||t|) - cos u / |u|^2; the mean divides by B.
    grad_u = -(t / (nu * nt) - cos * u / nu**2) / len(s)
    return loss, grad_u @ w, grad_u.T @ s


@pytest.mark.parametrize("student_dim, teacher_dim", [(16, 24), (24, 12), (16, 16)])
def test_the_loss_and_its_gradient_match_a_float64_reference(student_dim, teacher_dim):
    torch.manual_seed(0)
    distill = FeatureDistillation(student_dim, teacher_dim).double()
    s = torch.randn(5, student_dim, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, teacher_dim, dtype=torch.float64) * 3
    loss = distill(distill.project(s), t)
    loss.backward()
    w = torch.eye(student_dim, dtype=torch.float64)
    if distill.projection is not None:
        w = distill.projection.weight.detach()
        # Starts as an isometry where it can: orthonormal columns (or rows).
        small = min(student_dim, teacher_dim)
        gram = w.T @ w if student_dim < teacher_dim else w @ w.T
        torch.testing.assert_close(gram, torch.eye(small, dtype=torch.float64), atol=1e-6, rtol=0)
    expected, grad_s, grad_w = cosine_loss_reference(s.detach(), w, t)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.grad, grad_s, rtol=1e-10, atol=1e-12)
    if distill.projection is not None:
        torch.testing.assert_close(distill.projection.weight.grad, grad_w, rtol=1e-10, atol=1e-12)
    else:
        assert not list(distill.parameters())


def test_config_refusals():
    with pytest.raises(
        ConfigError, match="pipeline_stages=2 cannot be combined with train.teacher"
    ):
        load_config("default", ["train.teacher=t.pt", "model.pipeline_stages=2"])
    with pytest.raises(ConfigError, match="train.distill_weight: must be 0 or more, got -1.0"):
        load_config("default", ["train.distill_weight=-1"])


def test_a_resumed_run_refuses_another_teacher_or_none_recorded(tmp_path):
    from recognition.training.teacher_cache import _decide, _write_record

    folder = tmp_path / "run" / TEACHER_DIR
    now = TeacherFile(tmp_path / "b.pt", "9c41" * 16, {}, (32, 32), 8)
    action, line, _ = _decide(folder, now, None, None, 1, resuming=True)
    assert action == "refuse" and "has no record of a teacher" in line and "not distilled" in line
    _write_record(
        folder, dataclasses.replace(now, path=tmp_path / "a.pt", sha256="3f2a" * 16), None
    )
    action, line, _ = _decide(folder, now, None, None, 1, resuming=True)
    assert action == "refuse"
    assert f"{now.path} (SHA-256 9c419c419c41...) is not the teacher this run learned from" in line
    assert f"({tmp_path / 'a.pt'}, SHA-256 3f2a3f2a3f2a...)" in line
    # A fresh run into that directory just records its own teacher.
    assert _decide(folder, now, None, None, 1, resuming=False)[0] == "record"


def test_views_a_table_can_hold():
    cfg = load_config("default", ["data.augment=flip"])
    assert cached_views(cfg.data) == (False, True)
    assert cached_views(load_config("default", ["data.augment=none"]).data) == (False,)
    # A draw from a continuous range: no table, the teacher runs alongside.
    assert cached_views(load_config("default", ["data.augment=face"]).data) is None
    assert cached_views(load_config("default", ["data.augment.blur=0.1"]).data) is None


# ---- the cache against the teacher itself ---------------------------------------------------


def test_cached_rows_are_the_teacher_s_embeddings_of_the_view_each_sample_takes(faces, tmp_path):
    # An ONNX teacher at 16x16 (the student trains at 32x32): rows from the images decoded at
    # the teacher's size, each view as is and mirrored, written by two "ranks" in two parts.
    weight = write_onnx_teacher(tmp_path / "t.onnx", side=16, dim=12)
    teacher_file = read_teacher(tmp_path / "t.onnx")
    assert teacher_file.image_hw == (16, 16) and teacher_file.embedding_size == 12
    cfg = load_config("default", tiny_run_overrides(faces, tmp_path / "run"))
    source = build_train_dataset(cfg.data)
    table = TeacherTable(tmp_path / "table", len(source), 2, (False, True))
    table.folder.mkdir()
    teacher = build_teacher(teacher_file, torch.device("cpu"))
    precision = Precision("O0", "bf16", torch.device("cpu"))
    for rank in (0, 1):
        write_part(teacher, teacher_file, source, table, rank, precision, batch_size=5)
    assert table.check() is None
    paths = sorted(p for p in faces.rglob("*.jpg"))  # the folder's order: by identity, name
    for index in (0, 1, 37, len(paths) - 1):
        image = to_input_tensor(load_rgb(paths[index]), (16, 16)).double()
        for flip in (False, True):
            x = (image.flip(-1) if flip else image).reshape(-1).numpy()
            expected = x @ weight.astype(np.float64)
            expected /= np.linalg.norm(expected)
            got = table.lookup(index, flip).double().numpy()
            np.testing.assert_allclose(got, expected, atol=2e-3)  # float16 rows

    # The loader brings each sample's row of the view it took (the flip its seed draws).
    sampler = ResumableSampler(len(source), seed=3)
    batches = EpochBatches(sampler, 8, 2)
    loader = build_loader(
        cfg.data, source, batches, decode="cpu", device=torch.device("cpu"), targets=table
    )
    sampler.set_epoch(0)
    keys = list(sampler)[:16]  # the first two batches' (index, sample seed)
    batch_iter = iter(loader)
    got = torch.cat([next(batch_iter)[2] for _ in range(2)])
    for (index, seed), row in zip(keys, got, strict=True):
        assert torch.equal(row, table.lookup(index, draw_flip(seed)))
    assert any(draw_flip(sample_seed(3, 0, i)) for i, _ in keys)

    # Run alongside, the teacher takes the student's 32x32 images resized to its 16x16.
    images = torch.stack([to_input_tensor(load_rgb(p), (32, 32)) for p in paths[:3]])
    term = DistillTerm(FeatureDistillation(16, 12), 1.0, teacher, (16, 16))
    small = F.interpolate(images, size=(16, 16), mode="bilinear", antialias=True)
    expected = small.reshape(3, -1).double().numpy() @ weight.astype(np.float64)
    np.testing.assert_allclose(term.targets(images, []).numpy(), expected, rtol=1e-4, atol=1e-4)


def test_cached_and_alongside_steps_agree_and_the_teacher_never_trains(faces, tmp_path):
    from recognition.distributed import DistInfo
    from recognition.training.build import build_model
    from recognition.training.distill import make_distillation

    write_teacher(tmp_path / "t.pt", seed=0)
    teacher_file = read_teacher(tmp_path / "t.pt")
    cfg = load_config("default", tiny_run_overrides(faces, tmp_path / "run", "data.augment=none"))
    source = build_train_dataset(cfg.data)
    table = TeacherTable(tmp_path / "table", len(source), 1, (False,))
    table.folder.mkdir()
    cpu = torch.device("cpu")
    precision = Precision("O0", "bf16", cpu)
    streams = torch.get_rng_state()
    teacher = build_teacher(teacher_file, cpu)
    write_part(teacher, teacher_file, source, table, 0, precision, batch_size=8)
    make_distillation(teacher_file, 16, 1.0, None, cpu)  # a projection, the teacher alongside
    # Nothing drawn from the run's streams: a distilled student starts as it does alone.
    assert torch.equal(torch.get_rng_state(), streams)
    picked = [0, 7, 15, 22, 30, 41, 55, 70]
    images = torch.stack([source[i][0] for i in picked])
    labels = torch.tensor([source[i][1] for i in picked])
    rows = torch.stack([table.lookup(i, False) for i in picked])
    results = {}
    for mode in ("cached", "alongside"):
        torch.manual_seed(0)  # the same projection and student in both
        distill = make_distillation(
            teacher_file, 16, 10.0, table if mode == "cached" else None, cpu
        )
        parts = build_model(
            cfg, DistInfo(0, 0, 1), 12, None, torch.preserve_format, distill=distill
        )
        batch = (images, labels, rows) if mode == "cached" else (images, labels)
        results[mode] = parts.run_step([batch], None)
        if mode == "alongside":
            teacher = distill.teacher
            stepped = {id(p) for g in parts.optimizer.param_groups for p in g["params"]}
            assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
            assert not stepped & {id(p) for p in teacher.parameters()}
            for key, value in teacher.state_dict().items():
                assert torch.equal(value, teacher_file.state[key]), key
    cached, alongside = results["cached"], results["alongside"]
    assert 0 < float(cached.distill_loss) < 2
    # The same step but for the float16 rows of the table.
    torch.testing.assert_close(cached.distill_loss, alongside.distill_loss, atol=2e-3, rtol=0)
    torch.testing.assert_close(cached.loss, alongside.loss, atol=3e-2, rtol=0)


# ---- a distilled run: resumed, refused, rebuilt ---------------------------------------------


def log_of(run_dir: Path) -> str:
    return (run_dir / "train.log").read_text()


def test_a_run_resumes_on_its_cache_and_refuses_a_changed_teacher(faces, tmp_path, capsys):
    teacher = tmp_path / "teacher.pt"
    write_teacher(teacher, seed=0)  # 24-d: the 16-d student learns a projection
    out = tmp_path / "run"
    args = student_args(faces, out, teacher, "train.max_steps=2")
    run_training(load_config("default", args))
    assert "train.teacher: embedding 72 images (as is and mirrored)" in log_of(out)
    record = json.loads((out / TEACHER_DIR / RECORD_FILE).read_text())
    assert record["cache"]["views"] == ["as is", "mirrored"] and record["cache"]["parts"] == 1
    assert record["cache"]["samples"] == 72 and record["cache"]["embedding_size"] == 24
    part = out / TEACHER_DIR / "embeddings-00000-of-00001.npy"
    stamp = (part.stat().st_mtime_ns, part.read_bytes())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= m["distill_loss"] <= 2 for m in metrics)
    entries = ckpt.checkpoint_entries(ckpt.checkpoint_path(out, 2))
    assert "distill/projection.weight" in entries
    assert not [e for e in entries if "teacher" in e]  # the teacher is neither trained nor saved
    saved = torch.load(out / "backbone.pt", weights_only=True)
    assert not [k for k in saved["state_dict"] if "projection" in k]  # the student alone

    seen = len(log_of(out))
    run_training(load_config("default", [*args, "train.resume=true", "train.max_steps=3"]))
    resumed = log_of(out)[seen:]
    assert "reusing the teacher's embeddings of 72 images" in resumed
    assert "embedding 72 images" not in resumed
    assert (part.stat().st_mtime_ns, part.read_bytes()) == stamp

    write_teacher(teacher, seed=1)  # the file changes
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert train.main([*args, "train.resume=true", "train.max_steps=4"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"train.teacher: {teacher} changed since the run started" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints
    assert (part.stat().st_mtime_ns, part.read_bytes()) == stamp

    # A fresh run in a directory holding another teacher's table computes it again.
    fresh = tmp_path / "fresh"
    (fresh / TEACHER_DIR).mkdir(parents=True)
    for file in (out / TEACHER_DIR).iterdir():
        (fresh / TEACHER_DIR / file.name).write_bytes(file.read_bytes())
    run_training(load_config("default", student_args(faces, fresh, teacher, "train.max_steps=1")))
    assert f"computing the teacher's embeddings again ({teacher} changed" in log_of(fresh)
    new_part = fresh / TEACHER_DIR / part.name
    assert new_part.read_bytes() != stamp[1]


# ---- the planner ----------------------------------------------------------------------------


def test_the_planner_counts_the_teacher(faces, tmp_path):
    teacher = tmp_path / "teacher.pt"
    model = write_teacher(teacher, seed=0)
    weights = sum(p.numel() * 4 for p in model.parameters())
    base = [*tiny_run_overrides(faces, tmp_path / "run"), "train.batch_size=8"]

    def plan(*extra: str):
        cfg = load_config("default", [*base, *extra])
        return plan_rank(cfg, 12, 1, 0, granularity=1, detailed=False)  # the peaks alone

    alone = plan()
    alongside = plan(f"train.teacher={teacher}", "train.teacher_cache=false")
    cached = plan(f"train.teacher={teacher}")
    assert alone.teacher_pass == 0 and alongside.teacher_pass == 0
    # Alongside: the teacher's fp32 weights live through the step, and its forward runs.
    assert alongside.peak >= alone.peak + weights
    # Cached: the pass before step 1 holds the teacher and one batch through it; the step
    # holds the batch's cached rows (8 x 24 float16) and the projection (16 x 24), no teacher.
    assert cached.teacher_pass > weights
    assert alone.peak < cached.peak < alone.peak + weights


# ---- teachers that do not load --------------------------------------------------------------


def test_a_teacher_that_does_not_load_is_refused_in_one_line(faces, tmp_path, capsys):
    torch.save({"epoch": 3}, tmp_path / "not_a_backbone.pth")
    (tmp_path / "broken.onnx").write_bytes(b"\x08\x07not a graph")
    state = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=32).state_dict()
    state["fc.weight"] = state["fc.weight"][:, :5]
    torch.save(state, tmp_path / "misfit.pth")
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), tmp_path / "trunk.pth")
    cases = {
        "trunk.pth": "train.teacher: {path}: a classification network's trunk",
        "absent.pt": "train.teacher: {path} does not exist",
        "not_a_backbone.pth": "train.teacher: {path}: checkpoint {path}: neither a backbone",
        "broken.onnx": "train.teacher: {path}: checkpoint {path}: not an ONNX model",
        "misfit.pth": "train.teacher: {path}: checkpoint {path}: not an IResNet state dict",
    }
    for name, expected in cases.items():
        path = tmp_path / name
        out = tmp_path / f"run_{name}"
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        assert train.main(student_args(faces, out, path)) == 1, name
        line = one_error_line(capsys.readouterr().err)
        assert expected.format(path=path) in line, line
        # Nothing written but the log that holds the error line; what was there is kept.
        assert sorted(p.name for p in out.iterdir()) in (["keep.txt"], ["keep.txt", "train.log"])
        assert (out / "keep.txt").read_text() == "mine"
