"""benchmarks/real_faces.py on a tiny generated folder (no real faces needed): a recipe runs
through train.py, its row carries the accuracy the run itself wrote, the JSON and Markdown
are written, a second call reuses the measured run, and the dev split leaves out exactly the
people the test split's run held out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks import real_faces

PEOPLE, PHOTOS = 44, 2
TINY = [
    "data.image_size=32",
    "model.width=0.125",
    "model.embedding_size=16",
    "train.batch_size=16",
    "train.max_steps=2",
    "data.num_workers=0",
    "train.progress=false",
]


def make_people(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for p in range(PEOPLE):
        folder = root / f"person_{p:02d}"
        folder.mkdir(parents=True)
        for n in range(PHOTOS):
            image = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            Image.fromarray(image).save(folder / f"{n}.jpg", quality=90)
    return root


def held_out_people(run_dir: Path) -> set[str]:
    """The people a finished run verified on, from the pairs file it wrote (holdout/)."""
    people = set()
    for line in (run_dir / "holdout" / "pairs.txt").read_text().splitlines():
        people.update(t for t in line.split() if t.startswith("person_"))
    return people


def test_a_recipe_runs_reports_its_own_accuracy_and_the_dev_split_leaves_its_people_out(
    tmp_path,
):
    root = make_people(tmp_path / "faces")
    work, out_json, out_md = tmp_path / "work", tmp_path / "r.json", tmp_path / "r.md"
    argv = ["--root", str(root), "--seeds", "0", "--work", str(work),
            "--recipe", "tiny", "config=default", *TINY,
            "--json", str(out_json), "--markdown", str(out_md)]  # fmt: skip
    assert real_faces.main(argv) == 0

    written = json.loads(out_json.read_text())
    (run,) = written["runs"]
    run_dir = Path(run["run_dir"])
    wrote = json.loads((run_dir / "eval.json").read_text())["holdout"]
    assert run["accuracy"] == wrote["accuracy"] and run["steps"] == 2
    assert written["summary"][0]["mean"] == wrote["accuracy"]
    assert f"{100 * wrote['accuracy']:.2f}" in out_md.read_text()

    # Measured once: a second call with the same work folder reads the row back.
    (run_dir / "eval.json").unlink()
    assert real_faces.main(argv) == 0
    assert json.loads(out_json.read_text())["runs"] == written["runs"]

    # The dev split: every person but those the test split's run held out, linked.
    held_out = held_out_people(run_dir)
    assert len(held_out) == 20
    dev, left_out = real_faces.make_dev_folder(root, tmp_path / "dev", 0.05)
    linked = {p.name for p in dev.iterdir()}
    assert left_out == len(held_out)
    assert linked == {p.name for p in root.iterdir() if p.is_dir()} - held_out
    assert all((dev / name).is_symlink() for name in linked)
