"""train.cuda_graphs: the captured and replayed training step (`recognition.training.graphed`).

On a CPU the graph is tests/graph_tape.py's stand-in, which replays the recorded aten
operations with their captured arguments and refuses host reads, as a CUDA graph does: the
replayed steps must give the eager step's losses and weights bit for bit, with the schedule
changing the learning rate at every step. On a GPU (skipped elsewhere) the same comparison
runs on torch.cuda.CUDAGraph.
"""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch
from graph_tape import TapeGraph
from helpers import make_image_folder, needs_cuda, tiny_config
from torch import nn

import recognition.training.graphed as graphed
from recognition.config import ConfigError, load_config
from recognition.heads import build_head
from recognition.optim import build_optimizer, build_scheduler, param_groups
from recognition.precision import Precision
from recognition.training import train
from recognition.training.finetune.head_only import HeadOnlyGate
from recognition.training.graphed import GraphCaptureError, GraphedStep, refusal
from recognition.training.step import train_step

NUM_CLASSES, STEPS = 20, 9


def _parts(device: torch.device, level: str = "O0", dtype: str = "bf16", optimizer: str = "sgd", *,
           head_only: int = 0, fused_update: bool = False, init_scale: float = 2.0**16,
           growth_interval: int = 2000):  # fmt: skip
    """A small conv backbone (BN, PReLU), the config's head and optimizer, a schedule whose
    rate changes at every step (linear warm-up, then poly decay); `fused_update`: the Triton
    head stepping its rows in its backward."""
    torch.manual_seed(0)
    overrides = ["optim.lr=0.1", f"optim.name={optimizer}"]
    if fused_update:
        overrides += ["head.kernel=triton", "head.fused_update=true", "optim.grad_clip=null"]
    cfg = load_config("ms1m_arcface", overrides)
    backbone = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.PReLU(8), nn.Flatten(), nn.Linear(288, 16)
    ).to(device)
    head = build_head(cfg.head, NUM_CLASSES, 16, seed=0, device=device)
    precision = Precision(
        level, dtype, device, init_scale=init_scale, growth_interval=growth_interval
    )
    precision.prepare(backbone, head)
    groups = precision.param_groups(param_groups([backbone, head], 5e-4))
    opt = build_optimizer(groups, cfg.optim)
    if fused_update:
        head.attach_fused_update(opt)
    else:
        head.attach_optimizer(opt, precision.optimizer_param(head.weight))
    scheduler = build_scheduler(opt, 2 * STEPS, 4, cfg.optim, STEPS)
    progress = {"step": 0}
    model = backbone
    if head_only:
        model = HeadOnlyGate(backbone, lambda: progress["step"] < head_only)
    return backbone, model, head, precision, opt, scheduler, progress


def _train(step, device, *, clip=5.0, micro=1, **parts):
    """STEPS steps of `step` over `_parts(device, **parts)`: the curve (a row per step: the
    loss, the loss scale and whether the step updated), the weights after, the Precision."""
    backbone, model, head, precision, opt, scheduler, progress = _parts(device, **parts)
    generator = torch.Generator().manual_seed(1)
    curve = []
    for _ in range(STEPS):
        batches = [
            (torch.randn(6, 3, 8, 8, generator=generator).to(device),
             torch.randint(0, NUM_CLASSES, (6,), generator=generator).to(device))
            for _ in range(micro)
        ]  # fmt: skip
        result = step(model, head, batches, opt, precision, clip)
        scheduler.step()
        progress["step"] += 1
        # Each step's loss, loss scale (1 without a scaler) and whether it stepped.
        curve.append(torch.stack([result.loss, result.scale, result.stepped]).float())
    weights = [t.detach().clone() for t in [*backbone.parameters(), *head.parameters()]]
    return torch.stack(curve).cpu(), weights, precision


CASES = {
    "O0 fp32, sgd, clip": dict(level="O0"),
    "O1 bf16, sgd, no clip": dict(level="O1", clip=None),
    "O2 bf16 (masters), sgd, clip": dict(level="O2"),
    "O0, 2 micro-batches": dict(level="O0", micro=2),
    "O0, adamw": dict(level="O0", optimizer="adamw"),
    # The loss scale doubles after every good step from 256 and overflows fp16 at 1,024: the
    # replayed steps grow it, back it off and skip their updates as the eager ones do.
    "O1 fp16, loss scale growing and backing off": dict(
        level="O1", dtype="fp16", init_scale=256.0, growth_interval=1
    ),
    "O2 fp16 (masters), loss scale growing and backing off": dict(
        level="O2", dtype="fp16", init_scale=256.0, growth_interval=1
    ),
}


def _eager_and_replayed(**kwargs):
    """`_train` eagerly, then with GraphedStep on the stand-in graph (2 eager steps, the
    capture, 6 replays): the replayed run's curve and weights, after checking its curve is
    the eager one bit for bit, and the eager run's weights."""
    cpu = torch.device("cpu")
    eager_curve, eager_weights, _ = _train(train_step, cpu, **kwargs)
    graphed_step = GraphedStep(train_step, warmup=2, graph=TapeGraph)
    curve, weights, _ = _train(graphed_step, cpu, **kwargs)
    assert (graphed_step.captures, graphed_step.replays) == (1, STEPS - 2)
    assert torch.equal(curve, eager_curve), (curve, eager_curve)
    return curve, weights, eager_weights


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_steps_match_the_eager_steps_bit_for_bit(case):
    kwargs = CASES[case]
    curve, weights, eager_weights = _eager_and_replayed(**kwargs)
    if kwargs.get("dtype") == "fp16":
        replayed = curve[3:]  # after the 2 eager steps and the capture's
        assert set(replayed[:, 2].tolist()) == {0.0, 1.0}, "steps skipped and taken, replayed"
        assert len(set(replayed[:, 1].tolist())) >= 3, "the scale grown and backed off"
    for ours, theirs in zip(weights, eager_weights, strict=True):
        if kwargs.get("optimizer") == "adamw":
            # Replayed, AdamW reads its rate from a float32 tensor, eager from a Python float
            # (fused SGD rounds both to float32 alike): 1e-7 apart.
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_the_triton_head_with_its_fused_update_replays_its_eager_steps(level):
    """The head's kernels (Triton's interpreter) in the captured step, the fused update
    reading its rate from the device tensor the capture hands it: the eager curve and
    weights, bit for bit, the rate changing at every step."""
    _, weights, eager_weights = _eager_and_replayed(level=level, clip=None, fused_update=True)
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights, strict=True))


def _phased_tape(state: dict) -> type[TapeGraph]:
    """The stand-in graph, writing into state["phase"] where the run is: "warm-up" (the eager
    steps, until the capture), "capture", then "replays"."""
    state["phase"] = "warm-up"

    class PhasedTape(TapeGraph):
        @contextlib.contextmanager
        def capture(self):
            state["phase"] = "capture"
            try:
                with super().capture():
                    yield
            finally:
                state["phase"] = "replays"

    return PhasedTape


def test_every_kernel_variant_the_capture_launches_was_launched_before_it(monkeypatch):
    """A capture cannot compile or load a kernel, and on a GPU the first launch of a Triton
    variant does both: the eager steps before it launch every variant of the head's kernels
    that the capture launches - the fused update reading its rate from a device tensor
    included - with the same constants and the same kinds of arguments."""
    import importlib

    from graph_tape import LAUNCHING_MODULES

    state = {"warm-up": set(), "capture": set()}

    def variant(kernel, args, kwargs) -> tuple:
        kinds = tuple(str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
                      for a in args)  # fmt: skip
        return getattr(kernel, "__name__", str(kernel)), kinds, tuple(sorted(kwargs.items()))

    for name in LAUNCHING_MODULES:
        module = importlib.import_module(name)

        def launch(kernel, grid, *args, _original=module.launch, **kwargs):
            if state["phase"] != "replays":  # the replays relaunch through here too
                state[state["phase"]].add(variant(kernel, args, kwargs))
            return _original(kernel, grid, *args, **kwargs)

        monkeypatch.setattr(module, "launch", launch)

    graphed_step = GraphedStep(train_step, warmup=2, graph=_phased_tape(state))
    _train(graphed_step, torch.device("cpu"), level="O1", clip=None, fused_update=True)
    assert graphed_step.captures == 1 and state["capture"]
    assert state["capture"] <= state["warm-up"], state["capture"] - state["warm-up"]


def test_the_capture_steps_under_the_global_state_the_steps_before_it_compiled_under():
    """torch.compile guards on global state (grad mode, autocast and its cache setting, ...)
    and compiles again where it differs, which a CUDA capture cannot do (on the H200 the
    compiled step's capture failed). The capture turns autocast's cache off: the backbone's
    forward in the capture passes the global-state guard (Dynamo's own) of its forward in the
    last eager step. Checked by a hook: under the stand-in's recording mode Dynamo does not
    compile at all."""
    from torch._C._dynamo.guards import GlobalStateGuard

    state = {"guard": None, "failed": None, "checked": 0}
    tape = _phased_tape(state)

    def before_forward(module, inputs):
        if state["phase"] == "warm-up":
            state["guard"] = GlobalStateGuard()
        elif state["phase"] == "capture":
            state["checked"] += 1
            if not state["guard"].check():
                state["failed"] = state["guard"].reason()

    cpu = torch.device("cpu")
    eager_curve, _, _ = _train(train_step, cpu, level="O1")
    # On every module's forward: the backbone _parts builds is the one nn.Sequential.
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, inputs: before_forward(module, inputs)
        if isinstance(module, nn.Sequential) else None
    )  # fmt: skip
    try:
        graphed_step = GraphedStep(train_step, warmup=2, graph=tape)
        curve, _, _ = _train(graphed_step, cpu, level="O1")
    finally:
        handle.remove()
    assert graphed_step.captures == 1 and state["checked"] == 1
    assert state["failed"] is None, f"the capture's global state differs: {state['failed']}"
    assert torch.equal(curve, eager_curve), (curve, eager_curve)


def test_the_stand_in_freezes_what_python_held_at_capture(monkeypatch):
    """The check has teeth: with the learning rates left as floats, the replayed steps keep
    the capture's rate, as a CUDA graph would, and drift from the eager ones."""
    cpu = torch.device("cpu")
    eager_losses, _, _ = _train(train_step, cpu)
    monkeypatch.setattr(graphed, "_tensor_lrs", lambda optimizer, lrs: contextlib.nullcontext())
    losses, _, _ = _train(GraphedStep(train_step, warmup=2, graph=TapeGraph), cpu)
    assert torch.equal(losses[:4], eager_losses[:4])  # 2 eager, the capture's, and one more
    assert not torch.equal(losses, eager_losses)


def test_a_new_kind_of_step_is_captured_again():
    """train.head_only_steps: the backbone held for 4 steps, then trained: two graphs, the
    eager curve."""
    cpu = torch.device("cpu")
    eager_losses, eager_weights, _ = _train(train_step, cpu, head_only=4)
    graphed_step = GraphedStep(train_step, warmup=1, graph=TapeGraph)
    losses, weights, _ = _train(graphed_step, cpu, head_only=4)
    assert graphed_step.captures == 2
    assert graphed_step.replays == STEPS - 2
    assert torch.equal(losses, eager_losses)
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights, strict=True))


def test_results_are_copies_the_next_replay_leaves_alone():
    _, model, head, precision, opt, _, _ = _parts(torch.device("cpu"), "O0", "bf16", "sgd")
    graphed_step = GraphedStep(train_step, warmup=0, graph=TapeGraph)
    batch = [(torch.randn(6, 3, 8, 8), torch.randint(0, NUM_CLASSES, (6,)))]
    first = graphed_step(model, head, batch, opt, precision, None)
    kept = first.loss.clone()
    graphed_step(model, head, [(torch.randn(6, 3, 8, 8), batch[0][1])], opt, precision, None)
    assert torch.equal(first.loss, kept)


def test_a_step_that_reads_the_host_stops_the_run_naming_the_setting():
    def reading_step(model, head, micro_batches, optimizer, precision, clip):
        result = train_step(model, head, micro_batches, optimizer, precision, clip)
        if result.loss.item() > 1e9:  # a host read: a capturing stream refuses it
            pass
        return result

    _, model, head, precision, opt, _, _ = _parts(torch.device("cpu"), "O0", "bf16", "sgd")
    graphed_step = GraphedStep(reading_step, warmup=1, graph=TapeGraph)
    batch = [(torch.randn(6, 3, 8, 8), torch.randint(0, NUM_CLASSES, (6,)))]
    graphed_step(model, head, batch, opt, precision, None)  # eager: reading is allowed
    with pytest.raises(GraphCaptureError, match="train.cuda_graphs=false"):
        graphed_step(model, head, batch, opt, precision, None)


@pytest.mark.parametrize(
    ("sample_rate", "world", "device", "fused", "expected"),
    [
        (1.0, 1, "cpu", True, "not on a GPU"),
        (1.0, 2, "cuda", True, "several processes"),
        (0.5, 1, "cuda", True, "partial FC"),
        (1.0, 1, "cuda", False, "no fused kernel"),
        (1.0, 1, "cuda", True, None),
    ],
)  # fmt: skip
def test_where_graphs_do_not_apply_the_run_says_why(sample_rate, world, device, fused, expected):
    cfg = load_config("ms1m_arcface", [f"head.sample_rate={sample_rate}"])
    head = build_head(cfg.head, 20, 16, seed=0)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, fused=fused or None, foreach=False)
    reason = refusal(head, optimizer, torch.device(device), world)
    assert reason == expected if expected is None else expected in reason


def test_config_refuses_graphs_inside_reduce_overhead():
    with pytest.raises(ConfigError, match="train.cuda_graphs"):
        load_config(
            "default",
            ["train.cuda_graphs=true", "train.compile=true", "train.compile_mode=reduce-overhead"],
        )


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


RUNS = {
    "default": (),
    "O1, Triton head, fused update": ("precision.level=O1", "head.kernel=triton",
                                      "head.fused_update=true", "optim.grad_clip=null"),
}  # fmt: skip


@pytest.mark.parametrize("run", list(RUNS))
def test_a_run_with_graphs_logs_the_curve_of_the_eager_run(tmp_path, monkeypatch, run):
    """train() end to end (loop, hooks, log window, an IResNet) with the stand-in graph in
    place of CUDA's: the same losses as train.cuda_graphs=false."""
    root = make_image_folder(tmp_path / "data")
    # A log line every 4 steps: the log window keeps 4 steps' results before it reads them.
    common = ("train.max_steps=8", "train.log_every=4", *RUNS[run])
    train(tiny_config(root, tmp_path / "eager", *common))
    monkeypatch.setattr(graphed, "CudaGraph", TapeGraph)  # a CPU's graph
    train(tiny_config(root, tmp_path / "graphs", *common, "train.cuda_graphs=true"))
    assert "captured the training step" in (tmp_path / "graphs" / "train.log").read_text()
    assert _losses(tmp_path / "graphs") == _losses(tmp_path / "eager")
    assert len(_losses(tmp_path / "eager")) == 2


def test_on_a_cpu_the_run_says_graphs_are_off(tmp_path):
    root = make_image_folder(tmp_path / "data")
    train(tiny_config(root, tmp_path / "run", "train.max_steps=2", "train.cuda_graphs=true"))
    assert "train.cuda_graphs: off: not on a GPU" in (tmp_path / "run" / "train.log").read_text()


CUDA_CASES = {
    "O1 bf16, sgd, no clip": CASES["O1 bf16, sgd, no clip"],
    "O2 bf16 (masters), sgd, clip": CASES["O2 bf16 (masters), sgd, clip"],
    "O0, adamw": CASES["O0, adamw"],
    "O1 fp16, loss scale growing and backing off": CASES[
        "O1 fp16, loss scale growing and backing off"
    ],
    "O1 bf16, triton head, fused update": dict(level="O1", clip=None, fused_update=True),
}


@needs_cuda
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_graph_steps_match_the_eager_steps(case):
    kwargs = CUDA_CASES[case]
    cuda = torch.device("cuda")
    eager_losses, eager_weights, _ = _train(train_step, cuda, **kwargs)
    graphed_step = GraphedStep(train_step)
    losses, weights, _ = _train(graphed_step, cuda, **kwargs)
    assert graphed_step.captures == 1
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(weights, eager_weights, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_a_gpu_run_with_graphs_logs_the_curve_of_the_eager_run(tmp_path):
    """Bit for bit, in deterministic mode: without it two eager runs differ already (cuDNN's
    backward kernels add with atomics), and this tiny run at lr 0.1 is chaotic (inputs moved
    by 1e-4 move its 4th loss by 12 %, tests/test_engine.py), so any tolerance loose enough
    for that would hide a wrong rate or a stale batch. On the H200, 1e-4 apart without it
    failed. head.kernel=torch: auto chooses by timing, which may differ between two runs."""
    root = make_image_folder(tmp_path / "data")
    runs = {}
    for name, extra in (("eager", ()), ("graphs", ("train.cuda_graphs=true",))):
        overrides = ("train.max_steps=8", "train.log_every=4", "train.device=cuda",
                     "train.deterministic=true", "head.kernel=torch", *extra)  # fmt: skip
        train(tiny_config(root, tmp_path / name, *overrides))
        runs[name] = _losses(tmp_path / name)
    assert "captured the training step" in (tmp_path / "graphs" / "train.log").read_text()
    assert len(runs["eager"]) == 2
    assert runs["graphs"] == runs["eager"]


def test_the_run_planner_plans_the_eager_step(tmp_path, caplog):
    """train.py --plan and the memory check plan the eager step with graphs on (a captured
    step holds the same step's memory in its graph's pool), and say nothing of graphs."""
    from recognition.training.plan.rank import plan_rank

    root = make_image_folder(tmp_path / "data")
    caplog.set_level(logging.INFO)
    plans = [
        plan_rank(tiny_config(root, tmp_path / "run", *extra), 12, 1, 0, detailed=False).peak
        for extra in ((), ("train.cuda_graphs=true",))
    ]
    assert plans[0] == plans[1] > 0
    assert "cuda_graphs" not in caplog.text
