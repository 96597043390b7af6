"""docs/extending.md done as it says, with its own code blocks: a margin, a backbone, a data
format and a hook added each in one place (a line of recognition/registry.py, or a config
key, and the user's module), and an evaluation protocol added with the page's three edits
to a copy of the code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from recognition import registry
from recognition.registry import Entry

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "extending.md"


def blocks(first_line: str) -> list[str]:
    """The page's python code blocks whose first line is `first_line`, less that line."""
    found = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    return [b.split("\n", 1)[1] for b in found if b.split("\n", 1)[0] == first_line]


def module_text(name: str) -> str:
    """The module `name` (toy_parts.py, ...) as the page's blocks spell it, in order."""
    return "\n\n".join(blocks(f"# {name}"))


def entry(table: str) -> tuple[str, Entry]:
    """(name, Entry) of the page's line for `table` (MARGINS, ...) of registry.py."""
    (line,) = blocks(f"# in {table} (recognition/registry.py)")
    ((name, value),) = eval("{" + line + "}", {"Entry": Entry}).items()
    return name, value


@pytest.fixture
def toy_parts(tmp_path, monkeypatch):
    """The page's toy_parts.py importable, and its registry lines in place."""
    (tmp_path / "toy_parts.py").write_text(module_text("toy_parts.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for table in ("MARGINS", "BACKBONES", "FORMATS"):
        name, value = entry(table)
        monkeypatch.setitem(getattr(registry, table), name, value)
    import toy_parts

    yield toy_parts
    sys.modules.pop("toy_parts", None)


def toy_list(root: Path, num_classes: int = 4, per_class: int = 4) -> Path:
    """A ToyList data set: random 32x32 images and their list.txt."""
    rng = np.random.default_rng(0)
    lines = []
    for c in range(num_classes):
        for n in range(per_class):
            name = f"img{c}_{n}.png"
            pixels = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name)
            lines.append(f"{name} {c}")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return root


def test_a_margin_backbone_format_and_hook_each_take_one_line(toy_parts, tmp_path, capsys):
    import train as train_py
    from recognition.config import load_config
    from recognition.config.reference import reference_page
    from recognition.data.formats import resolve_format
    from recognition.heads import build_margin
    from recognition.training import train

    data = tmp_path / "data"
    data.mkdir()
    toy_list(data)
    overrides = [
        f"data.root={data}",
        "data.image_size=32",
        "data.num_workers=0",
        "model.backbone=toy",
        "head.margin=toy",
        "head.m=0.3",
        "train.hooks=[toy_parts:CountSteps]",
        f"output_dir={tmp_path / 'run'}",
        "train.batch_size=8",
        "train.max_steps=3",
        "train.log_every=1",
        "train.progress=false",
        "eval.targets=[]",
    ]
    # The names are checked, listed by --show-config and the reference, and built.
    assert train_py.main(["--show-config", *overrides]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"  margin: toy  # \[command line\] One of .*, toy ", shown)
    assert re.search(r"  backbone: toy  # \[command line\] One of .*, toy: ", shown)
    page = reference_page()
    for words in ("cos(theta) - m / 2", "one conv, a toy", "a list.txt of images and labels"):
        assert f"| `toy` | {words} | `toy_parts:" in page
    cfg = load_config("default", overrides)
    assert resolve_format(cfg.data) == "toy"  # data.format=auto finds its marker
    cos = torch.linspace(-1, 1, 11, dtype=torch.float64)
    margin = build_margin("toy", scale=8.0, m=0.3)
    torch.testing.assert_close(margin(cos), cos - 0.15, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"head\.h: only used with head\.margin=adaface"):
        build_margin("toy", h=0.3)

    # A run trains with all of them; the config's hook and the API's see every step.
    class Seen(toy_parts.Hook):
        def __init__(self) -> None:
            self.models = []

        def after_step(self, run, result) -> None:
            self.models.append((type(run.model).__name__, type(run.head.margin).__name__))

    seen = Seen()
    run_dir = train(cfg, hooks=[seen])
    assert toy_parts.CountSteps.seen == 3
    assert seen.models == [("ToyNet", "ToyMargin")] * 3
    assert (run_dir / "backbone.pt").is_file()


def test_a_hook_whose_module_is_missing_is_named_before_any_work(tmp_path, capsys):
    import train as train_py

    out = tmp_path / "run"
    assert train_py.main(["train.hooks=[no_such_module:Hook]", f"output_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "error: train.hooks[0]: no module 'no_such_module'" in err and not out.exists()
    assert train_py.main(["--show-config", "train.hooks=[not code]"]) == 2
    assert "train.hooks[0]: 'not code' is not package.module:attribute" in capsys.readouterr().err


def test_an_evaluation_protocol_takes_the_pages_three_edits(tmp_path):
    # On a copy of the code: the field, the registry line, and the user's module; nothing else.
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "recognition", copy / "recognition", ignore=ignore)
    for name in ("train.py", "evaluate.py"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "configs", copy / "configs")
    (copy / "toy_protocol.py").write_text(module_text("toy_protocol.py"))
    eval_py = copy / "recognition" / "config" / "eval.py"
    (field,) = blocks("# in EvalTarget (recognition/config/eval.py), after reid")
    text = eval_py.read_text()
    after = text.index("\n    images: str | None = None\n")  # the field after reid's
    eval_py.write_text(text[:after] + "\n" + field.rstrip("\n") + text[after:])
    registry_py = copy / "recognition" / "registry.py"
    text = registry_py.read_text()
    start = text.index("PROTOCOLS: dict[str, Entry] = {")
    end = text.index("\n}\n", start)
    line = "    " + blocks("# in PROTOCOLS (recognition/registry.py)")[0].strip()
    registry_py.write_text(text[:end] + "\n" + line + text[end:])

    images = tmp_path / "faces"
    images.mkdir()
    rng = np.random.default_rng(1)
    for n in range(3):
        pixels = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{n}.png")
    script = f"""
import json, sys
import numpy as np, torch
from PIL import Image
import evaluate
from recognition import checkpoint as ckpt
from recognition.config import load_config
from recognition.config.reference import reference_page
from recognition.evaluation.embeddings import Extraction
from recognition.evaluation.protocols import protocol_for, scalars
from recognition.evaluation.targets import evaluate_config_targets
from recognition.models import build_backbone

torch.manual_seed(0)
model = build_backbone("iresnet18", embedding_size=8, width=0.125, dropout=0.0, image_size=32)
model_cfg = {{"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}}
from pathlib import Path
ckpt.export_backbone(Path("backbone.pt"), model, model_cfg, 32)
model.eval()
# The reference: the raw embeddings' norms, in float64, image by image.
norms = []
for n in range(3):
    pixels = np.asarray(Image.open(r"{images}/" + f"{{n}}.png"), np.float64)
    x = torch.from_numpy(pixels / 127.5 - 1.0).permute(2, 0, 1)[None].float()
    with torch.no_grad():
        norms.append(model(x).double().norm().item())
expected = float(np.mean(norms))

assert evaluate.main(["--checkpoint", "backbone.pt", "--toy", r"{images}", "--json", "o.json",
                      "--workers", "0", "--no-flip"]) == 0
assert abs(json.load(open("o.json"))["norm"] - expected) < 1e-5

cfg = load_config("default", ["eval.targets=[{{toy: {images}}}]", "eval.every_steps=10",
                              "eval.best_metric=faces/norm", "data.image_size=32"])
results = evaluate_config_targets(cfg, model, torch.device("cpu"), progress=False)
values = scalars([protocol_for(t) for t in cfg.eval.targets], results)
assert set(values) == {{"eval/faces/norm"}}, values
assert "| `toy` | mean embedding norm | `toy_protocol:MeanNorm` |" in reference_page()
print("done")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=copy, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
