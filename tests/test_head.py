"""ShardedMarginSoftmax (one process) against a full-matrix float64 F.cross_entropy reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recognition.heads import margin_softmax
from recognition.heads.margin_softmax import ShardedMarginSoftmax, shard_range
from recognition.heads.margins import AMSoftmax, ArcFace, CombinedMargin, CosFace, SphereFace

PI = math.pi

# ---- reference: normalise, full cosine matrix, psi from acos, F.cross_entropy -----------


def psi_arcface(theta, m):
    return torch.where(theta + m <= PI, torch.cos(theta + m), torch.cos(theta) + math.cos(m) - 1)


def psi_sphereface(theta, m):
    k = torch.floor(m * theta / PI).detach()
    return (-1.0) ** k * torch.cos(m * theta) - 2 * k


def psi_combined(theta, m1, m2, m3):
    theta_b = (PI - m2) / m1
    main = torch.cos(m1 * theta + m2) - m3
    return torch.where(theta <= theta_b, main, torch.cos(theta) - math.cos(theta_b) - 1 - m3)


# (id, margin factory, s, psi(theta))
MARGIN_CASES = [
    ("arcface", lambda: ArcFace(), 64.0, lambda t: psi_arcface(t, 0.5)),
    ("cosface", lambda: CosFace(), 64.0, lambda t: torch.cos(t) - 0.4),
    ("am_softmax", lambda: AMSoftmax(), 30.0, lambda t: torch.cos(t) - 0.35),
    ("sphereface", lambda: SphereFace(s=16.0), 16.0, lambda t: psi_sphereface(t, 4)),
    (
        "combined",
        lambda: CombinedMargin(s=32.0, m1=1.35, m2=0.25, m3=0.1),
        32.0,
        lambda t: psi_combined(t, 1.35, 0.25, 0.1),
    ),
]
MARGIN_IDS = [case[0] for case in MARGIN_CASES]


def reference_loss(embeddings, weight, labels, scale, psi):
    """Loss and gradients (embeddings, weight) computed in float64 with F.cross_entropy."""
    embeddings = embeddings.detach().double().requires_grad_(True)
    weight = weight.detach().double().requires_grad_(True)
    cos = F.normalize(embeddings, dim=1) @ F.normalize(weight, dim=1).T  # (B, C)
    theta = torch.acos(cos.gather(1, labels[:, None]).squeeze(1))
    logits = cos.scatter(1, labels[:, None], psi(theta)[:, None]) * scale
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    correct = logits.argmax(dim=1) == labels
    return loss.detach(), embeddings.grad, weight.grad, correct.double().mean()


def run_head(head, embeddings, labels):
    embeddings = embeddings.detach().clone().requires_grad_(True)
    head.zero_grad()
    loss = head(embeddings, labels)
    loss.backward()
    return loss.detach(), embeddings.grad, head.weight.grad


def assert_close_rel(actual, expected, rel):
    """|actual - expected| <= rel * max|expected| elementwise (relative to the tensor's scale)."""
    actual = actual.double()
    tolerance = rel * expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= tolerance, f"max error {error:.3g} > {tolerance:.3g}"


def make_batch(num_classes, embedding_size, batch_size, seed, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(batch_size, embedding_size, generator=generator, dtype=dtype)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return embeddings, labels


# ---- shard_range -------------------------------------------------------------------------


def test_shard_range_split_rule():
    pairs = [(c, w) for c in range(0, 40) for w in range(1, 9)]
    pairs += [(1000, 7), (85742, 8), (93431, 64), (10, 10), (3, 5), (2_000_000, 3)]
    for num_classes, world_size in pairs:
        ranges = [shard_range(num_classes, world_size, r) for r in range(world_size)]
        counts = [count for _, count in ranges]
        assert max(counts) - min(counts) <= 1, (num_classes, world_size)
        remainder = num_classes % world_size
        larger = num_classes // world_size + 1
        assert all(counts[r] == larger for r in range(remainder)), (num_classes, world_size)
        assert all(counts[r] == larger - 1 for r in range(remainder, world_size))
        # Contiguous, in rank order, covering [0, num_classes) exactly once.
        assert ranges[0][0] == 0
        for (start, count), (next_start, _) in zip(ranges, ranges[1:], strict=False):
            assert start + count == next_start
        assert ranges[-1][0] + ranges[-1][1] == num_classes


def test_shard_range_examples():
    assert [shard_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [shard_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert shard_range(5, 1, 0) == (0, 5)


@pytest.mark.parametrize(
    ("args", "name"),
    [((10, 0, 0), "world_size"), ((10, 3, 3), "rank"), ((10, 3, -1), "rank"), ((-1, 2, 0), "num")],
)
def test_shard_range_rejects_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        shard_range(*args)


# ---- construction --------------------------------------------------------------------------


def test_single_process_owns_every_class_and_initialises_normal():
    torch.manual_seed(0)
    head = ShardedMarginSoftmax(2000, 64, ArcFace())
    assert (head.class_start, head.num_local, head.num_classes) == (0, 2000, 2000)
    assert head.weight.shape == (2000, 64)
    assert isinstance(head.weight, torch.nn.Parameter)
    assert abs(head.weight.mean().item()) < 1e-3
    assert head.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert head.last_accuracy is None


def test_world_size_above_one_is_not_implemented(monkeypatch):
    monkeypatch.setattr(margin_softmax.distributed, "world_size", lambda group=None: 2)
    with pytest.raises(NotImplementedError, match="world size 2"):
        ShardedMarginSoftmax(10, 8, ArcFace())


def test_sample_rate_below_one_is_not_implemented():
    with pytest.raises(NotImplementedError, match="head.sample_rate"):
        ShardedMarginSoftmax(10, 8, ArcFace(), sample_rate=0.5)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"sample_rate": 0.0}, "head.sample_rate"),
        ({"sample_rate": 1.5}, "head.sample_rate"),
        ({"chunk_size": 0}, "head.chunk_size"),
        ({"num_classes": 0}, "num_classes"),
        ({"embedding_size": 0}, "embedding_size"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, key):
    arguments = {"num_classes": 10, "embedding_size": 8, "margin": ArcFace(), **kwargs}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ShardedMarginSoftmax(**arguments)


@pytest.mark.parametrize(
    ("embeddings", "labels", "match"),
    [
        (torch.randn(4, 7), torch.tensor([0, 1, 2, 3]), "local_embeddings"),
        (torch.randn(4, 8, 1), torch.tensor([0, 1, 2, 3]), "local_embeddings"),
        (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), "empty"),
        (torch.randn(4, 8), torch.tensor([0, 1, 2]), "local_labels"),
        (torch.randn(4, 8), torch.tensor([0.0, 1.0, 2.0, 3.0]), "local_labels"),
        (torch.randn(4, 8), torch.tensor([0, 1, 2, 10]), "label 10"),
        (torch.randn(4, 8), torch.tensor([0, -1, 2, 3]), "label -1"),
    ],
)
def test_forward_rejects_bad_inputs(embeddings, labels, match):
    head = ShardedMarginSoftmax(10, 8, ArcFace())
    with pytest.raises(ValueError, match=match):
        head(embeddings, labels)


# ---- loss and gradients against the reference ---------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("case", MARGIN_CASES, ids=MARGIN_IDS)
def test_matches_reference_float64(case, chunk_size):
    _, make_margin, scale, psi = case
    torch.manual_seed(1)
    head = ShardedMarginSoftmax(23, 16, make_margin(), chunk_size=chunk_size).double()
    embeddings, labels = make_batch(23, 16, 12, seed=2)
    labels[:4] = 5  # duplicate labels: several rows share one class row
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    ref_loss, ref_grad_embeddings, ref_grad_weight, _ = reference_loss(
        embeddings, head.weight, labels, scale, psi
    )
    assert loss.dtype == torch.float64 and loss.shape == ()
    assert_close_rel(loss, ref_loss, 1e-10)
    assert_close_rel(grad_embeddings, ref_grad_embeddings, 1e-10)
    assert_close_rel(grad_weight, ref_grad_weight, 1e-10)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("case", MARGIN_CASES, ids=MARGIN_IDS)
def test_batch_of_one(case, chunk_size):
    _, make_margin, scale, psi = case
    torch.manual_seed(3)
    head = ShardedMarginSoftmax(7, 8, make_margin(), chunk_size=chunk_size).double()
    embeddings, labels = make_batch(7, 8, 1, seed=4)
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    ref_loss, ref_grad_embeddings, ref_grad_weight, _ = reference_loss(
        embeddings, head.weight, labels, scale, psi
    )
    assert_close_rel(loss, ref_loss, 1e-10)
    assert_close_rel(grad_embeddings, ref_grad_embeddings, 1e-10)
    assert_close_rel(grad_weight, ref_grad_weight, 1e-10)


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("case", MARGIN_CASES, ids=MARGIN_IDS)
def test_matches_reference_float32(case, chunk_size):
    _, make_margin, scale, psi = case
    torch.manual_seed(5)
    head = ShardedMarginSoftmax(37, 32, make_margin(), chunk_size=chunk_size)
    embeddings, labels = make_batch(37, 32, 16, seed=6, dtype=torch.float32)
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    ref_loss, ref_grad_embeddings, ref_grad_weight, _ = reference_loss(
        embeddings, head.weight, labels, scale, psi
    )
    assert loss.dtype == torch.float32
    assert grad_weight.dtype == torch.float32 and grad_embeddings.dtype == torch.float32
    assert_close_rel(loss, ref_loss, 1e-5)
    assert_close_rel(grad_embeddings, ref_grad_embeddings, 1e-5)
    assert_close_rel(grad_weight, ref_grad_weight, 1e-5)


def test_accuracy_matches_reference_argmax():
    torch.manual_seed(7)
    head = ShardedMarginSoftmax(20, 16, CosFace(s=10.0, m=0.2)).double()
    generator = torch.Generator().manual_seed(8)
    labels = torch.randint(0, 20, (64,), generator=generator)
    # Embeddings near their class rows, noisier for later rows: some right, some wrong.
    noise = torch.randn(64, 16, generator=generator, dtype=torch.float64)
    noise *= torch.linspace(0.0, 0.05, 64, dtype=torch.float64)[:, None]
    embeddings = head.weight.detach()[labels] + noise
    head(embeddings, labels)
    _, _, _, ref_accuracy = reference_loss(
        embeddings, head.weight, labels, 10.0, lambda t: torch.cos(t) - 0.2
    )
    assert 0.1 < ref_accuracy < 0.9  # the case is not trivial
    assert head.last_accuracy.dtype == torch.float64
    assert not head.last_accuracy.requires_grad
    assert head.last_accuracy.item() == pytest.approx(ref_accuracy.item(), abs=1e-12)


# ---- precision -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 6])
def test_bfloat16_embeddings_give_float32_loss(chunk_size):
    torch.manual_seed(9)
    head = ShardedMarginSoftmax(31, 32, ArcFace(), chunk_size=chunk_size)
    embeddings, labels = make_batch(31, 32, 16, seed=10, dtype=torch.bfloat16)
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    # The reference takes the same bfloat16 values: what remains is float32 arithmetic.
    ref_loss, ref_grad_embeddings, ref_grad_weight, _ = reference_loss(
        embeddings, head.weight, labels, 64.0, lambda t: psi_arcface(t, 0.5)
    )
    assert loss.dtype == torch.float32
    assert grad_embeddings.dtype == torch.bfloat16
    assert_close_rel(loss, ref_loss, 1e-5)
    assert_close_rel(grad_weight, ref_grad_weight, 1e-5)
    assert_close_rel(grad_embeddings, ref_grad_embeddings, 1e-2)  # rounded to bfloat16


@pytest.mark.parametrize("chunk_size", [None, 6])
def test_bfloat16_head_and_autocast_give_float32_loss(chunk_size):
    torch.manual_seed(11)
    embeddings, labels = make_batch(31, 32, 16, seed=12, dtype=torch.float32)
    half_head = ShardedMarginSoftmax(31, 32, CosFace(s=16.0), chunk_size=chunk_size)
    weight = half_head.weight.detach().clone()
    ref_loss, _, ref_grad_weight, _ = reference_loss(
        embeddings, weight, labels, 16.0, lambda t: torch.cos(t) - 0.4
    )
    # A half model (O2/O3): bfloat16 weight and embeddings, matmul in bfloat16.
    half_head.to(torch.bfloat16)
    loss, grad_embeddings, grad_weight = run_head(half_head, embeddings.to(torch.bfloat16), labels)
    assert loss.dtype == torch.float32
    assert grad_weight.dtype == torch.bfloat16 and torch.isfinite(grad_weight).all()
    assert torch.isfinite(grad_embeddings).all()
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item()
    # Autocast (O1): float32 weight and inputs, matmul in bfloat16.
    head = ShardedMarginSoftmax(31, 32, CosFace(s=16.0), chunk_size=chunk_size)
    with torch.no_grad():
        head.weight.copy_(weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    assert loss.dtype == torch.float32 and grad_weight.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item()
    cosine = F.cosine_similarity(grad_weight.double().flatten(), ref_grad_weight.flatten(), dim=0)
    assert cosine > 0.99


# ---- degenerate embeddings -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("case", MARGIN_CASES, ids=MARGIN_IDS)
def test_on_and_opposite_class_centre_are_finite(case, chunk_size, dtype):
    _, make_margin, _, _ = case
    head = ShardedMarginSoftmax(5, 4, make_margin(), chunk_size=chunk_size)
    with torch.no_grad():
        head.weight.copy_(torch.randn(5, 4) * 0.01)
        head.weight[1] = torch.tensor([0.0, 0.02, 0.0, 0.0])
        head.weight[2] = torch.tensor([0.0, 0.0, 0.03, 0.0])
    head.to(dtype)
    embeddings = torch.stack(
        [
            torch.tensor([0.0, 5.0, 0.0, 0.0]),  # exactly on class 1's row: cos = +1
            torch.tensor([0.0, 0.0, -2.0, 0.0]),  # exactly opposite class 2's row: cos = -1
            head.weight[3].detach().float() * 7.0,  # on class 3's row, cos = 1 up to rounding
            -head.weight[4].detach().float(),  # opposite class 4's row
            torch.zeros(4),  # no direction at all
        ]
    ).to(dtype)
    labels = torch.tensor([1, 2, 3, 4, 0])
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad_embeddings).all()
    assert torch.isfinite(grad_weight).all()


def test_exact_centre_loss_matches_limit_of_reference():
    # At cos = +-1 exactly the loss is the limit of the reference (theta = 0 and pi).
    head = ShardedMarginSoftmax(3, 2, ArcFace(s=8.0, m=0.5)).double()
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    embeddings = torch.tensor([[2.0, 0.0], [-3.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0])
    loss = head(embeddings, labels)
    # Row 0: theta 0 -> target 8 cos(0.5), others 8*0, 8*(-1). Row 1: theta pi -> fallback.
    target = torch.tensor([8 * math.cos(0.5), 8 * (math.cos(0.5) - 2)], dtype=torch.float64)
    others = torch.tensor([[0.0, -8.0], [0.0, 8.0]], dtype=torch.float64)
    logits = torch.cat([target[:, None], others], dim=1)
    expected = F.cross_entropy(logits, torch.tensor([0, 0]))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


# ---- the statistics' sharded path and the chunked memory bound ---------------------------


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
def test_statistics_of_rows_whose_label_another_rank_owns(chunk_size):
    # With W > 1 most rows' targets live on another rank (target index -1): their local
    # statistics are the plain log-sum-exp of s * cos over this rank's classes.
    generator = torch.Generator().manual_seed(13)
    norm_embeddings = F.normalize(torch.randn(6, 8, generator=generator, dtype=torch.float64))
    norm_weight = F.normalize(torch.randn(11, 8, generator=generator, dtype=torch.float64))
    target_index = torch.tensor([-1, 3, -1, 10, 0, -1])
    target_logit = torch.tensor([0.0, 2.5, 0.0, -7.0, 1.0, 0.0], dtype=torch.float64)
    scale = 20.0
    inputs = [norm_embeddings, norm_weight, target_logit]
    inputs = [t.clone().requires_grad_(True) for t in inputs]
    if chunk_size is None:
        row_max, row_sumexp = margin_softmax._softmax_stats(*inputs, target_index, scale)
    else:
        row_max, row_sumexp = margin_softmax._ChunkedSoftmaxStats.apply(
            *inputs, target_index, scale, chunk_size
        )
    lse = torch.log(row_sumexp) + row_max
    lse.sum().backward()

    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    logits = ref_inputs[0] @ ref_inputs[1].T * scale
    owned = target_index >= 0
    replaced = logits.clone()
    replaced[owned, target_index[owned]] = ref_inputs[2][owned]
    ref_lse = torch.logsumexp(replaced, dim=1)
    ref_lse.sum().backward()
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(row_max, replaced.detach().amax(dim=1), rtol=0, atol=1e-12)
    for actual, expected in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-10, atol=1e-12)
    # Rows whose target is elsewhere pass no gradient to the target logit.
    assert (inputs[2].grad[~owned] == 0).all()


def saved_tensor_sizes(head, embeddings, labels):
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = head(embeddings.requires_grad_(True), labels)
    loss.backward()
    return sizes


def test_chunked_head_saves_no_full_logit_matrix():
    num_classes, batch_size = 1000, 64
    torch.manual_seed(14)
    embeddings, labels = make_batch(num_classes, 8, batch_size, seed=15, dtype=torch.float32)
    full = saved_tensor_sizes(ShardedMarginSoftmax(num_classes, 8, CosFace()), embeddings, labels)
    chunked = saved_tensor_sizes(
        ShardedMarginSoftmax(num_classes, 8, CosFace(), chunk_size=32), embeddings, labels
    )
    logit_matrix = batch_size * num_classes
    assert max(full) >= logit_matrix  # the test can tell the two apart
    assert max(chunked) <= num_classes * 8  # nothing bigger than the (C, D) class rows
