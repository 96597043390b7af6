"""IJB-B/C template verification: meta files, alignment, pooling, scores, metrics, evaluate.py."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score, roc_curve

import evaluate
from recognition import checkpoint as ckpt
from recognition.config import load_config
from recognition.data.alignment import (
    ARCFACE_TEMPLATE,
    align_face,
    estimate_similarity,
    template_points,
    warp_affine,
)
from recognition.data.synthetic import draw_face
from recognition.evaluation import ijb
from recognition.models import build_backbone
from recognition.training import train

FACE = 48  # side of a drawn face
LOOSE = 64  # side of a loose crop
SIZE = 32  # the model's input


def loose_crop(
    face: Image.Image, landmarks: np.ndarray, rng: np.random.Generator
) -> tuple[Image.Image, np.ndarray]:
    """``face`` rotated, scaled and shifted onto a noisy background; its moved landmarks."""
    angle = math.radians(rng.uniform(-25, 25))
    scale = rng.uniform(0.75, 1.0)
    c, s = math.cos(angle) * scale, math.sin(angle) * scale
    matrix = np.array([[c, -s, 0.0], [s, c, 0.0]])
    centre = np.full(2, FACE / 2 - 0.5)
    matrix[:, 2] = np.full(2, LOOSE / 2 - 0.5) + rng.uniform(-4, 4, size=2) - matrix[:, :2] @ centre
    background = rng.integers(0, 256, size=3) + rng.normal(0, 20, size=(LOOSE, LOOSE, 3))
    canvas = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8))
    layer = warp_affine(face, matrix, (LOOSE, LOOSE))
    canvas.paste(layer, (0, 0), layer)
    # Lighting: per-channel gain and offset, which raw pixels (an untrained net) follow.
    pixels = np.asarray(canvas, np.float64) * rng.uniform(0.5, 1.5, size=3) + rng.uniform(-40, 40)
    canvas = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return canvas, landmarks @ matrix[:, :2].T + matrix[:, 2]


def write_ijb(root: Path, name: str, num_ids: int = 16, templates_per_id: int = 4) -> dict:
    """An IJB layout of synthetic faces: every template pair is listed (2,016 by default).

    Template t shows identity t // templates_per_id; it holds one or two media of one or two
    images. Returns {template id: [(media id, [image names])]}.
    """
    rng = np.random.default_rng(7)
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    faces, points, templates = [], [], {}
    for t in range(num_ids * templates_per_id):
        face, landmarks = draw_face(0, t // templates_per_id, FACE)
        template_id = 100 + 3 * t  # ids need not be contiguous
        templates[template_id] = []
        for m in range(int(rng.integers(1, 3))):
            media_id = 5000 + 10 * t + m
            names = []
            for _ in range(int(rng.integers(1, 3))):
                image, moved = loose_crop(face, landmarks, rng)
                file_name = f"{len(faces) + 1}.jpg"
                image.save(root / "loose_crop" / file_name, quality=95)
                faces.append(f"{file_name} {template_id} {media_id}")
                score = rng.uniform(0.5, 1.0)
                points.append(f"{file_name} " + " ".join(f"{v:.3f}" for v in moved.ravel()))
                points[-1] += f" {score:.4f}"
                names.append(file_name)
            templates[template_id].append((media_id, names))
    ids = list(templates)
    pairs = [
        f"{a} {b} {int((a - 100) // 3 // templates_per_id == (b - 100) // 3 // templates_per_id)}"
        for i, a in enumerate(ids)
        for b in ids[i + 1 :]
    ]
    (root / "meta" / f"{name}_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (root / "meta" / f"{name}_name_5pts_score.txt").write_text("\n".join(points) + "\n")
    (root / "meta" / f"{name}_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
    return templates


@pytest.fixture(scope="module")
def ijbc(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("IJBC")
    write_ijb(root, "ijbc")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A backbone trained for a few seconds on aligned faces of 32 other identities."""
    root = tmp_path_factory.mktemp("faces")
    rng = np.random.default_rng(1)
    for i in range(32):
        face, landmarks = draw_face(0, 1000 + i, FACE)
        folder = root / "train" / f"id{i:03d}"
        folder.mkdir(parents=True)
        for n in range(8):
            image, moved = loose_crop(face, landmarks, rng)
            align_face(image, moved, SIZE).save(folder / f"{n}.png")
    overrides = [
        f"output_dir={root / 'run'}",
        f"data.root={root / 'train'}",
        "data.synthetic.enabled=false",
        f"data.image_size={SIZE}",
        "data.num_workers=0",
        "model.width=0.125",
        "model.embedding_size=16",
        "train.batch_size=16",
        "train.epochs=100",
        "train.max_steps=40",
        "train.progress=false",
        "eval.targets=[]",
        "eval.at_end=false",
    ]
    torch.manual_seed(0)
    train(load_config("default", overrides))
    return root / "run" / "backbone.pt"


# ------------------------------------------------------------------------------ alignment


def test_similarity_estimate_is_the_least_squares_fit():
    rng = np.random.default_rng(0)
    source = rng.uniform(0, 100, size=(5, 2))
    target = ARCFACE_TEMPLATE + rng.normal(0, 2, size=(5, 2))
    matrix = estimate_similarity(source, target)
    # Reference: the 4-parameter linear least squares x' = a x - b y + tx, y' = b x + a y + ty.
    rows = []
    for x, y in source:
        rows += [[x, -y, 1, 0], [y, x, 0, 1]]
    (a, b, tx, ty), *_ = np.linalg.lstsq(np.array(rows), target.ravel(), rcond=None)
    np.testing.assert_allclose(matrix, [[a, -b, tx], [b, a, ty]], atol=1e-9)
    # Mirrored points get the best rotation, never a reflection.
    mirrored = estimate_similarity(source * [-1, 1], target)
    assert np.linalg.det(mirrored[:, :2]) > 0
    with pytest.raises(ValueError, match="coincide"):
        estimate_similarity(np.ones((5, 2)), target)


@pytest.mark.parametrize("size", [112, 48])
def test_alignment_puts_the_landmarks_on_the_template(size):
    # Bright Gaussian dots drawn at known sub-pixel points of a rotated, scaled face; after
    # alignment each dot's centroid must sit on its template point.
    rng = np.random.default_rng(size)
    angle, scale = rng.uniform(-0.6, 0.6), rng.uniform(0.5, 1.6)
    rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    points = (ARCFACE_TEMPLATE - 56) @ rotation.T * scale + rng.uniform(70, 90, size=2)
    yy, xx = np.mgrid[0:160, 0:160].astype(np.float64)
    sigma = 1.5 * scale
    dots = sum(np.exp(-((xx - x) ** 2 + (yy - y) ** 2) / (2 * sigma**2)) for x, y in points)
    grey = np.clip(np.rint(dots * 255), 0, 255).astype(np.uint8)
    image = Image.fromarray(np.repeat(grey[..., None], 3, axis=2))

    aligned = np.asarray(align_face(image, points, size), dtype=np.float64)[..., 0]
    assert aligned.shape == (size, size)
    oy, ox = np.mgrid[0:size, 0:size]
    radius = 7 * size / 112
    for x, y in template_points(size):
        weight = aligned * (((ox - x) ** 2 + (oy - y) ** 2) < radius**2)
        centroid = np.array([(weight * ox).sum(), (weight * oy).sum()]) / weight.sum()
        # The issue asks for 0.5 px; a half-pixel convention error would show at 0.1.
        assert np.abs(centroid - [x, y]).max() < 0.1, (centroid, (x, y))
    with pytest.raises(ValueError, match="square"):
        template_points((64, 32))


# ------------------------------------------------------------------------------ pooling


def test_template_pooling_equals_a_hand_written_reference(ijbc):
    protocol = ijb.load_protocol(ijbc, "ijbc")
    rng = np.random.default_rng(3)
    features = rng.normal(size=(len(protocol.images), 6)).astype(np.float32)
    readable = np.ones(len(protocol.images), bool)
    readable[[0, 5]] = False  # two images could not be decoded
    for weighted in (False, True):
        ids, unit = ijb.template_features(features, readable, protocol, score_weight=weighted)
        # Reference: plain loops, float64.
        media = defaultdict(list)
        for k, image in enumerate(protocol.face_image):
            if not readable[image]:
                continue
            f = features[image].astype(np.float64)
            if weighted:
                f = f * float(protocol.detector_scores[image])
            media[(protocol.face_template[k], protocol.face_media[k])].append(f)
        expected = defaultdict(lambda: np.zeros(6))
        for (template, _), rows in media.items():
            expected[template] = expected[template] + np.mean(rows, axis=0)
        assert set(ids.tolist()) == set(protocol.face_template.tolist())
        for template, row in zip(ids, unit, strict=True):
            e = expected[template]
            norm = np.linalg.norm(e)
            np.testing.assert_allclose(row, e / norm if norm > 0 else e, atol=1e-6)


# ------------------------------------------------------------------------------ scores


def test_pair_scores_equal_float64_dot_products():
    rng = np.random.default_rng(4)
    features = rng.normal(size=(700, 32)).astype(np.float32)
    left, right = rng.integers(0, 700, size=(2, 20_000))
    expected = np.einsum(
        "pd,pd->p", features[left].astype(np.float64), features[right].astype(np.float64)
    )
    for threads in (1, 3):
        scores = ijb.score_pairs(features, left, right, chunk_size=512, num_threads=threads)
        np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        ijb.score_pairs(features, left, right + 700)


def reference_tar(scores: np.ndarray, issame: np.ndarray, far: float) -> float | None:
    """TAR at FAR from scikit-learn's ROC: the best TPR whose accepted impostors number at
    most floor(FAR x impostors); None when that is zero (the project's rule)."""
    num_impostor = int((~issame).sum())
    allowed = math.floor(far * num_impostor + 1e-9)
    if allowed < 1:
        return None
    fpr, tpr, _ = roc_curve(issame, scores, drop_intermediate=False)
    return float(tpr[np.rint(fpr * num_impostor) <= allowed].max())


def test_metrics_equal_scikit_learn_on_the_same_scores():
    rng = np.random.default_rng(5)
    issame = rng.random(60_000) < 0.02
    # Rounded scores: ties between and within the classes, where off-by-one errors live.
    scores = np.round(rng.normal(size=len(issame)) * 0.2 + issame * 0.5, 2).astype(np.float32)
    metrics = ijb.roc_metrics(scores, issame)
    assert metrics["auc"] == pytest.approx(roc_auc_score(issame, scores), abs=1e-12)
    fpr, tpr = metrics["_roc"]
    assert np.trapezoid(tpr, fpr) == pytest.approx(metrics["auc"], abs=1e-12)
    for far in (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
        expected = reference_tar(scores, issame, far)
        got = metrics["tar_at_far"][ijb.far_key(far)]
        assert (got is None) == (expected is None), far
        if expected is not None:
            assert got == pytest.approx(expected, abs=1e-12), far
    assert metrics["tar_at_far"]["1e-5"] is None  # 58,800 impostors < 1e5
    assert len(metrics["roc"]["far"]) == len(metrics["roc"]["tar"]) == ijb.ROC_POINTS


# ------------------------------------------------------------------------------ meta files


def replace_line(path: Path, line: int, text: str) -> None:
    """Line ``line`` (1-based) of the text file ``path`` replaced by ``text``."""
    lines = path.read_text().splitlines()
    lines[line - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("file", "line", "bad", "message"),
    [
        ("face_tid_mid", 3, "3.jpg 12", "expected 3 fields"),
        ("face_tid_mid", 2, "2.jpg x 5000", "template id must be an integer"),
        ("face_tid_mid", 2, "../2.jpg 100 5000", "inside loose_crop"),
        ("template_pair_label", 4, "100 103 2", "label must be 0 or 1"),
        ("template_pair_label", 1, "100 -103 1", "template 2 must be >= 0"),
        ("name_5pts_score", 2, "2.jpg 1 2 3 4 5 6 7 8 9 ten 0.9", "must be numbers"),
        ("name_5pts_score", 5, "5.jpg 1 2 3 4 5 6 7 8 9 nan 0.9", "finite"),
        ("name_5pts_score", 1, "1.jpg 1 2 3 4 5 6 7 8 9 10", "expected 12 fields"),
        ("name_5pts_score", 3, "3.jpg 4 4 4 4 4 4 4 4 4 4 0.9", "coincide"),
        ("name_5pts_score", 3, "3.jpg 1 2 3 4 5 6 7 8 9 10 -1", "score must be >= 0"),
    ],
)
def test_malformed_meta_line_names_file_and_line(tmp_path, file, line, bad, message, capsys):
    root = tmp_path / "IJBC"
    write_ijb(root, "ijbc", num_ids=2, templates_per_id=2)
    path = root / "meta" / f"ijbc_{file}.txt"
    replace_line(path, line, bad)
    with pytest.raises(ValueError, match=message) as error:
        ijb.load_protocol(root, "ijbc")
    assert f"{path}:{line}:" in str(error.value)
    # The same through evaluate.py: exit 1, the location on stderr, no JSON written.
    out = tmp_path / "out.json"
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--checkpoint", "x.pt", "--json", str(out)]
    assert evaluate.main(argv) == 1
    assert f"{path}:{line}:" in capsys.readouterr().err and not out.exists()


def test_missing_image_and_missing_landmarks_are_named(tmp_path, capsys):
    root = tmp_path / "IJBB"
    write_ijb(root, "ijbb", num_ids=2, templates_per_id=2)
    faces = root / "meta" / "ijbb_face_tid_mid.txt"
    (root / "loose_crop" / "3.jpg").unlink()
    argv = ["--ijb", str(root), "--ijb-name", "ijbb", "--checkpoint", "x.pt"]
    assert evaluate.main(argv) == 1
    err = capsys.readouterr().err
    assert f"{faces}:3:" in err and str(root / "loose_crop" / "3.jpg") in err
    landmarks = root / "meta" / "ijbb_name_5pts_score.txt"
    landmarks.write_text("".join(landmarks.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(ValueError, match=f"{faces}:1: image '1.jpg' has no line in"):
        ijb.load_protocol(root, "ijbb", check_images=False)
    (root / "meta" / "ijbb_template_pair_label.txt").unlink()
    with pytest.raises(FileNotFoundError, match="ijbb_template_pair_label.txt"):
        ijb.load_protocol(root, "ijbb")


# ------------------------------------------------------------------------------ end to end


def test_trained_model_separates_genuine_and_impostor_pairs(ijbc, trained, tmp_path, capsys):
    out, roc, cache = tmp_path / "ijbc.json", tmp_path / "roc.png", tmp_path / "feats.npz"
    argv = ["--ijb", str(ijbc), "--ijb-name", "ijbc", "--workers", "0", "--json", str(out)]
    assert evaluate.main(argv + ["--checkpoint", str(trained), "--roc", str(roc),
                                 "--save-features", str(cache)]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "TAR%@1e-3" in table and "ijbc" in table
    result = json.loads(out.read_text())
    assert result["num_pairs"] == 2016 and result["num_genuine"] == 16 * 6
    assert result["num_templates"] == 64 and result["num_templates_without_feature"] == 0
    assert result["tar_at_far"]["1e-6"] is None and result["tar_at_far"]["1e-3"] is not None
    assert roc.stat().st_size > 0 and cache.is_file()

    # An untrained backbone of the same shape is the bar the trained one must clear.
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=16, width=0.125, image_size=SIZE)
    untrained = tmp_path / "untrained.pt"
    ckpt.export_backbone(untrained, model, {"backbone": "iresnet18", "embedding_size": 16,
                                            "width": 0.125, "dropout": 0.0}, SIZE)  # fmt: skip
    base = tmp_path / "base.json"
    assert evaluate.main(argv[:-1] + [str(base), "--checkpoint", str(untrained)]) == 0
    baseline = json.loads(base.read_text())
    # (Measured: AUC 0.94 against 0.80, TAR@1e-2 60 % against 25 %.)
    assert result["auc"] > 0.9 and result["auc"] > baseline["auc"] + 0.08, (result, baseline)
    assert result["tar_at_far"]["1e-2"] > baseline["tar_at_far"]["1e-2"] + 0.2

    # Second run from the cached features: no model (the checkpoint is gone), same numbers.
    moved = trained.with_name("moved.pt")
    trained.rename(moved)
    try:
        again = tmp_path / "again.json"
        assert evaluate.main(argv[:-1] + [str(again), "--save-features", str(cache)]) == 0
        assert json.loads(again.read_text()) == result
        # Features of another checkpoint are refused, naming the file.
        assert evaluate.main(argv + ["--checkpoint", str(untrained),
                                     "--save-features", str(cache)]) == 1  # fmt: skip
        assert str(cache) in capsys.readouterr().err
    finally:
        moved.rename(trained)


def test_unreadable_images_and_empty_templates_are_counted(ijbc, tmp_path, caplog):
    root = tmp_path / "IJBC"
    root.mkdir()
    (root / "meta").symlink_to(ijbc / "meta")
    (root / "loose_crop").mkdir()
    for image in (ijbc / "loose_crop").iterdir():
        (root / "loose_crop" / image.name).symlink_to(image)
    protocol = ijb.load_protocol(root, "ijbc")
    # Every image of the first template becomes unreadable; one of a larger template's too.
    templates, counts = np.unique(protocol.face_template, return_counts=True)
    first, second = templates[0], templates[1:][counts[1:] > 1][0]
    broken = set(protocol.face_image[protocol.face_template == first].tolist())
    broken.add(int(protocol.face_image[protocol.face_template == second][0]))
    for i in broken:
        path = root / "loose_crop" / protocol.images[i]
        path.unlink()
        path.write_bytes(b"not a jpeg")
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=SIZE)
    checkpoint = tmp_path / "b.pt"
    ckpt.export_backbone(checkpoint, model, {"backbone": "iresnet18", "embedding_size": 8,
                                             "width": 0.125, "dropout": 0.0}, SIZE)  # fmt: skip
    results = ijb.evaluate_ijb(root, "ijbc", checkpoint=checkpoint, progress=False)
    assert results["num_unreadable_images"] == len(broken)
    assert results["num_templates_without_feature"] == 1
    assert results["num_pairs_without_feature"] == 63  # the first template meets all others
    assert results["num_pairs"] == 2016  # nothing dropped
    assert "templates have no readable image" in caplog.text
