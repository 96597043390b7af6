"""Tests for recognition/precision/: casts, masters, loss scaling, clipping, checkpoints."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from recognition.config import OptimConfig
from recognition.optim import build_optimizer
from recognition.precision import Precision, StepResult

CPU = torch.device("cpu")
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Every level with both half dtypes; O0 ignores the dtype so one entry is enough.
COMBOS = [("O0", "fp16")] + [(lvl, dt) for lvl in ("O1", "O2", "O3") for dt in ("fp16", "bf16")]
NUM_CLASSES = 4


class TinyNet(nn.Module):
    """conv + BN + PReLU + pooled linear + BN1d: every kind of layer the casts treat apart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.PReLU(8)
        self.fc = nn.Linear(8, 6)
        self.bn1d = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.conv(x)))  # (B, 8, H, W)
        return self.bn1d(self.fc(x.mean(dim=(2, 3))))  # (B, 6)


class TinyHead(nn.Module):
    """A margin-head stand-in: a bare nn.Parameter class matrix, cosine logits."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(NUM_CLASSES, 6) * 0.1)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        # The real head accumulates its softmax statistics in fp32; so does this one.
        logits = F.linear(F.normalize(embeddings), F.normalize(self.weight))
        return 8.0 * logits.float()  # (B, C)


def make_data(seed: int = 0, num_samples: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed classification problem: labels from a random linear teacher on pooled pixels."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, 6, 6, generator=gen)
    teacher = torch.randn(3, NUM_CLASSES, generator=gen)
    labels = (images.mean(dim=(2, 3)) @ teacher).argmax(dim=1)
    return images, labels


def build(level: str, dtype: str, seed: int = 0, lr: float = 0.1, momentum: float = 0.9, **kw):
    """Model, head, precision and SGD, wired in the order the training loop uses."""
    torch.manual_seed(seed)
    model, head = TinyNet(), TinyHead()
    precision = Precision(level, dtype, CPU, **kw)
    precision.prepare(model, head)
    groups = [
        {"params": list(model.parameters()), "weight_decay": 1e-4},
        {"params": list(head.parameters()), "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(precision.param_groups(groups), lr=lr, momentum=momentum)
    return model, head, precision, optimizer


def compute_loss(model, head, precision, images, labels) -> torch.Tensor:
    with precision.autocast():
        logits = head(model(precision.cast_inputs(images)))
    return F.cross_entropy(logits.float(), labels)


def train_step(model, head, precision, optimizer, images, labels, num_micro=1, **kw) -> StepResult:
    for micro_images, micro_labels in zip(
        images.chunk(num_micro), labels.chunk(num_micro), strict=True
    ):
        loss = compute_loss(model, head, precision, micro_images, micro_labels)
        precision.backward(loss / num_micro)
    result = precision.step(optimizer, **kw)
    return result


def optimizer_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def reference_grads(model, head, images, labels, num_micro) -> list[torch.Tensor]:
    """float64 gradients of the same micro-batches, in model-then-head parameter order."""
    model64, head64 = copy.deepcopy(model).double(), copy.deepcopy(head).double()
    for micro_images, micro_labels in zip(
        images.chunk(num_micro), labels.chunk(num_micro), strict=True
    ):
        logits = head64(model64(micro_images.double()))
        (F.cross_entropy(logits, micro_labels) / num_micro).backward()
    return [p.grad for p in list(model64.parameters()) + list(head64.parameters())]


# ------------------------------------------------------------------------- construction


def test_bad_arguments_name_the_key() -> None:
    with pytest.raises(ValueError, match="precision.level"):
        Precision("O4", "fp16", CPU)
    with pytest.raises(ValueError, match="precision.dtype"):
        Precision("O1", "fp32", CPU)
    with pytest.raises(ValueError, match="move the module"):
        Precision("O3", "bf16", torch.device("meta")).prepare(TinyNet())


def test_scaler_only_for_fp16_o1_o2() -> None:
    for level, dtype in COMBOS:
        has_scaler = Precision(level, dtype, CPU).scaler is not None
        assert has_scaler == (dtype == "fp16" and level in ("O1", "O2")), (level, dtype)
    assert Precision("O0", "bf16", CPU).compute_dtype == torch.float32
    assert Precision("O1", "bf16", CPU).compute_dtype == torch.bfloat16


@pytest.mark.parametrize(("level", "dtype"), COMBOS)
def test_prepare_dtypes(level: str, dtype: str) -> None:
    model, head, precision, optimizer = build(level, dtype)
    half = HALF[dtype]
    weights_dtype = half if level in ("O2", "O3") else torch.float32
    bn_dtype = half if level == "O3" else torch.float32
    for layer in (model.conv, model.act, model.fc, head):
        for param in layer.parameters():
            assert param.dtype == weights_dtype
    for bn in (model.bn, model.bn1d):
        for tensor in (bn.weight, bn.bias, bn.running_mean, bn.running_var):
            assert tensor.dtype == bn_dtype
        assert bn.num_batches_tracked.dtype == torch.int64
    # The optimizer's parameters are fp32 except under O3 (no masters).
    owned_dtype = half if level == "O3" else torch.float32
    assert all(p.dtype == owned_dtype for p in optimizer_params(optimizer))


def test_o2_optimizer_owns_fp32_masters() -> None:
    model, head, precision, optimizer = build("O2", "fp16")
    model_params = list(model.parameters()) + list(head.parameters())
    owned = optimizer_params(optimizer)
    assert len(owned) == len(model_params)
    for param, master in zip(model_params, owned, strict=True):
        assert master.dtype == torch.float32
        # The half weight is its master rounded (the master keeps the fp32 value it had).
        assert torch.equal(master.to(param.dtype), param)
        # Half weights get a separate master; fp32 BatchNorm weights are their own.
        assert (master is param) == (param.dtype == torch.float32)
    assert sum(m is not p for p, m in zip(model_params, owned, strict=True)) == 5
    # Other keys of each group survive the mapping.
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 0.0]


def test_o2_masters_keep_the_fp32_weights_the_module_had() -> None:
    # A loaded backbone (train.init_backbone) must not lose its fp32 bits to the half cast.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    precision = Precision("O2", "bf16", CPU)
    precision.prepare(model)
    optimizer = torch.optim.SGD(precision.param_groups([{"params": model.parameters()}]), lr=0.1)
    for (name, param), master in zip(
        model.named_parameters(), optimizer_params(optimizer), strict=True
    ):
        assert torch.equal(master, before[name]), name
        assert param.dtype == (torch.float32 if name.startswith("1.") else torch.bfloat16)
    assert not torch.equal(model[0].weight.float(), before["0.weight"])  # rounded


def test_o2_rejects_unprepared_params_and_wrong_optimizer() -> None:
    model, head, precision, _ = build("O2", "fp16")
    with pytest.raises(ValueError, match="prepare"):
        precision.param_groups([{"params": nn.Linear(2, 2).parameters()}])
    wrong = torch.optim.SGD(list(model.parameters()), lr=0.1)
    images, labels = make_data()
    precision.backward(compute_loss(model, head, precision, images, labels))
    with pytest.raises(ValueError, match="param_groups"):
        precision.step(wrong)


def test_autocast_and_inputs() -> None:
    x = torch.randn(4, 5)
    linear = nn.Linear(5, 3)
    for dtype in ("fp16", "bf16"):
        with Precision("O1", dtype, CPU).autocast():
            assert linear(x).dtype == HALF[dtype]  # the matmul ran in half
            assert torch.softmax(x, dim=1).dtype == torch.float32
        assert Precision("O1", dtype, CPU).cast_inputs(x).dtype == torch.float32
        assert Precision("O2", dtype, CPU).cast_inputs(x).dtype == HALF[dtype]
        assert Precision("O3", dtype, CPU).cast_inputs(x).dtype == HALF[dtype]
    with Precision("O0", "fp16", CPU).autocast():
        assert linear(x).dtype == torch.float32
    with Precision("O3", "fp16", CPU).autocast():
        assert not torch.is_autocast_enabled("cpu")
    labels = torch.tensor([1, 2])
    assert Precision("O3", "fp16", CPU).cast_inputs(labels).dtype == torch.int64


# ------------------------------------------------------------------------- stepping


@pytest.mark.parametrize(("level", "dtype"), COMBOS)
def test_loss_falls(level: str, dtype: str) -> None:
    """20 steps of two accumulated micro-batches each lower the loss at every level."""
    model, head, precision, optimizer = build(level, dtype)
    images, labels = make_data()
    losses = []
    num_stepped = 0
    for _ in range(20):
        with torch.no_grad():
            losses.append(compute_loss(model, head, precision, images, labels).item())
        result = train_step(model, head, precision, optimizer, images, labels, num_micro=2)
        num_stepped += result.stepped
        precision.zero_grad(optimizer)
    with torch.no_grad():
        final = compute_loss(model, head, precision, images, labels).item()
    assert math.isfinite(final)
    assert final < 0.6 * losses[0], (losses[0], final)
    # fp16 with the default first scale 2**16 may skip its first steps while the scale backs off.
    assert num_stepped >= (15 if precision.scaler is not None else 20)


@pytest.mark.parametrize(("level", "dtype"), [("O1", "fp16"), ("O2", "fp16")])
def test_fp16_overflow_skips_step_and_halves_scale(level: str, dtype: str) -> None:
    model, head, precision, optimizer = build(level, dtype, init_scale=1024.0)
    images, labels = make_data()
    good = train_step(model, head, precision, optimizer, images, labels)
    assert good.stepped and good.scale == 1024.0  # growth_interval 2000: no growth yet
    if level == "O2":
        for _, param, master in precision.masters():
            assert torch.equal(param, master.to(param.dtype))
    precision.zero_grad(optimizer)

    before_params = [p.detach().clone() for p in optimizer_params(optimizer)]
    before_model = [p.detach().clone() for p in model.parameters()]
    before_state = copy.deepcopy(optimizer.state_dict())
    loss = compute_loss(model, head, precision, images, labels)
    precision.backward(loss * float("inf"))
    bad = precision.step(optimizer)
    assert not bad.stepped
    assert not math.isfinite(bad.grad_norm)
    assert bad.scale == 512.0
    for before, param in zip(before_params, optimizer_params(optimizer), strict=True):
        assert torch.equal(before, param)
    for before, param in zip(before_model, model.parameters(), strict=True):
        assert torch.equal(before, param)
    after_state = optimizer.state_dict()
    for index, state in before_state["state"].items():
        assert torch.equal(state["momentum_buffer"], after_state["state"][index]["momentum_buffer"])


@pytest.mark.parametrize(("level", "dtype"), [("O0", "fp16"), ("O1", "bf16"), ("O3", "fp16")])
def test_nan_grads_skip_step_without_scaler(level: str, dtype: str) -> None:
    model, head, precision, optimizer = build(level, dtype)
    images, labels = make_data()
    before = [p.detach().clone() for p in optimizer_params(optimizer)]
    precision.backward(compute_loss(model, head, precision, images, labels) * float("nan"))
    result = precision.step(optimizer)
    assert not result.stepped and result.scale == 1.0
    for b, p in zip(before, optimizer_params(optimizer), strict=True):
        assert torch.equal(b, p)


# The project's optimizers: fused where torch computes them right (see
# recognition.optim.fused_is_sound), so that they skip on the device.
FUSED = {
    "sgd": lambda groups: build_optimizer(groups, OptimConfig(name="sgd", lr=0.1)),
    "adamw": lambda groups: build_optimizer(groups, OptimConfig(name="adamw", lr=0.01)),
}


def build_fused(level: str, dtype: str, name: str):
    """`build` with a fused optimizer (as recognition.optim makes them): it skips on the
    device."""
    model, head, precision, _ = build(level, dtype, init_scale=2.0**10)
    groups = [
        {"params": list(model.parameters()), "weight_decay": 1e-4},
        {"params": list(head.parameters()), "weight_decay": 0.0},
    ]
    return model, head, precision, FUSED[name](precision.param_groups(groups))


def trained_state(model, optimizer) -> list[torch.Tensor]:
    """Every parameter (model and optimizer's) and optimizer state tensor, cloned."""
    tensors = [p.detach().clone() for p in optimizer_params(optimizer) + list(model.parameters())]
    for param in optimizer_params(optimizer):
        state = optimizer.state.get(param, {})
        tensors += [state[k].clone() for k in sorted(state) if torch.is_tensor(state[k])]
    return tensors


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize(("level", "dtype"), COMBOS)
def test_fused_optimizer_skips_on_the_device_from_its_first_step(level, dtype, name) -> None:
    """A NaN loss on the very first step, then a finite loss flagged not finite: neither
    moves a parameter or any optimizer state (fused SGD would keep uninitialised momentum
    after a skipped first step), and the flags are device tensors. Without loss scaling,
    the next good step is then exactly a fresh optimizer's first step."""
    images, labels = make_data()
    model, head, precision, optimizer = build_fused(level, dtype, name)
    start = trained_state(model, optimizer)
    precision.backward(compute_loss(model, head, precision, images, labels) * float("nan"))
    result = precision.step(optimizer, max_grad_norm=1.0)
    assert torch.is_tensor(result.stepped) and result.stepped.dtype == torch.bool
    assert not result.stepped and not torch.isfinite(result.grad_norm)
    precision.zero_grad(optimizer)
    # State made for the skip is a fresh optimizer's: zero momentum, zero moments, step 0.
    skipped = trained_state(model, optimizer)
    for before, after in zip(start, skipped, strict=False):
        assert torch.equal(before, after)
    for extra in skipped[len(start) :]:
        assert not extra.any()

    precision.backward(compute_loss(model, head, precision, images, labels))
    result = precision.step(optimizer, finite=torch.tensor(False))
    assert not result.stepped and torch.isfinite(result.grad_norm)
    precision.zero_grad(optimizer)
    for before, after in zip(skipped, trained_state(model, optimizer), strict=True):
        assert torch.equal(before, after)

    if precision.scaler is not None:  # the NaN gradients halved the scale: other rounding
        assert float(result.scale) == 2.0**9
        return
    fresh_model, fresh_head, fresh_precision, fresh_optimizer = build_fused(level, dtype, name)
    fresh = (fresh_model, fresh_head, fresh_precision, fresh_optimizer)
    for parts in ((model, head, precision, optimizer), fresh):
        assert train_step(*parts, images, labels).stepped
    for mine, fresh in zip(
        trained_state(model, optimizer), trained_state(fresh_model, fresh_optimizer), strict=True
    ):
        assert torch.equal(mine, fresh)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host_read"])
def test_the_optimizer_steps_at_the_float32_value_of_its_rate(fused) -> None:
    """A captured step (recognition.training.graphed) reads its rates from float32 device
    tensors; on a GPU torch's fused kernels take a float rate as a double, so 0.1 and 0.1f
    move some weights by their last bit differently, and the eager step must step at the
    float32 value too for the two to be one function. The schedule's floats come back."""
    images, labels = make_data()
    if fused:
        model, head, precision, optimizer = build_fused("O1", "bf16", "sgd")
    else:  # plain SGD: stepped after a host read of the flag
        model, head, precision, optimizer = build("O1", "bf16")
    rates = [0.1, 1 / 3]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    seen = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([group["lr"] for group in opt.param_groups])
    )
    assert train_step(model, head, precision, optimizer, images, labels).stepped
    # What a tensor of the rate holds (a captured step's), and not the float itself.
    as_tensors = [torch.full((), rate, dtype=torch.float32).item() for rate in rates]
    assert seen == [as_tensors] and as_tensors != rates
    assert [group["lr"] for group in optimizer.param_groups] == rates


def test_o2_grads_reach_masters_and_zero_grad_clears_both() -> None:
    model, head, precision, optimizer = build("O2", "bf16", lr=0.0)
    images, labels = make_data()
    # Two steps without zero_grad: the masters mirror the model's accumulated grads each time.
    train_step(model, head, precision, optimizer, images, labels)
    train_step(model, head, precision, optimizer, images, labels)
    for _, param, master in precision.masters():
        assert master.grad is not None and master.grad.dtype == torch.float32
        if master is not param:
            assert torch.equal(master.grad, param.grad.float())
            # The copy is a plain gradient, not a node of the graph over the masters.
            assert not master.grad.requires_grad and master.grad.grad_fn is None
    precision.zero_grad(optimizer)
    for _, param, master in precision.masters():
        assert param.grad is None and master.grad is None


class _OpCount(TorchDispatchMode):
    """Counts the operations that do work: allocations (`empty_like`, no kernel) aside."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ != "empty_like"
        return func(*args, **(kwargs or {}))


def _o2_step_ops(num_layers: int) -> list[int]:
    """Aten operations (allocations aside) that O2's step() dispatches for `num_layers`
    Linear layers, in a first and a second step (the masters' gradients then exist and are
    copied in place)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(num_layers)])
    precision = Precision("O2", "bf16", CPU)
    precision.prepare(model)
    groups = precision.param_groups([{"params": list(model.parameters())}])
    optimizer = torch.optim.SGD(groups, lr=0.1, foreach=True)
    x = torch.randn(2, 4)
    counts = []
    for _ in range(2):
        with precision.autocast():
            loss = model(precision.cast_inputs(x)).float().square().mean()
        precision.backward(loss)
        counter = _OpCount()
        with counter:
            precision.step(optimizer)
        counts.append(counter.count)
    return counts


def test_o2_step_dispatches_the_same_operations_for_any_number_of_parameters() -> None:
    # The half gradients go to the masters and the masters back to the model in multi-tensor
    # operations: a loop of copies per parameter (a kernel each on a GPU) would grow with
    # the model.
    few, many = _o2_step_ops(2), _o2_step_ops(12)
    assert few == many, (few, many)


def test_norm_of_large_fp16_grads_does_not_overflow() -> None:
    """Each grad fits fp16 but their total norm (> 65504) does not: it is summed in fp32."""
    model, head, precision, optimizer = build("O3", "fp16", lr=0.0)
    for param in optimizer_params(optimizer):
        param.grad = torch.full_like(param, 1e4)
    num_elements = sum(p.numel() for p in optimizer_params(optimizer))
    result = precision.step(optimizer)
    assert result.stepped
    assert result.grad_norm == pytest.approx(1e4 * math.sqrt(num_elements), rel=1e-3)


@pytest.mark.parametrize(
    ("level", "dtype", "rtol"),
    [("O0", "fp16", 1e-5), ("O1", "fp16", 0.05), ("O2", "fp16", 0.05), ("O3", "bf16", 0.1)],
)
def test_clipping_uses_unscaled_norm(level: str, dtype: str, rtol: float) -> None:
    """The reported norm matches a float64 reference; clipping brings it to max_grad_norm."""
    # A moderate first scale: 2**16 overflows on the first step, which GradScaler then skips.
    model, head, precision, optimizer = build(
        level, dtype, lr=1.0, momentum=0.0, init_scale=2.0**10
    )
    images, labels = make_data()
    ref = reference_grads(model, head, images, labels, num_micro=2)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref]))
    max_norm = float(ref_norm) / 4
    before = [p.detach().double().clone() for p in optimizer_params(optimizer)]

    result = train_step(
        model, head, precision, optimizer, images, labels, num_micro=2, max_grad_norm=max_norm
    )
    assert result.stepped
    assert result.grad_norm == pytest.approx(float(ref_norm), rel=rtol)
    grads = [p.grad.double() for p in optimizer_params(optimizer)]
    clipped_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads])
    )
    assert float(clipped_norm) == pytest.approx(max_norm, rel=1e-2)
    # Clipping scales every gradient by the same factor: direction matches the reference.
    flat, flat_ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref])
    assert F.cosine_similarity(flat, flat_ref, dim=0) > 0.99
    # SGD with lr 1 moved the optimizer's parameters by the clipped gradient (+ weight decay).
    if level != "O3":  # O3 rounds the update itself to bf16
        decays = [g["weight_decay"] for g in optimizer.param_groups for _ in g["params"]]
        for b, p, g, wd in zip(before, optimizer_params(optimizer), grads, decays, strict=True):
            torch.testing.assert_close(p.double(), b - g - wd * b, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_restores_scale_and_masters() -> None:
    model, head, precision, optimizer = build("O2", "fp16", lr=0.01, init_scale=8.0)
    precision.scaler._growth_interval = 2  # let the scale move within a few steps
    images, labels = make_data()
    for _ in range(5):
        train_step(model, head, precision, optimizer, images, labels)
        precision.zero_grad(optimizer)
    saved = copy.deepcopy(precision.state_dict())
    saved_model = copy.deepcopy((model.state_dict(), head.state_dict(), optimizer.state_dict()))
    assert saved["scaler"]["scale"] != 8.0
    # The half model alone would not give the masters back.
    assert any(
        not torch.equal(m.to(p.dtype).float(), m) for _, p, m in precision.masters() if m is not p
    )

    model2, head2, precision2, optimizer2 = build("O2", "fp16", seed=1, lr=0.01)
    model2.load_state_dict(saved_model[0])
    head2.load_state_dict(saved_model[1])
    optimizer2.load_state_dict(saved_model[2])
    precision2.load_state_dict(saved)
    assert precision2.scaler.state_dict() == saved["scaler"]
    for (key, param, master), (key2, param2, master2) in zip(
        precision.masters(), precision2.masters(), strict=True
    ):
        assert key == key2
        assert torch.equal(master, master2) and torch.equal(param, param2)

    # Both go on identically.
    for m, h, p, o in (
        (model, head, precision, optimizer),
        (model2, head2, precision2, optimizer2),
    ):
        train_step(m, h, p, o, images, labels)
    for (_, _, master), (_, _, master2) in zip(
        precision.masters(), precision2.masters(), strict=True
    ):
        assert torch.equal(master, master2)


def test_load_state_dict_errors() -> None:
    _, _, precision, _ = build("O2", "bf16")
    with pytest.raises(ValueError, match="no fp32 master"):
        precision.load_state_dict(Precision("O1", "bf16", CPU).state_dict())
    bad = precision.state_dict()
    bad["masters"]["9.extra"] = bad["masters"].pop("0.conv.weight")
    with pytest.raises(ValueError, match="missing"):
        precision.load_state_dict(bad)
    with pytest.raises(ValueError, match="scaler"):
        precision.load_state_dict({"masters": {}})


def test_fp32_state_dict_round_trip() -> None:
    model, head, precision, optimizer = build("O2", "bf16", lr=0.01)
    images, labels = make_data()
    for _ in range(3):
        train_step(model, head, precision, optimizer, images, labels)
        precision.zero_grad(optimizer)
    state = precision.fp32_state_dict(model)
    assert set(state) == set(model.state_dict())
    assert all(v.dtype == torch.float32 for k, v in state.items() if "num_batches" not in k)
    master_of = {id(p): m for _, p, m in precision.masters()}
    assert torch.equal(state["conv.weight"], master_of[id(model.conv.weight)])

    model2, _, precision2, _ = build("O2", "bf16", seed=3)
    precision2.load_fp32_state_dict(model2, state)
    master_of2 = {id(p): m for _, p, m in precision2.masters()}
    for name, param in model2.named_parameters():
        assert torch.equal(master_of2[id(param)], state[name])
        assert torch.equal(param, state[name].to(param.dtype))
