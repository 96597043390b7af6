"""IJB faults a user meets, in both modes: missing meta files, images and folders, a
--save-features file of another model, size, flip or release, or a damaged one. Each: exit
status 1, one line naming the file (and line), no traceback, nothing already written lost."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli_faults import one_error_line
from test_ijb import SIZE
from test_ijb_search import make_release, write_photo_release

import evaluate
from recognition import checkpoint as ckpt
from recognition.models import build_backbone

MODES = {"11": [], "1n": ["--ijb-mode", "1n"]}


def write_release(root: Path, name: str) -> None:
    """A small release of photo squares (8 subjects, ~60 images); the same image names for
    every ``name``, as the seed is fixed."""
    rng = np.random.default_rng(9)
    write_photo_release(root, name, rng, make_release(rng, name, 8, (2, 4)), quality=90)


def export(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=SIZE)
    ckpt.export_backbone(path, model, {"backbone": "iresnet18", "embedding_size": 8,
                                       "width": 0.125, "dropout": 0.0}, SIZE)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """An IJB-C root, an IJB-B root with the same image names, two checkpoints of other
    weights, and the features file of the first on IJB-C (written by a 1:1 run), with the
    1:N JSON of a run from it."""
    base = tmp_path_factory.mktemp("ijb_faults")
    paths = {"ijbc": base / "IJBC", "ijbb": base / "IJBB"}
    write_release(paths["ijbc"], "ijbc")
    write_release(paths["ijbb"], "ijbb")
    paths["model"], paths["other"] = export(base / "a.pt", 0), export(base / "b.pt", 1)
    paths["cache"] = base / "features.npz"
    argv = ["--ijb", str(paths["ijbc"]), "--ijb-name", "ijbc", "--workers", "0"]
    run = ["--checkpoint", str(paths["model"]), "--save-features", str(paths["cache"])]
    assert evaluate.main(argv + run) == 0
    paths["json"] = base / "1n.json"
    assert evaluate.main(argv + run + MODES["1n"] + ["--json", str(paths["json"])]) == 0
    return paths


def run_fails(argv: list[str], capsys, kept: dict[Path, bytes]) -> str:
    """evaluate.main(argv) exits 1 with one error line (returned); the files `kept` are
    unchanged."""
    assert evaluate.main(argv) == 1
    line = one_error_line(capsys.readouterr().err)
    for path, content in kept.items():
        assert path.read_bytes() == content, path
    return line


def copy_root(made: dict[str, Path], tmp_path: Path, name: str = "ijbc") -> Path:
    root = tmp_path / name.upper()
    shutil.copytree(made[name], root)
    return root


# ------------------------------------------------------------------------------ the release


@pytest.mark.parametrize(
    ("mode", "file"),
    [
        ("11", "face_tid_mid.txt"),
        ("11", "template_pair_label.txt"),
        ("11", "name_5pts_score.txt"),
        ("1n", "face_tid_mid.txt"),
        ("1n", "name_5pts_score.txt"),
        ("1n", "1N_gallery_G1.csv"),
        ("1n", "1N_gallery_G2.csv"),
        ("1n", "1N_probe_mixed.csv"),
    ],
)
def test_missing_meta_file_is_named(made, tmp_path, mode, file, capsys):
    root = copy_root(made, tmp_path)
    missing = root / "meta" / f"ijbc_{file}"
    missing.unlink()
    out = tmp_path / "out.json"
    out.write_text('{"earlier": 1}\n')
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--checkpoint", str(made["model"])]
    line = run_fails(argv + MODES[mode] + ["--json", str(out)], capsys, {out: out.read_bytes()})
    assert line == f"error: IJB meta file not found: {missing}"


def test_the_1n_mode_needs_no_pairs_file(made, tmp_path):
    root = copy_root(made, tmp_path)
    (root / "meta" / "ijbc_template_pair_label.txt").unlink()
    out = tmp_path / "out.json"
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--save-features", str(made["cache"])]
    assert evaluate.main(argv + MODES["1n"] + ["--json", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(made["json"].read_text())


@pytest.mark.parametrize("mode", list(MODES))
def test_missing_image_and_missing_image_folder_are_named(made, tmp_path, mode, capsys):
    root = copy_root(made, tmp_path)
    faces = root / "meta" / "ijbc_face_tid_mid.txt"
    number, line = 4, faces.read_text().splitlines()[3]
    image = root / "loose_crop" / line.split()[0]
    image.unlink()
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--checkpoint", str(made["model"])]
    error = run_fails(argv + MODES[mode], capsys, {})
    assert error == f"error: {faces}:{number}: image not found: {image}"
    shutil.rmtree(root / "loose_crop")
    error = run_fails(argv + MODES[mode], capsys, {})
    assert error == f"error: IJB image folder not found: {root / 'loose_crop'}"


# ------------------------------------------------------------------------------ the features


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (["--checkpoint", "{other}"], "features made by another model (checkpoint {model})"),
        (
            ["--checkpoint", "{model}", "--image-size", "48"],
            "image_size = '32x32', this run has '48x48'",
        ),  # noqa: E501
        (["--checkpoint", "{model}", "--no-flip"], "flip = 'True', this run has 'False'"),
        (["--no-flip"], "flip = 'True', this run has 'False'"),
        (["--release", "ijbb"], "release = 'ijbc', this run has 'ijbb'"),
    ],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_features_of_another_run_are_refused(made, tmp_path, mode, change, expected, capsys):
    cache, out = made["cache"], tmp_path / "out.json"
    out.write_text('{"earlier": 1}\n')
    name = change[1] if change[0] == "--release" else "ijbc"
    argv = ["--ijb", str(made[name]), "--ijb-name", name, "--save-features", str(cache)]
    if change[0] != "--release":
        argv += [a.format(other=made["other"], model=made["model"]) for a in change]
    kept = {cache: cache.read_bytes(), out: out.read_bytes()}
    line = run_fails(argv + MODES[mode] + ["--json", str(out)], capsys, kept)
    assert line.startswith(f"error: {cache}: ") and expected.format(**made) in line, line
    assert line.endswith("remove the file or name another --save-features")


def test_the_same_weights_in_another_file_reuse_the_features(made, tmp_path):
    copy = tmp_path / "copy.pt"
    shutil.copy(made["model"], copy)
    out = tmp_path / "out.json"
    argv = ["--ijb", str(made["ijbc"]), "--ijb-name", "ijbc", "--checkpoint", str(copy)]
    argv += ["--save-features", str(made["cache"]), "--json", str(out), "--device", "cpu"]
    before = made["cache"].stat().st_mtime_ns
    assert evaluate.main(argv + MODES["1n"]) == 0
    assert json.loads(out.read_text()) == json.loads(made["json"].read_text())
    assert made["cache"].stat().st_mtime_ns == before


@pytest.mark.parametrize("damage", ["truncated", "bad member", "folder", "not npz"])
@pytest.mark.parametrize("mode", list(MODES))
def test_damaged_features_file_is_named_and_kept(made, tmp_path, mode, damage, capsys):
    cache = tmp_path / "features.npz"
    content = made["cache"].read_bytes()
    if damage == "truncated":
        cache.write_bytes(content[: len(content) // 2])
    elif damage == "bad member":  # the zip's directory intact, a stored array's bytes not
        middle = len(content) // 2
        cache.write_bytes(content[:middle] + bytes(b ^ 0xFF for b in content[middle:][:64])
                          + content[middle + 64 :])  # fmt: skip
    elif damage == "folder":
        cache.mkdir()
    else:
        cache.write_text("features\n")
    out = tmp_path / "out.json"
    out.write_text('{"earlier": 1}\n')
    kept = {out: out.read_bytes()}
    if cache.is_file():
        kept[cache] = cache.read_bytes()
    argv = ["--ijb", str(made["ijbc"]), "--ijb-name", "ijbc", "--save-features", str(cache)]
    argv += ["--checkpoint", str(made["model"]), "--json", str(out)]
    line = run_fails(argv + MODES[mode], capsys, kept)
    assert line.startswith(f"error: {cache}: ") or line.startswith(
        f"error: --save-features: {cache} "
    )
    expected = {
        "truncated": "not a readable features file (.npz): File is not a zip file",
        "bad member": "cannot read its arrays: Bad CRC-32",
        "folder": "exists and is not a file",
        "not npz": "not a features file (.npz): not a zip archive",
    }[damage]
    assert expected in line, line


def test_features_at_another_size_than_the_checkpoints_are_refused(made, tmp_path, capsys):
    # The file of a run with --image-size 48 (of a backbone that takes other sizes; this
    # IResNet's does not, so the setting is written here).
    cache = tmp_path / "features48.npz"
    with np.load(made["cache"]) as data:
        arrays = dict(data) | {"setting_image_size": np.asarray("48x48")}
    np.savez(cache, **arrays)
    argv = ["--ijb", str(made["ijbc"]), "--ijb-name", "ijbc", "--save-features", str(cache)]
    # No --image-size: the checkpoint's own (32) is this run's size.
    line = run_fails(argv + ["--checkpoint", str(made["model"])], capsys, {})
    assert f"{cache}: features made with image_size = '48x48', this run has '32x32'" in line
    assert evaluate.main(argv) == 0  # without a model, the size is not known: accepted


@pytest.mark.parametrize(
    ("mode", "file", "number"),
    [
        ("1n", "1N_probe_mixed.csv", 3),
        ("11", "face_tid_mid.txt", 61),
        ("1n", "face_tid_mid.txt", 2),
    ],
)
def test_meta_file_that_is_not_utf8_names_file_and_line(made, tmp_path, mode, file, number, capsys):
    root = copy_root(made, tmp_path)
    path = root / "meta" / f"ijbc_{file}"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[number - 1] = lines[number - 1].replace(b".jpg", ".jp\xe9".encode("latin-1"), 1)
    path.write_bytes(b"".join(lines))
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--checkpoint", str(made["model"])]
    line = run_fails(argv + MODES[mode], capsys, {})
    assert (
        line == f"error: {path}:{number}: not UTF-8 text (byte 0xe9); save the meta file as UTF-8"
    )


@pytest.mark.parametrize("flag", ["--roc", "--json"])
def test_1n_outputs_that_cannot_be_written_stop_before_extraction(made, tmp_path, flag, capsys):
    argv = ["--ijb", str(made["ijbc"]), "--ijb-name", "ijbc", "--checkpoint", str(made["model"])]
    if flag == "--roc":
        line = run_fails(argv + MODES["1n"] + ["--roc", str(tmp_path / "roc.png")], capsys, {})
        assert line == "error: --roc: the 1:1 mode's curve; --ijb-mode 1n has none"
    else:
        line = run_fails(argv + MODES["1n"] + ["--json", str(tmp_path)], capsys, {})
        assert line == f"error: --json: {tmp_path} is a folder"
