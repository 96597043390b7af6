"""evaluate.py's inputs beyond pairs files: .bin sets, re-id folders, image-folder export."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import evaluate
from recognition import checkpoint as ckpt
from recognition.checkpoint import load_backbone
from recognition.models import build_backbone

MODEL = {"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}


@pytest.fixture(scope="module")
def backbone_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, dropout=0.0, image_size=32)
    path = tmp_path_factory.mktemp("model") / "backbone.pt"
    ckpt.export_backbone(path, model, MODEL, 32)
    return path


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def lfw_and_bin(root: Path) -> tuple[Path, Path]:
    """The same 20 pairs as an LFW folder with a 10-fold pairs.txt and as a .bin."""
    rng = np.random.default_rng(3)
    faces = {
        (f"p{c}", n): rng.integers(0, 255, size=(40, 40, 3), dtype=np.uint8)
        for c in range(6)
        for n in (1, 2)
    }
    for (name, n), pixels in faces.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / name / f"{name}_{n:04d}.png")
    lines, bins, issame = ["10\t1"], [], []
    for fold in range(10):
        a, b = fold % 6, (fold + 1) % 6
        lines.append(f"p{a}\t1\t2")
        lines.append(f"p{a}\t1\tp{b}\t2")
        bins += [png(faces[(f"p{a}", 1)]), png(faces[(f"p{a}", 2)])]
        bins += [png(faces[(f"p{a}", 1)]), png(faces[(f"p{b}", 2)])]
        issame += [True, False]
    (root / "pairs.txt").write_text("\n".join(lines) + "\n")
    bin_path = root.parent / "set.bin"
    bin_path.write_bytes(pickle.dumps((bins, issame), protocol=4))
    return root / "pairs.txt", bin_path


def test_bin_gives_the_numbers_of_the_same_pairs_as_files(backbone_file, tmp_path, capsys):
    pairs, bin_path = lfw_and_bin(tmp_path / "lfw")
    common = ["--checkpoint", str(backbone_file), "--workers", "0", "--crop", "36", "--xnorm"]
    assert evaluate.main(common + ["--pairs", str(pairs), "--json", str(tmp_path / "a.json")]) == 0
    assert evaluate.main(common + ["--bin", str(bin_path), "--json", str(tmp_path / "b.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["num_pairs"] == 20
    # (XNorm differs: the pairs embed each distinct image once, the .bin all 40 copies.)
    for key in ("accuracy", "accuracy_std", "auc", "eer", "threshold"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert b["tar_at_far"] == pytest.approx(a["tar_at_far"], abs=1e-6)

    # XNorm is the mean raw-embedding norm of the cropped, resized images: recompute it.
    model, _ = load_backbone(backbone_file, torch.device("cpu"))
    from recognition.data.insightface_bin import BinDataset, load_bin

    images = torch.stack(list(BinDataset(load_bin(bin_path), size=32, crop=36)))
    with torch.no_grad():
        norms = model(images).double().norm(dim=1)
    assert b["xnorm"] == pytest.approx(float(norms.mean()), rel=1e-5)

    # Two targets in one run: one table with a row each, JSON keyed by target.
    capsys.readouterr()
    argv = common + [
        "--pairs",
        str(pairs),
        "--bin",
        str(bin_path),
        "--json",
        str(tmp_path / "c.json"),
    ]
    assert evaluate.main(argv) == 0
    table = capsys.readouterr().out
    assert table.count("\n") >= 3 and "lfw" in table and "set" in table and "XNorm" in table
    assert set(json.loads((tmp_path / "c.json").read_text())) == {"lfw", "set"}


def test_malicious_bin_is_refused_by_evaluate(backbone_file, tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {tmp_path / 'ran'}",))

    path = tmp_path / "lfw.bin"
    path.write_bytes(pickle.dumps(([b"x", Evil()], [True])))
    out = tmp_path / "out.json"
    assert (
        evaluate.main(["--checkpoint", str(backbone_file), "--bin", str(path), "--json", str(out)])
        == 1
    )
    err = capsys.readouterr().err
    assert str(path) in err and "refusing" in err
    assert not (tmp_path / "ran").exists() and not out.exists()


def market(root: Path) -> Path:
    rng = np.random.default_rng(5)
    names = {
        "query": ["0001_c1s1_000001_00.jpg", "0002_c2s1_000001_00.jpg"],
        "bounding_box_test": [
            "0001_c1s1_000002_01.jpg",  # same camera as the query: removed
            "0001_c3s1_000002_01.jpg",
            "0002_c1s1_000003_01.jpg",
            "0000_c4s1_000004_01.jpg",  # distractor
            "-1_c5s1_000005_01.jpg",  # junk
            "0003_c2s1_000006_01.jpg",
        ],
    }
    for folder, files in names.items():
        (root / folder).mkdir(parents=True)
        for name in files:
            pixels = rng.integers(0, 255, size=(48, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / folder / name)
    return root


def test_reid_from_model_and_from_its_exported_embeddings(backbone_file, tmp_path):
    root = market(tmp_path / "market")
    emb, out1, out2 = tmp_path / "e.npz", tmp_path / "r1.json", tmp_path / "r2.json"
    argv = ["--checkpoint", str(backbone_file), "--reid", str(root), "--workers", "0"]
    assert evaluate.main(argv + ["--json", str(out1), "--export-embeddings", str(emb)]) == 0
    with np.load(emb) as f:
        assert f["embeddings"].shape == (8, 8)
        assert "query/0001_c1s1_000001_00.jpg" in f["paths"].tolist()
    assert evaluate.main(["--embeddings", str(emb), "--reid", "--json", str(out2)]) == 0
    a, b = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert a == b
    assert a["num_query"] == 2 and a["num_gallery"] == 6 and a["num_skipped"] == 0
    for key in ("mAP", "rank1", "rank5", "rank10", "cmc"):
        assert key in a
    assert a["rank5"] == 1.0  # 4 kept crops per query at most: every match is within 5


def test_reid_bad_name_is_named(backbone_file, tmp_path, capsys):
    root = market(tmp_path / "market")
    Image.new("RGB", (8, 8)).save(root / "query" / "holiday.jpg")
    assert evaluate.main(["--checkpoint", str(backbone_file), "--reid", str(root)]) == 1
    assert "holiday.jpg" in capsys.readouterr().err


def test_export_embeddings_of_an_image_folder(backbone_file, tmp_path):
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("a/x.jpg", "a/y.png", "z.jpg"):
        Image.fromarray(rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)).save(root / name)
    (root / "notes.txt").write_text("not an image")
    out = tmp_path / "emb.npz"
    argv = ["--checkpoint", str(backbone_file), "--images", str(root), "--workers", "0"]
    assert evaluate.main(argv + ["--export-embeddings", str(out), "--no-flip"]) == 0
    with np.load(out) as f:
        assert f["paths"].tolist() == ["a/x.jpg", "a/y.png", "z.jpg"]
        embeddings = f["embeddings"]
    # Independent: the model on each image, no flip, L2-normalised.
    model, _ = load_backbone(backbone_file, torch.device("cpu"))
    for row, name in zip(embeddings, ["a/x.jpg", "a/y.png", "z.jpg"], strict=True):
        pixels = np.asarray(Image.open(root / name).convert("RGB"), dtype=np.float32)
        x = torch.from_numpy(pixels / 127.5 - 1.0).permute(2, 0, 1)[None]
        with torch.no_grad():
            e = model(x)[0].double()
        np.testing.assert_allclose(row, (e / e.norm()).numpy(), atol=1e-5)


def test_empty_pairs_file_is_named_and_earlier_output_kept(backbone_file, tmp_path, capsys):
    (tmp_path / "pairs.txt").write_text("\n\n")
    out = tmp_path / "out.json"
    out.write_text('{"earlier": true}\n')
    argv = ["--checkpoint", str(backbone_file), "--pairs", str(tmp_path / "pairs.txt")]
    assert evaluate.main(argv + ["--json", str(out)]) == 1
    assert f"{tmp_path / 'pairs.txt'}: empty pairs file" in capsys.readouterr().err
    assert out.read_text() == '{"earlier": true}\n'


def test_path_dataset_crops_the_centre_before_resizing(tmp_path):
    from recognition.data.transforms import to_input_tensor
    from recognition.evaluation.embeddings import PathDataset

    pixels = np.random.default_rng(0).integers(0, 255, size=(50, 50, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    item = PathDataset(["a.png"], size=16, root=tmp_path, crop=30)[0]
    expected = to_input_tensor(Image.fromarray(pixels[10:40, 10:40]), (16, 16))
    torch.testing.assert_close(item, expected, rtol=0, atol=0)
    uncropped = PathDataset(["a.png"], size=16, root=tmp_path)[0]
    assert not torch.equal(item, uncropped)


def test_reid_at_the_height_width_of_the_export(tmp_path, capsys):
    from recognition.data.transforms import to_input_tensor

    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=(32, 16))
    ckpt.export_backbone(tmp_path / "backbone.pt", model, MODEL, [32, 16])
    root = market(tmp_path / "market")
    emb = tmp_path / "e.npz"
    argv = ["--checkpoint", str(tmp_path / "backbone.pt"), "--reid", str(root), "--workers", "0"]
    # The 48x24 crops are resized to 32x16 (the IResNet refuses any other size).
    assert evaluate.main(argv + ["--no-flip", "--export-embeddings", str(emb)]) == 0
    with np.load(emb) as f:
        paths, embeddings = f["paths"].tolist(), f["embeddings"]
    name = "query/0001_c1s1_000001_00.jpg"
    x = to_input_tensor(Image.open(root / name).convert("RGB"), (32, 16))
    with torch.no_grad():
        e = model.eval()(x[None])[0].double()
    np.testing.assert_allclose(embeddings[paths.index(name)], (e / e.norm()).numpy(), atol=1e-5)

    # --image-size takes N or HxW; a square size does not fit this backbone.
    assert evaluate.main(argv + ["--image-size", "32x16"]) == 0
    assert evaluate.main(argv + ["--image-size", "32"]) == 1
    assert evaluate.main(argv + ["--image-size", "big"]) == 1
    assert "--image-size: expected N or HxW" in capsys.readouterr().err


# ---- every flag checked, every target kind honoured (issue 39) --------------------------


def test_reid_and_pairs_together_give_both_results(backbone_file, tmp_path, capsys):
    # --reid used to drop --pairs and --bin silently; each kind is now a protocol of its own.
    root = market(tmp_path / "market")
    pairs, bin_path = lfw_and_bin(tmp_path / "lfw")
    argv = ["--checkpoint", str(backbone_file), "--workers", "0", "--reid", str(root)]
    out = tmp_path / "all.json"
    targets = ["--pairs", str(pairs), "--bin", str(bin_path)]
    assert evaluate.main([*argv, *targets, "--json", str(out)]) == 0
    both = json.loads(out.read_text())
    assert sorted(both) == ["lfw", "market", "set"]
    alone = tmp_path / "alone.json"
    assert evaluate.main([*argv, "--json", str(alone)]) == 0
    assert both["market"] == json.loads(alone.read_text())
    table = capsys.readouterr().out
    assert "mAP %" in table and "accuracy %" in table


def test_every_flag_problem_is_said_at_once_before_any_work(tmp_path, capsys):
    argv = ["--checkpoint", str(tmp_path / "never-read.pt"), "--pairs", "p.txt"]
    argv += ["--image-size", "big", "--batch-size", "0", "--ijb-name", "ijbc"]
    argv += ["--json", str(tmp_path)]
    assert evaluate.main(argv) == 1
    lines = capsys.readouterr().err.splitlines()
    named = sorted(line.split(": ")[1] for line in lines)
    assert named == ["--batch-size", "--ijb-name", "--image-size", "--json"], lines


def test_embeddings_take_no_model_flags(tmp_path, capsys):
    emb = tmp_path / "e.npz"
    argv = ["--embeddings", str(emb), "--bin", "x.bin", "--image-size", "32"]
    assert evaluate.main(argv) == 1
    err = capsys.readouterr().err
    assert "--embeddings: a bin target needs a model" in err and "--image-size:" in err
