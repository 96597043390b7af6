"""Memory formats and Inductor on a CPU: what oneDNN issue 6035 allows, checked for real.

oneDNN's weight gradient of a strided 1x1 convolution with fewer input channels than its
channel block is broken in channels-last (recognition/models/cpu_layout.py). The narrow
default backbone has one, so channels-last is refused for it on a CPU; every memory format
that is allowed must give the float64 NCHW gradients; and Inductor compiles with NCHW
convolutions (no layout optimisation), run here on oneDNN's AVX2 path, where the bug hangs
or gives wrong gradients, so that the test fails if the compile options stop avoiding it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import REPO, child_env, tiny_run_overrides
from test_cli_faults import one_error_line

import train
from recognition.config import load_config
from recognition.heads import build_head
from recognition.models import backbone_from_config
from recognition.models.cpu_layout import channels_last_hazards
from recognition.precision import Precision
from recognition.training import train as run_training
from recognition.training.step import train_step

NARROW = 0.125  # the default backbone's width: 8 channels enter layer1.0's downsample
WIDE = 0.25  # 16 channels there: oneDNN's kernel block, not affected


@pytest.mark.parametrize(
    ("backbone", "width", "hazards"),
    [
        ("iresnet18", NARROW, ["layer1.0.downsample.0", "layer2.0.downsample.0"]),
        ("iresnet18", WIDE, []),
        ("iresnet50", NARROW, ["layer1.0.downsample.0", "layer2.0.downsample.0"]),
        ("iresnet18", 1 / 16, [f"layer{k}.0.downsample.0" for k in (1, 2, 3)]),
        ("resnet50_reid", 1.0, []),
    ],
)
def test_the_strided_1x1_convolutions_with_few_channels_are_found(backbone, width, hazards):
    cfg = load_config("default", [f"model.backbone={backbone}", f"model.width={width}"])
    with torch.device("meta"):
        model = backbone_from_config(cfg.model, cfg.data.image_hw)
    assert channels_last_hazards(model) == hazards
    # Independently: every such convolution, by its shapes.
    for name in hazards:
        conv = model.get_submodule(name)
        assert conv.kernel_size == (1, 1) and conv.stride == (2, 2) and conv.in_channels < 16


def test_channels_last_on_a_cpu_is_refused_for_the_narrow_backbone(image_folder, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_run_overrides(image_folder, out, f"model.width={NARROW}", "data.channels_last=true")
    assert train.main(args) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: data.channels_last: on a CPU")
    assert "layer1.0.downsample.0 (8 channels)" in line and "data.channels_last=false" in line
    assert not (out / "checkpoints").exists() and not (out / "classes.txt").exists()


def _one_step_gradients(cfg, memory_format, dtype, images, labels):
    """Gradients of one train_step of the backbone and head `cfg` describes."""
    torch.manual_seed(0)
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw).to(dtype)
    backbone = backbone.to(memory_format=memory_format)
    head = build_head(cfg.head, 10, cfg.model.embedding_size, seed=0).to(dtype)
    precision = Precision("O0", "bf16", torch.device("cpu"))
    precision.prepare(backbone, head)
    params = [*backbone.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.0)
    batch = [(images.to(dtype).contiguous(memory_format=memory_format), labels)]
    result = train_step(backbone, head, batch, optimizer, precision, None)
    grads = {f"backbone.{n}": p.grad for n, p in backbone.named_parameters()}
    grads["head.weight"] = head.weight.grad
    return result.loss.item(), grads


@pytest.mark.parametrize("width", [NARROW, WIDE])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_training_step_in_every_allowed_memory_format_matches_float64(
    width, channels_last, image_folder, tmp_path
):
    overrides = [f"model.width={width}", "model.embedding_size=16", "head.scale=16"]
    cfg = load_config("default", [*overrides, f"data.channels_last={channels_last}"])
    if channels_last and width == NARROW:
        # Not allowed: refused before anything is built (the test above checks the message).
        args = tiny_run_overrides(image_folder, tmp_path / "run", *overrides)
        with pytest.raises(ValueError, match="data.channels_last: on a CPU"):
            run_training(load_config("default", [*args, "data.channels_last=true"]))
        return
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(16, 3, *cfg.data.image_hw, generator=generator)
    labels = torch.randint(0, 10, (16,), generator=generator)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    loss, grads = _one_step_gradients(cfg, memory_format, torch.float32, images, labels)
    ref_loss, ref_grads = _one_step_gradients(
        cfg, torch.contiguous_format, torch.float64, images, labels
    )
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    # Relative to each tensor's scale: float32 rounding through small-batch BatchNorms reaches
    # 2e-4 on the stem in NCHW; oneDNN's broken kernel is off by 0.5. Gradients that are zero
    # in exact arithmetic (a bias before a BatchNorm) against 1e-6 of the largest one.
    assert [n for n, g in grads.items() if g is None] == [
        n for n, g in ref_grads.items() if g is None
    ]
    ref_grads = {n: g for n, g in ref_grads.items() if g is not None}
    largest = max(g.abs().max().item() for g in ref_grads.values())
    for name, ref in ref_grads.items():
        error = (grads[name].double() - ref).norm().item()
        bound = 1e-3 * ref.norm().item() + 1e-6 * largest
        assert error <= bound, f"{name}: |error| {error:.3g} > {bound:.3g}"


COMPILED_STEP = """
import torch
from recognition.models.cpu_layout import cpu_compile_options
from recognition.models.iresnet import IResNet

torch.manual_seed(0)
def make():  # 4 channels enter layer1.0's strided 1x1 downsample: below AVX2's block of 8
    return IResNet((1, 1, 1, 1), width=1 / 16, image_size=32, embedding_size=8)
model, reference = make(), make().double()
reference.load_state_dict(model.state_dict())
images, weights = torch.randn(16, 3, 32, 32), torch.randn(16, 8)
(reference(images.double()) * weights.double()).sum().backward()
compiled = torch.compile(model, backend="inductor", options=cpu_compile_options("default"))
(compiled(images) * weights).sum().backward()
pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
error = sum((p.double() - q).square().sum() for p, q in pairs if q is not None).sqrt()
scale = sum(q.square().sum() for _, q in pairs if q is not None).sqrt()
print("relative gradient error", (error / scale).item())
"""


def test_inductor_compiles_forward_and_backward_on_a_cpu(tmp_path):
    """The real Inductor backend with the project's CPU options, on oneDNN's AVX2 path.

    With layout optimisation on, this hangs (both threads spinning) or returns wrong weight
    gradients on such a CPU; with it off, the gradients are float64's to float32 rounding.
    """
    script = tmp_path / "compiled_step.py"
    script.write_text(textwrap.dedent(COMPILED_STEP))
    env = dict(child_env(), ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="2")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # compiled here, not cached
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the compiled step hung (oneDNN's channels-last 1x1 weight gradient)")
    assert done.returncode == 0, done.stderr[-3000:]
    error = float(done.stdout.split("relative gradient error")[1])
    assert error < 1e-5, done.stdout
