"""IJB-B/C 1:N identification: the 1:N lists, the tiled search and its metrics against plain
float64 loops, a release built from real photographs, evaluate.py --ijb-mode 1n."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_sample_image
from test_cli_faults import one_error_line
from test_ijb import FACE, LOOSE, SIZE, loose_crop, replace_line

import evaluate
from recognition import checkpoint as ckpt
from recognition.data.alignment import align_face, template_points
from recognition.data.transforms import load_rgb, to_input_tensor
from recognition.evaluation import ijb
from recognition.evaluation.ijb import search as ijb_search
from recognition.evaluation.ijb import search_protocol
from recognition.models import build_backbone

HEADER = "TEMPLATE_ID,SUBJECT_ID,FILENAME,SIGHTING_ID,FACE_X,FACE_Y,FACE_WIDTH,FACE_HEIGHT"
RANKS = ijb_search.DEFAULT_RANKS
FPIRS = ijb_search.DEFAULT_FPIR_TARGETS


@dataclass
class Release:
    """An IJB layout: template -> (subject, [(media id, [image names])]), the galleries'
    template ids by name, the probes' template ids, and templates given no face line."""

    templates: dict[int, tuple[int, list[tuple[int, list[str]]]]] = field(default_factory=dict)
    galleries: dict[str, list[int]] = field(default_factory=dict)
    probes: list[int] = field(default_factory=list)
    unlisted: set[int] = field(default_factory=set)

    def images(self) -> list[str]:
        return [n for t, (_, media) in self.templates.items() for _, names in media for n in names]


def make_release(
    rng: np.random.Generator,
    name: str,
    num_subjects: int,
    probes_per_subject: tuple[int, int],
    enrolled_share: float = 1.0,
) -> Release:
    """Subjects alternate between the two galleries (one template each), the last
    ``1 - enrolled_share`` of them in neither; every subject has a few probe templates.
    Templates hold one or two media of one to three images, named in order."""
    release = Release(galleries={g: [] for g in search_protocol.GALLERIES[name]})
    gallery_names = list(release.galleries)
    num_enrolled = round(num_subjects * enrolled_share)
    counter = iter(range(1, 10**6))

    def template(subject: int) -> int:
        tid = 7 + 5 * len(release.templates)  # ids need not be contiguous
        media = []
        for _ in range(int(rng.integers(1, 3))):
            mid = 90_000 + next(counter)
            media.append((mid, [f"{next(counter)}.jpg" for _ in range(int(rng.integers(1, 4)))]))
        release.templates[tid] = (subject, media)
        return tid

    for s in range(num_subjects):
        subject = 1000 + 3 * s
        if s < num_enrolled:
            release.galleries[gallery_names[s % 2]].append(template(subject))
        for _ in range(int(rng.integers(*probes_per_subject))):
            release.probes.append(template(subject))
    return release


def write_meta(
    root: Path, name: str, release: Release, landmarks: dict[str, np.ndarray] | None = None
) -> None:
    """The release's meta files: face_tid_mid, 5pts, the 1:1 pairs (every gallery template
    against every probe) and the three 1:N lists."""
    meta = root / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    (root / "loose_crop").mkdir(exist_ok=True)
    faces, points = [], []
    fallback = np.array([[30, 40], [50, 40], [40, 50], [32, 58], [48, 58]], np.float64)
    for tid, (_, media) in release.templates.items():
        for mid, names in media:
            for n in names:
                if tid not in release.unlisted:
                    faces.append(f"{n} {tid} {mid}")
                marks = fallback if landmarks is None else landmarks[n]
                points.append(f"{n} " + " ".join(f"{v:.3f}" for v in marks.ravel()) + " 0.9")
    (meta / f"{name}_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (meta / f"{name}_name_5pts_score.txt").write_text("\n".join(points) + "\n")
    gallery_ids = [t for ids in release.galleries.values() for t in ids]
    pairs = [
        f"{g} {p} {int(release.templates[g][0] == release.templates[p][0])}"
        for g in gallery_ids
        for p in release.probes
    ]
    (meta / f"{name}_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
    lists = {f"gallery_{g}": ids for g, ids in release.galleries.items()}
    lists["probe_mixed"] = release.probes
    for list_name, ids in lists.items():
        rows = [HEADER]
        for tid in ids:
            subject, media = release.templates[tid]
            for mid, names in media:
                rows += [f"{tid},{subject},img/{n},{mid},0,0,{LOOSE},{LOOSE}" for n in names]
        (meta / f"{name}_1N_{list_name}.csv").write_text("\n".join(rows) + "\n")


# ------------------------------------------------------------------------------ reference


def reference_templates(
    release: Release, features: dict[str, np.ndarray], unreadable: set[str]
) -> dict[int, np.ndarray | None]:
    """Template features by plain loops in float64: each media's readable images averaged,
    the media summed, L2-normalised; None for a template with no readable image."""
    pooled = {}
    for tid, (_, media) in release.templates.items():
        total, found = 0.0, False
        for _, names in media:
            rows = [features[n].astype(np.float64) for n in names if n not in unreadable]
            if rows and tid not in release.unlisted:
                total, found = total + sum(rows) / len(rows), True
        pooled[tid] = total / math.sqrt(float(np.dot(total, total))) if found else None
    return pooled


def reference_gallery(release: Release, pooled: dict, gallery: str) -> dict:
    """One gallery's counts, CMC, TPIR and thresholds by plain loops over every probe and
    gallery template, from the definitions in recognition/evaluation/ijb/search.py."""
    gallery_ids = release.galleries[gallery]
    mated_ranks, mated_scores, non_mated_tops = [], [], []
    for p in release.probes:
        subject = release.templates[p][0]
        scores = []
        for g in gallery_ids:
            a, b = pooled[p], pooled[g]
            scores.append(-1.0 if a is None or b is None else float(np.dot(a, b)))
        mates = [j for j, g in enumerate(gallery_ids) if release.templates[g][0] == subject]
        if not mates:
            non_mated_tops.append(max(scores))
            continue
        m = mates[0]
        others_at_or_above = sum(1 for j, s in enumerate(scores) if j != m and s >= scores[m])
        mated_ranks.append(1 + others_at_or_above)
        mated_scores.append(scores[m])
    cmc = {str(r): sum(x <= r for x in mated_ranks) / len(mated_ranks) for r in RANKS}
    tpirs, thresholds = {}, {}
    tops = sorted(non_mated_tops, reverse=True)
    for fpir in FPIRS:
        alarms = math.floor(fpir * len(tops) + 1e-9)
        key = ijb.far_key(fpir)
        if alarms < 1:
            tpirs[key] = thresholds[key] = None
            continue
        threshold = tops[alarms] if alarms < len(tops) else -math.inf
        hits = sum(
            1 for r, s in zip(mated_ranks, mated_scores, strict=True) if r == 1 and s > threshold
        )
        tpirs[key], thresholds[key] = hits / len(mated_ranks), threshold
    return {
        "num_templates": len(gallery_ids),
        "num_mated": len(mated_ranks),
        "num_non_mated": len(non_mated_tops),
        "cmc": cmc,
        "tpir_at_fpir": tpirs,
        "fpir_thresholds": thresholds,
    }


def assert_matches_reference(result: dict, release: Release, pooled: dict) -> None:
    for gallery in release.galleries:
        got, expected = result["galleries"][gallery], reference_gallery(release, pooled, gallery)
        for key in ("num_templates", "num_mated", "num_non_mated", "cmc", "tpir_at_fpir"):
            assert got[key] == expected[key], (gallery, key, got[key], expected[key])
        for key, value in expected["fpir_thresholds"].items():
            assert got["fpir_thresholds"][key] == pytest.approx(value, abs=1e-6)
    for metric in ("cmc", "tpir_at_fpir"):
        for key, value in result[metric].items():
            values = [result["galleries"][g][metric][key] for g in release.galleries]
            assert value == (None if None in values else pytest.approx(np.mean(values)))


# ------------------------------------------------------------------------------ the search


@pytest.mark.parametrize(("k", "block_size", "threads"), [(10, 7, 3), (60, 512, 1), (1, 64, 2)])
def test_search_equals_plain_loops_with_exact_ties(k, block_size, threads):
    # Small integer features: every score is exact in float32, so ties are real ties.
    rng = np.random.default_rng(k)
    probes = rng.integers(-2, 3, size=(300, 5)).astype(np.float32)
    gallery = rng.integers(-2, 3, size=(37, 5)).astype(np.float32)
    mate = np.where(rng.random(300) < 0.6, rng.integers(0, 37, 300), -1)
    probe_ok, gallery_ok = rng.random(300) > 0.05, rng.random(37) > 0.1
    result = ijb_search.search_gallery(
        probes, gallery, mate, probe_ok=probe_ok, gallery_ok=gallery_ok, k=k,
        block_size=block_size, num_threads=threads,
    )  # fmt: skip
    for p in range(300):
        scores = [
            float(np.dot(probes[p].astype(np.float64), gallery[g]))
            if probe_ok[p] and gallery_ok[g]
            else -1.0
            for g in range(37)
        ]
        order = sorted(range(37), key=lambda g: (-scores[g], g))[: min(k, 37)]
        assert result.top_index[p].tolist() == order, p
        assert result.top_scores[p].tolist() == [scores[g] for g in order], p
        if mate[p] < 0:
            assert result.mate_rank[p] == 0 and np.isnan(result.mate_score[p])
        else:
            m = mate[p]
            assert result.mate_score[p] == scores[m]
            assert result.mate_rank[p] == 1 + sum(
                scores[g] >= scores[m] for g in range(37) if g != m
            ), p


def test_search_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="mate must be"):
        ijb_search.search_gallery(np.ones((3, 4)), np.ones((2, 4)), np.array([0, 2, -1]))
    with pytest.raises(ValueError, match="must be"):
        ijb_search.search_gallery(np.ones((3, 4)), np.ones((2, 5)), np.array([0, 1, -1]))


@pytest.fixture
def synthetic(tmp_path) -> tuple[Path, Release, dict[str, np.ndarray], set[str], Path]:
    """Meta files of a small IJB-C-style release (no images) and a features file for it:
    identity centres plus noise, some images unreadable, one gallery and one probe
    template without any readable image, one probe template with no face line, and
    subjects that neither gallery enrols."""
    rng = np.random.default_rng(11)
    root = tmp_path / "IJBC"
    release = make_release(rng, "ijbc", 36, (4, 9), enrolled_share=0.85)
    release.unlisted.add(release.probes[3])
    write_meta(root, "ijbc", release)
    centres = {s: rng.normal(size=16) for s in {s for s, _ in release.templates.values()}}
    features, unreadable = {}, set()
    for subject, media in release.templates.values():
        for _, names in media:
            for n in names:
                features[n] = (centres[subject] + 1.3 * rng.normal(size=16)).astype(np.float32)
                if rng.random() < 0.05:
                    unreadable.add(n)
    for tid in (release.galleries["G2"][2], release.probes[8]):
        unreadable.update(n for _, names in release.templates[tid][1] for n in names)
    protocol = ijb.load_protocol(root, "ijbc", check_images=False, pairs=False)
    cache = tmp_path / "features.npz"
    readable = np.array([n not in unreadable for n in protocol.images])
    stacked = np.stack([features[n] for n in protocol.images]) * readable[:, None]
    ijb.save_features(
        cache, stacked, readable, protocol.images, {"release": "ijbc", "flip": "True"}
    )
    return root, release, features, unreadable, cache


def test_identification_equals_plain_loops_on_a_synthetic_release(synthetic, tmp_path, capsys):
    root, release, features, unreadable, cache = synthetic
    out = tmp_path / "out.json"
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--ijb-mode", "1n"]
    assert evaluate.main(argv + ["--save-features", str(cache), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    pooled = reference_templates(release, features, unreadable)
    assert_matches_reference(result, release, pooled)
    # The fixture reaches what it is meant to: misses and hits, both FPIRs measurable.
    for g in result["galleries"].values():
        assert 0.2 < g["cmc"]["1"] < 0.9 and g["cmc"]["10"] > g["cmc"]["1"]
        assert g["num_non_mated"] >= 100 and None not in g["tpir_at_fpir"].values()
        assert g["tpir_at_fpir"]["1e-1"] > g["tpir_at_fpir"]["1e-2"]
    assert result["num_probes"] == len(release.probes)
    # Counted, never dropped: the fixture's two, and those its random losses emptied.
    without = [p for p in release.probes if pooled[p] is None]
    assert release.probes[3] in without and release.probes[8] in without
    assert result["num_probes_without_feature"] == len(without)
    for g, ids in release.galleries.items():
        count = sum(pooled[t] is None for t in ids)
        assert result["galleries"][g]["num_templates_without_feature"] == count
    assert result["galleries"]["G2"]["num_templates_without_feature"] >= 1
    table = capsys.readouterr().out
    assert "ijbc/G1" in table and "ijbc mean" in table and "TPIR%@FPIR=1e-2" in table
    # Score weighting changes nothing here (every detector score is 0.9): a second,
    # cached run gives the same numbers through the Python entry.
    again = ijb_search.evaluate_ijb_search(root, "ijbc", features_path=cache, score_weight=True)
    assert again["cmc"] == result["cmc"] and again["tpir_at_fpir"] == result["tpir_at_fpir"]


# ------------------------------------------------------------------------------ meta files


@pytest.mark.parametrize(
    ("file", "line", "bad", "message"),
    [
        ("probe_mixed", 1, "TEMPLATE,SUBJECT,FILENAME", "header naming the TEMPLATE_ID"),
        ("probe_mixed", 3, "x7,1000,img/1.jpg,1,0,0,64,64", "TEMPLATE_ID must be an integer"),
        ("gallery_G1", 2, "7,-5,img/1.jpg,1,0,0,64,64", "SUBJECT_ID must be >= 0"),
        ("gallery_G2", 2, "12", "expected at least 2 fields"),
        ("probe_mixed", 3, None, "has subject 4242 here but"),
    ],
)
def test_malformed_1n_line_names_file_and_line(tmp_path, file, line, bad, message, capsys):
    rng = np.random.default_rng(2)
    root = tmp_path / "IJBC"
    release = make_release(rng, "ijbc", 4, (2, 3))
    write_meta(root, "ijbc", release)
    path = root / "meta" / f"ijbc_1N_{file}.csv"
    if bad is None:  # the template of the line before, with another subject
        bad = path.read_text().splitlines()[line - 2].split(",")
        bad[1] = "4242"
        bad = ",".join(bad)
    replace_line(path, line, bad)
    out = tmp_path / "kept.json"
    out.write_text("{}\n")
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--ijb-mode", "1n", "--checkpoint", "x.pt"]
    assert evaluate.main(argv + ["--json", str(out)]) == 1
    error = one_error_line(capsys.readouterr().err)
    assert f"{path}:{line}: " in error and message in error, error
    assert out.read_text() == "{}\n"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("subject_twice", "is already enrolled"),
        ("both_galleries", "is already enrolled"),
        ("template_in_both", "is already a gallery template"),
        ("probe_in_gallery", "is also a gallery template"),
        ("empty", "no rows"),
    ],
)
def test_lists_that_break_the_protocol_are_refused(tmp_path, change, message, capsys):
    rng = np.random.default_rng(3)
    root = tmp_path / "IJBB"
    release = make_release(rng, "ijbb", 6, (2, 3))
    s1, s2 = release.galleries["S1"], release.galleries["S2"]
    subject_of = {t: release.templates[t][0] for t in release.templates}
    if change == "subject_twice":  # a second S1 template of the first S1 subject
        release.templates[s2[0]] = (subject_of[s1[0]], release.templates[s2[0]][1])
        s1.append(s2.pop(0))
    elif change == "both_galleries":
        release.templates[s2[1]] = (subject_of[s1[0]], release.templates[s2[1]][1])
    elif change == "template_in_both":
        s2.append(s1[1])
    elif change == "probe_in_gallery":
        release.probes.append(s2[0])
    write_meta(root, "ijbb", release)
    if change == "empty":
        (root / "meta" / "ijbb_1N_gallery_S2.csv").write_text(HEADER + "\n\n")
    argv = ["--ijb", str(root), "--ijb-name", "ijbb", "--ijb-mode", "1n", "--checkpoint", "x.pt"]
    assert evaluate.main(argv) == 1
    error = one_error_line(capsys.readouterr().err)
    assert message in error and "ijbb_1N_" in error, error
    if change != "empty":  # both places are named, file:line each
        assert error.count(".csv:") == 2, error


# ------------------------------------------------------------------------------ real photos


def photo_faces(num_subjects: int) -> list[tuple[Image.Image, np.ndarray]]:
    """``num_subjects`` "faces": FACE x FACE squares cut from the photographs scikit-learn
    and matplotlib ship, each with the five template points of that square as landmarks."""
    import matplotlib.cbook

    photos = [load_sample_image("china.jpg"), load_sample_image("flower.jpg")]
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        photos.append(np.asarray(Image.open(f).convert("RGB")))
    faces = []
    for i in range(num_subjects):
        photo = photos[i % len(photos)]
        # Distinct squares of 112 px, spread over each photo in a fixed pattern.
        n = i // len(photos)
        rows, cols = (photo.shape[0] - 112) // 5, (photo.shape[1] - 112) // 5
        y, x = (n * 3 % 5) * rows + 10 * (n // 5), (n % 5) * cols
        square = Image.fromarray(photo[y : y + 112, x : x + 112]).resize((FACE, FACE))
        faces.append((square.convert("RGBA"), template_points(FACE)))
    return faces


def write_photo_release(
    root: Path, name: str, rng: np.random.Generator, release: Release, quality: int
) -> None:
    """`release` written under `root` with every image a loose crop (rotated, scaled, shifted,
    relit, on noise) of its subject's photo square, and the landmarks moved with it."""
    faces = photo_faces(len({s for s, _ in release.templates.values()}))
    subjects = sorted({s for s, _ in release.templates.values()})
    landmarks = {}
    (root / "loose_crop").mkdir(parents=True)
    for subject, media in release.templates.values():
        face, points = faces[subjects.index(subject)]
        for _, names in media:
            for n in names:
                image, landmarks[n] = loose_crop(face, points, rng)
                image.save(root / "loose_crop" / n, quality=quality)
    write_meta(root, name, release, landmarks)


@pytest.fixture(scope="module")
def photo_release(tmp_path_factory) -> tuple[Path, Release]:
    """An IJB-C layout whose identities are squares of real photographs."""
    rng = np.random.default_rng(5)
    root = tmp_path_factory.mktemp("photos") / "IJBC"
    release = make_release(rng, "ijbc", 30, (6, 10), enrolled_share=0.9)
    write_photo_release(root, "ijbc", rng, release, quality=92)
    return root, release


def independent_features(backbone: torch.nn.Module, root: Path, names: list[str]) -> dict:
    """model(aligned) + model(mirror) of each image, one at a time, from the files.

    The landmarks are read as float32, as the protocol holds them: the aligned pixels are
    rounded to bytes, so float64 landmarks would flip some of them by one level."""
    marks = {}
    for line in (root / "meta" / "ijbc_name_5pts_score.txt").read_text().splitlines():
        fields = line.split()
        marks[fields[0]] = np.array(fields[1:11], np.float32).reshape(5, 2)
    features = {}
    with torch.no_grad():
        for n in names:
            aligned = align_face(load_rgb(root / "loose_crop" / n), marks[n], SIZE)
            x = to_input_tensor(aligned, (SIZE, SIZE))[None]
            features[n] = (backbone(x) + backbone(torch.flip(x, dims=[3])))[0].numpy()
    return features


def test_identification_on_real_photographs_equals_an_independent_computation(
    photo_release, tmp_path
):
    root, release = photo_release
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=32, width=0.125, image_size=SIZE)
    checkpoint = tmp_path / "b.pt"
    ckpt.export_backbone(checkpoint, model, {"backbone": "iresnet18", "embedding_size": 32,
                                             "width": 0.125, "dropout": 0.0}, SIZE)  # fmt: skip
    out, cache = tmp_path / "1n.json", tmp_path / "features.npz"
    argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--workers", "0", "--batch-size", "64"]
    run = ["--ijb-mode", "1n", "--checkpoint", str(checkpoint), "--save-features", str(cache)]
    assert evaluate.main(argv + run + ["--json", str(out)]) == 0
    result = json.loads(out.read_text())

    # The features: the model run here on each file, one image at a time.
    backbone, _ = ckpt.load_backbone(checkpoint, torch.device("cpu"))
    mine = independent_features(backbone, root, release.images())
    protocol = ijb.load_protocol(root, "ijbc", pairs=False)
    stored, readable = ijb.load_features(cache, protocol.images, {"release": "ijbc"})
    assert readable.all()
    # (Measured: 1.2e-5 apart at most, batches of 64 against single images.)
    np.testing.assert_allclose(stored, np.stack([mine[n] for n in protocol.images]), atol=1e-4)
    # Pooling, search and metrics by plain loops over the same features, in float64.
    pooled = reference_templates(release, dict(zip(protocol.images, stored, strict=True)), set())
    assert_matches_reference(result, release, pooled)
    # Real squares of three photographs under the crops' jitter: an untrained network
    # already finds most of them, far above the 1/15 of chance.
    assert result["cmc"]["1"] > 0.5 and result["tpir_at_fpir"]["1e-1"] > 0.2, result

    # The 1:1 mode on the same root reads the same features file: no model runs.
    pairs_out = tmp_path / "11.json"
    assert evaluate.main(argv + ["--save-features", str(cache), "--json", str(pairs_out)]) == 0
    verification = json.loads(pairs_out.read_text())
    assert verification["num_pairs"] == len(release.probes) * sum(
        map(len, release.galleries.values())
    )
