"""MSMT17 and CUHK03 read from small trees laid out as their releases are (MSMT17 V1 and V2's
list files over train/ and test/; CUHK03's new-protocol split files over the extracted
crops), for training and for evaluation, and the one-line errors for trees that are not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.io import savemat

import evaluate
from recognition import checkpoint as ckpt
from recognition.config import DataConfig
from recognition.data.build import build_train_dataset
from recognition.data.formats import resolve_format
from recognition.data.market_train import PersonCropsDataset
from recognition.data.reid_sets import reid_layout, reid_test_sets, reid_train_set
from recognition.models import build_backbone

MODEL = {"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}


def crop(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, size=(32, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def make_msmt17(root: Path, version: str = "V1") -> dict[str, list[tuple[str, int, int]]]:
    """An MSMT17 release in miniature: 3 training persons (train + val lists), 3 test persons
    (query + gallery lists). Returns each list's (path, person id, camera)."""
    train_dir, test_dir = (
        ("train", "test") if version == "V1" else ("mask_train_v2", "mask_test_v2")
    )
    lists: dict[str, list[tuple[str, int, int]]] = {}
    for name, folder, persons, per, first_cam in [
        ("list_train.txt", train_dir, range(3), 3, 1),
        ("list_val.txt", train_dir, range(3), 1, 9),
        ("list_query.txt", test_dir, range(3), 1, 2),
        ("list_gallery.txt", test_dir, range(3), 3, 5),
    ]:
        entries = []
        for pid in persons:
            for n in range(per):
                cam = first_cam + n
                path = f"{pid:04d}/{pid:04d}_{n:03d}_{cam:02d}_0303morning_{first_cam:04d}_{n}.jpg"
                crop(root / folder / path, seed=len(lists) * 100 + pid * 10 + n)
                entries.append((path, pid, cam))
        (root / name).write_text("".join(f"{p} {pid}\n" for p, pid, _ in entries))
        lists[name] = entries
    return lists


def make_cuhk03(root: Path, boxes: str = "labeled") -> dict[str, list[int]]:
    """A CUHK03 new-protocol tree in miniature: 10 crops of 5 persons, 2 cameras each; a split
    file as MATLAB saves one (cell array of names, column vectors of doubles, 1-based)."""
    names, labels, cams = [], [], []
    for person in range(1, 6):
        for camera in (1, 2):
            name = f"1_{person:03d}_{camera}_01.png"
            crop(root / f"images_{boxes}" / name, seed=10 * person + camera)
            names.append(name)
            labels.append(person)
            cams.append(camera)
    split = {"train_idx": [1, 2, 3, 4], "query_idx": [5, 7], "gallery_idx": [6, 8, 9, 10]}
    content = {
        "filelist": np.array([[n] for n in names], dtype=object),
        "labels": np.array(labels, dtype=np.float64)[:, None],
        "camId": np.array(cams, dtype=np.float64)[:, None],
        **{k: np.array(v, dtype=np.float64)[:, None] for k, v in split.items()},
    }
    savemat(root / f"cuhk03_new_protocol_config_{boxes}.mat", content)
    return split


@pytest.mark.parametrize("version", ["V1", "V2"])
def test_msmt17_for_training_and_evaluation(tmp_path, version):
    root = tmp_path / f"MSMT17_{version}"
    lists = make_msmt17(root, version)
    assert reid_layout(root) == "msmt17"
    assert resolve_format(DataConfig(root=str(root))) == "msmt17"
    source = build_train_dataset(DataConfig(root=str(root), image_size=[32, 16]))
    assert isinstance(source, PersonCropsDataset)
    # list_train.txt then list_val.txt: 3 persons x (3 + 1) crops.
    expected = lists["list_train.txt"] + lists["list_val.txt"]
    assert source.paths == [p for p, _, _ in expected]
    assert source.num_classes == 3 and [source.class_name(c) for c in range(3)] == [
        "0000",
        "0001",
        "0002",
    ]
    assert source.labels.tolist() == [pid for _, pid, _ in expected]
    assert source.camera_ids.tolist() == [cam for _, _, cam in expected]
    assert source[0][0].shape == (3, 32, 16)
    query, gallery = reid_test_sets(root)
    for images, name in ((query, "list_query.txt"), (gallery, "list_gallery.txt")):
        assert images.paths == [p for p, _, _ in lists[name]]
        assert images.person_ids.tolist() == [pid for _, pid, _ in lists[name]]
        assert images.camera_ids.tolist() == [cam for _, _, cam in lists[name]]
        assert images.folder.name == ("test" if version == "V1" else "mask_test_v2")


def test_cuhk03_for_training_and_evaluation(tmp_path):
    root = tmp_path / "cuhk03"
    make_cuhk03(root)
    assert reid_layout(root) == "cuhk03"
    assert resolve_format(DataConfig(root=str(root))) == "cuhk03"
    source = build_train_dataset(DataConfig(root=str(root), image_size=[32, 16]))
    assert source.paths == ["1_001_1_01.png", "1_001_2_01.png", "1_002_1_01.png", "1_002_2_01.png"]
    assert source.labels.tolist() == [0, 0, 1, 1] and source.class_name(1) == "0002"
    query, gallery = reid_test_sets(root)
    assert query.paths == ["1_003_1_01.png", "1_004_1_01.png"]
    assert query.person_ids.tolist() == [3, 4] and query.camera_ids.tolist() == [1, 1]
    assert gallery.person_ids.tolist() == [3, 4, 5, 5]
    assert gallery.camera_ids.tolist() == [2, 2, 1, 2]
    # The detected boxes' split is another file: asked for, its absence is named.
    with pytest.raises(FileNotFoundError, match="cuhk03_new_protocol_config_detected.mat"):
        reid_test_sets(root, cuhk03_boxes="detected")
    with pytest.raises(FileNotFoundError, match="data.cuhk03_boxes=detected"):
        resolve_format(DataConfig(root=str(root), cuhk03_boxes="detected"))
    make_cuhk03(root, "detected")
    assert reid_train_set(root, "cuhk03", cuhk03_boxes="detected").folder.name == "images_detected"


def msmt17_fault(root: Path, what: str) -> None:
    lines = (root / "list_query.txt").read_text().splitlines()
    if what == "three fields":
        lines[1] += " 7"
    elif what == "bad id":
        lines[1] = lines[1].rsplit(" ", 1)[0] + " x1"
    elif what == "missing image":
        lines[1] = "0009/0009_000_01_0303morning_0001_0.jpg 9"
    elif what == "bad name":
        (root / "test" / "0009").mkdir()
        crop(root / "test" / "0009" / "holiday.jpg", 0)
        lines[1] = "0009/holiday.jpg 9"
    (root / "list_query.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "what, message",
    [
        ("three fields", "list_query.txt:2: expected '<image path> <person id>'"),
        ("bad id", "list_query.txt:2: person id 'x1' is not an integer"),
        ("missing image", "list_query.txt:2: no such image"),
        ("bad name", "list_query.txt:2: 0009/holiday.jpg is not an MSMT17 file name"),
    ],
)
def test_msmt17_bad_lines_are_named(tmp_path, what, message):
    make_msmt17(tmp_path)
    msmt17_fault(tmp_path, what)
    with pytest.raises(ValueError, match=message):
        reid_test_sets(tmp_path)


def test_trees_that_are_not_a_release_are_named_in_one_line(tmp_path):
    make_msmt17(tmp_path / "m")
    (tmp_path / "m" / "list_gallery.txt").unlink()
    with pytest.raises(FileNotFoundError, match="not an MSMT17 release: no list_gallery.txt"):
        reid_test_sets(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="data.root: .*no list_gallery.txt"):
        resolve_format(DataConfig(root=str(tmp_path / "m"), format="msmt17"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a re-id data set"):
        reid_test_sets(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not a CUHK03 new-protocol tree"):
        reid_train_set(tmp_path / "empty", "cuhk03")

    root = tmp_path / "c"
    make_cuhk03(root)
    mat = root / "cuhk03_new_protocol_config_labeled.mat"
    savemat(mat, {"filelist": np.array([["a.png"]], dtype=object), "labels": [[1]]})
    with pytest.raises(ValueError, match="labeled.mat: no camId, train_idx, query_idx"):
        reid_test_sets(root)
    make_cuhk03(root)
    (root / "images_labeled" / "1_004_1_01.png").unlink()
    with pytest.raises(FileNotFoundError, match="1 of its 10 crops are not in .*1_004_1_01.png"):
        reid_test_sets(root)
    make_cuhk03(root)
    from scipy.io import loadmat

    content = loadmat(mat)
    content["query_idx"] = np.array([[5], [11]], dtype=np.float64)
    savemat(mat, {k: v for k, v in content.items() if not k.startswith("__")})
    with pytest.raises(ValueError, match="query_idx must hold 1-based indices into the 10"):
        reid_test_sets(root)
    mat.write_bytes(b"not a mat file")
    with pytest.raises(ValueError, match="labeled.mat: not a MATLAB file"):
        reid_test_sets(root)


@pytest.fixture(scope="module")
def backbone_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=(32, 16))
    path = tmp_path_factory.mktemp("model") / "backbone.pt"
    ckpt.export_backbone(path, model, MODEL, [32, 16])
    return path


@pytest.mark.parametrize("kind", ["msmt17", "cuhk03"])
def test_evaluate_ranks_a_release_with_reranking_from_a_model_and_its_embeddings(
    backbone_file, tmp_path, kind
):
    root = tmp_path / kind
    make_msmt17(root) if kind == "msmt17" else make_cuhk03(root)
    emb, out1, out2 = tmp_path / "e.npz", tmp_path / "r1.json", tmp_path / "r2.json"
    rerank = ["--rerank", "--rerank-k1", "3", "--rerank-k2", "2", "--rerank-lambda", "0.5"]
    argv = ["--checkpoint", str(backbone_file), "--reid", str(root), "--workers", "0"]
    assert (
        evaluate.main(argv + rerank + ["--json", str(out1), "--export-embeddings", str(emb)]) == 0
    )
    argv = ["--embeddings", str(emb), "--reid", str(root), "--json", str(out2)]
    assert evaluate.main(argv + rerank) == 0
    a, b = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert a == b
    assert a["rerank"] == {"k1": 3, "k2": 2, "lambda": 0.5}
    assert (a["num_query"], a["num_gallery"]) == ((3, 9) if kind == "msmt17" else (2, 4))
    assert 0 < a["mINP"] <= 1 and 0 < a["mAP"] <= 1
    with np.load(emb) as f:
        first = "test/0000/0000_000_02_0303morning_0002_0.jpg"
        assert (first if kind == "msmt17" else "images_labeled/1_003_1_01.png") in f["paths"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rerank-k1", "5"], "--rerank-k1: only with --rerank"),
        (["--rerank", "--rerank-lambda", "2"], "--rerank-lambda: must lie in [0, 1]"),
        (["--rerank", "--rerank-k2", "0"], "--rerank-k2: must be at least 1"),
    ],
)
def test_rerank_flags_out_of_place_stop_before_any_work(tmp_path, capsys, flags, message):
    out = tmp_path / "r.json"
    argv = ["--checkpoint", str(tmp_path / "missing.pt"), "--reid", str(tmp_path), *flags]
    assert evaluate.main([*argv, "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err and "missing.pt" not in err
    assert not out.exists()
    assert evaluate.main(["--pairs", "p.txt", "--rerank"]) == 1
    assert "use it with --reid" in capsys.readouterr().err
