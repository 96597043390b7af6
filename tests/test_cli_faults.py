"""Faults a user meets, each with one line that names the file, line or key, no traceback,
a non-zero exit and nothing already written lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import folder_overrides
from test_cli import make_folder, tiny_args

import evaluate
import train
from recognition.config import ConfigError, load_config
from recognition.data.pairs import load_pairs
from recognition.data.workers import error_message
from recognition.evaluation.embeddings import PathDataset, extract_embeddings

REPO = Path(__file__).resolve().parent.parent


def one_error_line(err: str) -> str:
    """The `error:` line of stderr; fails on a traceback, on more than one such line, or on
    its message standing on any other line too (a log line repeating it, say)."""
    assert "Traceback" not in err and "Caught " not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(("error:", "config error:"))]
    assert len(lines) == 1, err[-3000:]
    message = lines[0].split(": ", 1)[1]
    carrying = [line for line in err.splitlines() if message in line]
    assert len(carrying) == 1, f"the message stands on {len(carrying)} lines:\n{err[-3000:]}"
    return lines[0]


# ---- configs that say what they mean -------------------------------------------------------


def test_clearing_the_targets_clears_the_best_metric_of_the_file():
    cfg = load_config("ms1m_arcface", ["eval.targets=[]"])
    assert cfg.eval.targets == [] and cfg.eval.best_metric is None
    assert load_config("ms1m_arcface").eval.best_metric == "cfp_fp/accuracy"
    # Set on the command line too: kept, and refused with the override that fixes it.
    with pytest.raises(ConfigError, match="without targets, set eval.best_metric=null"):
        load_config("ms1m_arcface", ["eval.targets=[]", "eval.best_metric=lfw/accuracy"])


@pytest.mark.parametrize(
    "name", ["face_base", "ms1m_arcface", "glint360k_cosface", "webface42m_arcface_pfc"]
)
def test_no_workers_clears_the_prefetch_factor_of_the_file(name):
    assert load_config(name).data.prefetch_factor == 4
    cfg = load_config(name, ["data.num_workers=0"])
    assert (cfg.data.num_workers, cfg.data.prefetch_factor) == (0, None)
    # Set on the command line too: refused with the override that fixes it.
    fix = r"with data.num_workers=0, set data.prefetch_factor=null"
    with pytest.raises(ConfigError, match=fix):
        load_config(name, ["data.num_workers=0", "data.prefetch_factor=2"])


@pytest.mark.parametrize("value", [".nan", "nan", ".inf", "-.inf", "1e999"])
def test_non_finite_numbers_are_named_by_their_own_key(value, capsys):
    assert train.main([f"optim.lr={value}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "optim.lr: must be a finite number" in line


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.augment=faces", "data.augment.preset: 'faces' is not one of none, flip, face"),
        ("data.augment.erase=2", "data.augment.erase: 2.0 is a probability"),
        ("data.augment.crop_scale=[1, 0.5]", "data.augment.crop_scale: [1, 0.5] is upside down"),
    ],
)
def test_a_bad_augmentation_is_one_line_before_anything_is_written(
    override, message, tmp_path, capsys
):
    assert train.main([override, f"output_dir={tmp_path / 'run'}"]) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_config_that_is_not_utf8_names_the_file(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  epochs: 1  # caf\xe9\n".encode("latin-1"))
    assert train.main(["--config", str(path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(path) in line and "not UTF-8" in line


# ---- files and folders -----------------------------------------------------------------------


def test_output_dir_that_is_a_file_is_named_and_kept(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    target = tmp_path / "taken"
    target.write_text("someone's notes\n")
    assert train.main(tiny_args(data, target)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "output_dir" in line and str(target) in line
    assert target.read_text() == "someone's notes\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_output_dir_that_cannot_be_written_names_output_dir(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    assert train.main(tiny_args(data, Path("/proc/no-such-run"))) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "output_dir: cannot write the run directory /proc/no-such-run" in line


def test_data_root_that_is_a_file(tmp_path, capsys):
    data = tmp_path / "faces.zip"
    data.write_bytes(b"PK\x03\x04")
    assert train.main(tiny_args(data, tmp_path / "run")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"data.root: {data} is a file" in line
    # Found before any work (recognition/preflight.py): no run directory is made for it.
    assert not (tmp_path / "run").exists()


def test_recordio_without_its_idx_names_the_idx(tmp_path, capsys):
    data = tmp_path / "pack"
    data.mkdir()
    (data / "train.rec").write_bytes(b"\0" * 64)
    assert train.main(tiny_args(data, tmp_path / "run")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert str(data / "train.rec") in line and "no train.idx" in line


def test_identity_folder_with_a_line_break_is_refused_by_name(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    (data / "p1").rename(data / "p\n1")
    assert train.main(tiny_args(data, tmp_path / "run")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "'p\\n1' has a line break" in line
    assert not (tmp_path / "run" / "classes.txt").exists()


# ---- a corrupt image under loader workers ----------------------------------------------------


def test_corrupt_image_in_a_worker_is_one_line(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    bad = data / "p2" / "1.jpg"
    bad.write_bytes(b"not a jpeg")
    assert train.main([*tiny_args(data, tmp_path / "run"), "data.num_workers=2"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {bad}: cannot decode image")
    assert "data.on_bad_image=skip" in line


def test_corrupt_image_under_evaluate_workers_is_its_own_message(tmp_path):
    # evaluate.py prints error_message(exc) of what extraction raises (as train.py does).
    images = make_folder(tmp_path / "images", num_ids=2, num_images=2)
    bad = images / "p0" / "1.jpg"
    bad.write_bytes(b"garbage")
    paths = [f"p{c}/{n}.jpg" for c in range(2) for n in range(2)]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    with pytest.raises(ValueError) as raised:
        extract_embeddings(
            model, PathDataset(paths, size=32, root=images), num_workers=2, progress=False
        )
    assert "Original Traceback" in str(raised.value)  # what torch re-raises
    assert error_message(raised.value) == (
        f"{bad}: cannot decode image (cannot identify image file '{bad}')"
    )


# ---- evaluate.py inputs ----------------------------------------------------------------------


def test_checkpoint_that_is_not_one_gets_no_unsafe_advice(tmp_path, capsys):
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint\n")
    hostile = tmp_path / "hostile.pt"
    torch.save({"state_dict": {}, "hook": print}, hostile)
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t1\na\t1\t2\na\t1\tb\t1\n")
    for path, expected in ((garbage, "not a checkpoint file"), (hostile, "refused")):
        assert evaluate.main(["--checkpoint", str(path), "--pairs", str(pairs)]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert str(path) in line and expected in line
        assert "weights_only" not in line and "trust" not in line


class _RunsCode:
    """A pickle that would run `touch <marker>` when loaded unsafely."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_as_such_everywhere(tmp_path, capsys):
    # Through evaluate.py --checkpoint, train.init_backbone and the export: refused, nothing
    # run, and the line says why (objects other than tensors), not "truncated".
    from recognition.export import main as export_main

    marker = tmp_path / "ran"
    hostile = tmp_path / "backbone.pth"
    torch.save({"conv1.weight": torch.zeros(1), "x": _RunsCode(marker)}, hostile)
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t1\na\t1\t2\na\t1\tb\t1\n")
    data = make_folder(tmp_path / "data")
    runs = {
        "evaluate": lambda: evaluate.main(["--checkpoint", str(hostile), "--pairs", str(pairs)]),
        "init_backbone": lambda: train.main(
            [*tiny_args(data, tmp_path / "run"), f"train.init_backbone={hostile}"]
        ),
        "export": lambda: export_main(
            ["--checkpoint", str(hostile), "--onnx", str(tmp_path / "m.onnx")]
        ),
    }
    for name, run in runs.items():
        assert run() == 1, name
        line = one_error_line(capsys.readouterr().err)
        assert "holds Python objects other than tensors" in line, (name, line)
        assert "posix.system" in line and "truncated" not in line, (name, line)
    assert not marker.exists()


def test_pairs_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    text = "1\t1\nAda\t1\t2\nAda\t1\tBob\t3\n"
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    a, b = load_pairs(plain), load_pairs(marked)
    assert (a.left, a.right, list(a.issame)) == (b.left, b.right, list(b.issame))


def test_latin1_pairs_file_names_file_and_line(tmp_path, capsys):
    pairs = tmp_path / "pairs.txt"
    pairs.write_bytes("1\t1\nJos\xe9\t1\t2\nA\t1\tB\t1\n".encode("latin-1"))
    embeddings = tmp_path / "emb.npz"
    np.savez(embeddings, embeddings=np.eye(2, dtype=np.float32), paths=np.array(["a", "b"]))
    assert evaluate.main(["--embeddings", str(embeddings), "--pairs", str(pairs)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"{pairs}:2: not UTF-8 text" in line


def test_nan_in_an_embeddings_file_names_the_file_and_row(tmp_path, capsys):
    vectors = np.ones((3, 4), dtype=np.float32)
    vectors[1, 2] = np.nan
    embeddings = tmp_path / "emb.npz"
    np.savez(embeddings, embeddings=vectors, paths=np.array(["a/a_0001.jpg", "b", "c"]))
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t1\na\t1\t1\na\t1\tb\t1\n")
    assert evaluate.main(["--embeddings", str(embeddings), "--pairs", str(pairs)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert str(embeddings) in line and "row 1 ('b')" in line


# ---- loader workers die with the main process ------------------------------------------------

PARENT = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from recognition.data.workers import exit_with_parent

class Slow(Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        with open(os.path.join(sys.argv[1], str(os.getpid())), "w"):
            pass
        time.sleep(120)  # a long read (a slow file system): torch's watchdog waits for it
        return i

loader = DataLoader(Slow(), num_workers=2, worker_init_fn=exit_with_parent)
for _ in loader:
    pass
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_loader_workers_go_when_the_main_process_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, str(script), str(pids_dir)], env=env)
    deadline = time.monotonic() + 60
    while len(list(pids_dir.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(p.name) for p in pids_dir.iterdir()]
    assert len(workers) == 2, "the workers did not start"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in workers if _alive(pid)]
        time.sleep(0.05)
    for pid in alive:  # leave nothing behind when the check fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their killed parent by 5 s"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_an_error_a_pipeline_schedule_wraps_is_reported_by_its_cause(monkeypatch, capsys):
    # torch.distributed.pipelining re-raises a stage's exception as the cause of a
    # RuntimeError of its own ("... The above exception was the direct cause").
    import recognition.training as training

    def stage_fails(cfg, **kwargs):
        try:
            raise ValueError("data.root: /x/p2/1.jpg: cannot decode image")
        except ValueError as exc:
            raise RuntimeError("Stage 0 failed in forward_one_chunk") from exc

    monkeypatch.setattr(training, "train", stage_fails)
    assert train.main(["eval.targets=[]"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == "error: data.root: /x/p2/1.jpg: cannot decode image"


# ---- data.decode=gpu: odd and damaged files in a batch ---------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_gpu_with_png_cmyk_and_a_damaged_jpeg(tmp_path, monkeypatch, capsys, workers):
    """The batches decoded by the device path (here on the CPU device: no GPU in CI), with
    PNGs and CMYK JPEGs (the workers decode them) and a JPEG that only the device decoder
    finds damaged (the main process names it): one line, and the checkpoints of the run it
    stopped are as they were."""
    from test_gpu_decode import bogus_huffman, encode, face
    from test_gpu_decode import make_folder as face_folder

    monkeypatch.setattr("recognition.training.build.resolve_decode", lambda *args: "gpu")
    data = face_folder(tmp_path / "faces", identities=4, per=5)
    out = tmp_path / "run"
    args = [
        *folder_overrides(data, out), "model.width=0.25", "model.embedding_size=8",
        "train.batch_size=8", "train.epochs=4", "train.progress=false", "eval.targets=[]",
        "train.checkpoint_every=1", "train.keep_checkpoints=100", f"data.num_workers={workers}",
    ]  # fmt: skip
    for name, image in (("0_png.png", face(50)), ("1_cmyk.jpg", face(51).convert("CMYK"))):
        for identity in ("id0", "id1"):
            (data / identity / name).write_bytes(encode(image, name[-3:].replace("jpg", "JPEG")))
    assert train.main([*args, "train.max_steps=2"]) == 0  # odd files, no damaged one: trains
    kept = {p: p.read_bytes() for p in (out / "checkpoints").glob("step_*/*")}
    assert len(kept) >= 2

    bad = data / "id2" / "9_bogus.jpg"
    bad.write_bytes(bogus_huffman(encode(face(52))))
    assert train.main([*args, "train.resume=true"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {bad}: cannot decode") and "data.on_bad_image=skip" in line
    for path, content in kept.items():
        assert path.read_bytes() == content


def test_one_sample_per_process_with_batch_norm_is_refused(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    out = tmp_path / "run"
    assert train.main([*tiny_args(data, out), "train.batch_size=1"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(
        "error: train.batch_size=1: iresnet18 at model.width=0.125 has BatchNorm"
    )
    assert not (out / "checkpoints").exists()


def test_an_image_size_the_checkpoint_cannot_take_names_the_flag(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    out = tmp_path / "run"
    assert train.main([*tiny_args(data, out), "train.max_steps=1"]) == 0
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t1\np0\t0\t1\np0\t0\tp1\t0\n")
    (data / "p0" / "p0_0000.jpg").write_bytes((data / "p0" / "0.jpg").read_bytes())
    args = ["--checkpoint", str(out / "backbone.pt"), "--pairs", str(pairs)]
    assert evaluate.main([*args, "--images", str(data), "--image-size", "48"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --image-size 48x48: this checkpoint's backbone takes 32x32")
