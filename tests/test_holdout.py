"""eval.holdout: identities held out of a folder or pack, never trained on, verified on.

The split is checked against a plain reference (names sorted by their SHA-256 hex digest),
the pairs against the folds they claim, the training data by the labels its loader yields,
and one small training run on a folder of synthetic faces for the rest: nothing generated,
verification on the held-out pairs during and after training, the same pairs on resume,
and `evaluate.py` on the finished run.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from recognition.config import SyntheticSpec, load_config
from recognition.data.build import build_train_dataset
from recognition.data.holdout import (
    IDENTITIES_FILE,
    MIN_HELD_OUT,
    TrainingSubset,
    choose_holdout,
    make_holdout_pairs,
)
from recognition.data.index import scan_folder
from recognition.data.pack import pack_folder
from recognition.data.pairs import load_pairs
from recognition.data.synthetic import generate_synthetic_dataset
from recognition.distributed import DistInfo
from recognition.preflight import check_target
from recognition.training.build import TrainingError
from recognition.training.holdout import hold_out, holdout_split

NUM_PEOPLE = 44  # 20 held out (the minimum), 24 trained on


@pytest.fixture(scope="module")
def faces(tmp_path_factory) -> Path:
    """44 synthetic people x 4 images of 32 px, as a plain identity folder (id_00000/...)."""
    root = tmp_path_factory.mktemp("faces")
    spec = SyntheticSpec.training_set(NUM_PEOPLE, 4, image_size=32)
    generate_synthetic_dataset(root, spec, num_workers=1)
    return root / "train"


def reference_split(names: list[str], counts: list[int], share: float) -> list[str]:
    """The held-out names, by the rule as docs/evaluation.md states it."""
    eligible = [n for n, c in zip(names, counts, strict=True) if c >= 2]
    count = min(max(MIN_HELD_OUT, math.ceil(share * len(names))), len(eligible), len(names) // 2)
    if count < MIN_HELD_OUT:
        return []
    return sorted(sorted(eligible, key=lambda n: hashlib.sha256(n.encode()).hexdigest())[:count])


def test_the_split_follows_the_names_alone():
    rng = np.random.default_rng(3)
    names = [f"person {i}" for i in range(300)]  # with a space: made safe in the pairs
    counts = rng.integers(1, 6, size=300)
    for share in (0.05, 0.2):
        split = choose_holdout(iter(names), counts, share)
        held = sorted(names[c] for c in split.held_out)
        assert held == reference_split(names, list(counts), share)
        # Another label order (as another listing or pack would give): the same people.
        order = rng.permutation(300)
        again = choose_holdout(iter([names[i] for i in order]), counts[order], share)
        assert sorted(names[order[c]] for c in again.held_out) == held
    too_few = choose_holdout(iter(names[:39]), np.full(39, 3), 0.05)  # 39 // 2 < 20
    assert not too_few.active and "40 identities" in too_few.reason
    assert not choose_holdout(iter(names), counts, 0.0).active


def test_the_pairs_keep_to_their_folds():
    names = [f"p{i:02d}" for i in range(25)]
    counts = [2 + i % 4 for i in range(25)]
    pair_names, folds = make_holdout_pairs(names, counts)
    # At least 10 people a fold (2 folds of 12-13 here), up to 10 folds.
    assert pair_names == names and len(folds) == 2
    for people, num_folds in ((20, 2), (69, 6), (500, 10)):
        many = [f"q{i:03d}" for i in range(people)]
        assert len(make_holdout_pairs(many, [3] * people)[1]) == num_folds
    size = dict(zip(names, counts, strict=True))
    seen_by_fold = []
    for same, different in folds:
        assert len(same) == len(different) == len(folds[0][0]) > 0
        assert len(set(same)) == len(same) and len(set(different)) == len(different)
        people = set()
        for name, n1, n2 in same:
            assert 1 <= n1 < n2 <= size[name]
            people.add(name)
        for name1, n1, name2, n2 in different:
            assert name1 != name2 and n1 <= size[name1] and n2 <= size[name2]
            people |= {name1, name2}
        seen_by_fold.append(people)
    for i, a in enumerate(seen_by_fold):  # identity-disjoint folds, as LFW View 2
        assert all(not a & b for b in seen_by_fold[i + 1 :])
    assert make_holdout_pairs(names, counts) == (pair_names, folds)  # deterministic


def test_training_subset_has_no_held_out_label(faces):
    source = build_train_dataset(load_config("default", [f"data.root={faces}"]).data)
    split = holdout_split(source, 0.05)
    subset = TrainingSubset(source, split)
    held = {source.class_name(int(c)) for c in split.held_out}
    assert len(held) == MIN_HELD_OUT and subset.num_classes == NUM_PEOPLE - MIN_HELD_OUT
    # Every sample the training sees, by its new label, and the file it reads.
    names = {subset.class_name(int(label)) for label in subset.labels}
    assert names == {source.class_name(c) for c in range(source.num_classes)} - held
    for i in range(len(subset)):
        identity = Path(subset.describe(i)).parent.name
        assert identity == subset.class_name(int(subset.labels[i])) and identity not in held
    assert np.array_equal(np.unique(subset.labels), np.arange(subset.num_classes))


def test_the_plan_counts_the_classes_the_head_will_have(faces):
    """`train.py --plan` without --classes: the trained identities, not the held-out ones."""
    from recognition.training.plan.report import dataset_classes

    cfg = load_config("default", [f"data.root={faces}"])
    assert dataset_classes(cfg) == NUM_PEOPLE - MIN_HELD_OUT
    assert dataset_classes(load_config("default", [f"data.root={faces}", "eval.holdout=0"])) == (
        NUM_PEOPLE
    )


def test_rank_one_of_two_holds_out_the_same_people_and_writes_nothing(faces, tmp_path):
    cfg = load_config("default", [f"data.root={faces}", f"output_dir={tmp_path / 'run'}"])
    rank0 = build_train_dataset(cfg.data)
    rank1 = build_train_dataset(cfg.data)  # another process opens the same folder
    subset1, held1 = hold_out(cfg, DistInfo(rank=1, local_rank=1, world_size=2), rank1)
    assert held1 and not (tmp_path / "run").exists()  # rank 0 writes the pairs, alone
    subset0, _ = hold_out(cfg, DistInfo(), rank0)
    assert np.array_equal(subset0.labels, subset1.labels)
    assert list(subset0.iter_class_names()) == list(subset1.iter_class_names())


def test_a_pack_holds_out_its_records_as_files(faces, tmp_path):
    pack_folder(scan_folder(faces), tmp_path / "pack", threads=1)
    out = tmp_path / "run"
    cfg = load_config("default", [f"data.root={tmp_path / 'pack'}", f"output_dir={out}"])
    source = build_train_dataset(cfg.data)
    subset, held = hold_out(cfg, DistInfo(), source)
    assert held and subset.num_classes == NUM_PEOPLE - MIN_HELD_OUT
    pairs = load_pairs(out / "holdout" / "pairs.txt")
    check_target(_target(out))  # every image of the pairs is there, by the pairs' names
    first = pairs.left[0]  # "<label>/<label>_<n>.jpg": record n of that label, byte for byte
    name, number = first.split("/")[0], int(first.split("_")[-1].split(".")[0])
    record = source.encoded(int(source.members(int(name))[number - 1]))
    assert (out / "holdout" / first).read_bytes() == record


def _target(run: Path):
    from recognition.config import EvalTarget

    return EvalTarget(name="holdout", pairs=str(run / "holdout" / "pairs.txt"))


def test_a_folder_run_verifies_on_its_held_out_people(faces, tmp_path, monkeypatch):
    """Train 4 steps and resume for 2 more on the folder, with the default config as a user
    would: no synthetic data made, the held-out people never in a batch, their pairs
    verified on at step 2 and at the end, the same pairs after the resume; evaluate.py
    verifies the finished run on them again."""
    import evaluate
    from recognition.training import build as build_module
    from recognition.training import loop

    monkeypatch.chdir(tmp_path)  # data.synthetic.root is data/synthetic, relative

    def no_generation(*args, **kwargs):
        raise AssertionError("the synthetic set was generated for a run on a folder")

    monkeypatch.setattr(build_module, "ensure_synthetic_dataset", no_generation)
    out = tmp_path / "run"
    overrides = [
        f"data.root={faces}", f"output_dir={out}", "data.image_size=32", "data.num_workers=0",
        "model.width=0.0625", "model.embedding_size=16", "train.batch_size=8",
        "train.progress=false", "train.log_every=2", "eval.every_steps=2", "eval.batch_size=64",
    ]  # fmt: skip
    seen: list[np.ndarray] = []
    real_build = loop.build

    def recording_build(*args, **kwargs):  # every label the run's loader yields
        run = real_build(*args, **kwargs)
        loader = run.loader
        run.loader = (batch for batch in loader if not seen.append(batch[1].numpy()))
        return run

    monkeypatch.setattr(loop, "build", recording_build)
    loop.train(load_config("default", [*overrides, "train.max_steps=4"]))
    pairs_file = out / "holdout" / "pairs.txt"
    first_pairs = pairs_file.read_bytes()
    loop.train(load_config("default", [*overrides, "train.max_steps=6", "train.resume=true"]))
    assert pairs_file.read_bytes() == first_pairs
    assert not (tmp_path / "data").exists()

    held = set((out / "holdout" / IDENTITIES_FILE).read_text().split())
    classes = (out / "classes.txt").read_text().split()
    assert len(held) == MIN_HELD_OUT and len(classes) == NUM_PEOPLE - MIN_HELD_OUT
    labels = np.concatenate(seen)
    assert len(labels) == 6 * 8 and not held & {classes[label] for label in labels}

    num_pairs = len(load_pairs(pairs_file))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/holdout/accuracy" in r] == [2, 4, 6]
    assert json.loads((out / "eval.json").read_text())["holdout"]["num_pairs"] == num_pairs
    assert evaluate.main(["--config", str(out / "config.yaml"), "--json", "again.json"]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["num_pairs"] == num_pairs

    # The data changed under a run: its pairs are not the ones it started with.
    pairs_file.write_text(first_pairs.decode().replace("\t1\t", "\t2\t", 1))
    cfg = load_config("default", [*overrides, "train.resume=true"])
    with pytest.raises(TrainingError, match="holdout/pairs.txt is not the held-out pairs"):
        hold_out(cfg, DistInfo(), build_train_dataset(cfg.data))


def _two_rank_folder_run(rank: int, world_size: int, port: int, overrides: list[str]) -> None:
    import helpers
    import torch.distributed as dist

    from recognition.training import loop

    helpers.init_gloo_rank(rank, world_size, port)
    real_build = loop.build
    seen: list[np.ndarray] = []

    def recording_build(*args, **kwargs):  # every label this rank's loader yields
        run = real_build(*args, **kwargs)
        loader = run.loader
        run.loader = (batch for batch in loader if not seen.append(batch[1].numpy()))
        return run

    loop.build = recording_build
    loop.train(load_config("default", overrides))
    out = Path(next(o for o in overrides if o.startswith("output_dir=")).split("=", 1)[1])
    np.save(out / f"labels_rank{rank}.npy", np.concatenate(seen))
    dist.destroy_process_group()


def test_two_ranks_hold_out_the_same_people_and_never_train_on_them(faces, tmp_path):
    """At world size 2 (gloo): one split for both ranks, the pairs file a single-process
    computation of the split and its pairs gives, and no held-out label in either rank's
    batches."""
    import helpers
    import torch.multiprocessing as mp

    from recognition.data.pairs import pairs_text

    out = tmp_path / "run"
    overrides = [
        f"data.root={faces}", f"output_dir={out}", "data.image_size=32", "data.num_workers=0",
        "model.width=0.0625", "model.embedding_size=16", "train.batch_size=4",
        "train.progress=false", "train.max_steps=3", "eval.batch_size=64",
    ]  # fmt: skip
    mp.spawn(_two_rank_folder_run, args=(2, helpers.free_port(), overrides), nprocs=2)

    source = build_train_dataset(load_config("default", [f"data.root={faces}"]).data)
    split = holdout_split(source, 0.05)
    names = [source.class_name(int(c)) for c in split.held_out]
    counts = np.bincount(np.asarray(source.labels))[split.held_out]
    assert (out / "holdout" / "pairs.txt").read_text() == pairs_text(
        make_holdout_pairs(names, counts)[1]
    )
    classes = (out / "classes.txt").read_text().split()
    assert len(classes) == NUM_PEOPLE - MIN_HELD_OUT and not set(names) & set(classes)
    for rank in (0, 1):
        labels = np.load(out / f"labels_rank{rank}.npy")
        assert len(labels) == 3 * 4 and not set(names) & {classes[label] for label in labels}
