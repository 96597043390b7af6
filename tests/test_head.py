"""ShardedMarginSoftmax (one process) against a full-matrix float64 F.cross_entropy reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recognition.heads import local_stats, margin_softmax
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


def step_heads(pairs, embeddings, labels):
    """One optimizer step of each (head, optimizer) of `pairs` on the same batch."""
    for head, optimizer in pairs:
        optimizer.zero_grad(set_to_none=True)
        head(embeddings, labels).backward()
        optimizer.step()


def assert_moved_alike(fast, slow, initial, rel=1e-5):
    """The two heads' class rows moved from `initial` by the same steps (relative to the
    largest move)."""
    moved = (fast.weight - initial).detach().double()
    assert_close_rel(moved, (slow.weight - initial).detach().double(), rel)


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


def assert_matches_reference(head, embeddings, labels, scale, psi, rel):
    """Loss and both gradients of `head` within `rel` of the float64 reference; returns them."""
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    ref_loss, ref_grad_embeddings, ref_grad_weight, _ = reference_loss(
        embeddings, head.weight, labels, scale, psi
    )
    assert_close_rel(loss, ref_loss, rel)
    assert_close_rel(grad_embeddings, ref_grad_embeddings, rel)
    assert_close_rel(grad_weight, ref_grad_weight, rel)
    return loss, grad_embeddings, grad_weight


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


def test_group_of_three_ranks_takes_its_block_of_classes(monkeypatch):
    # Construction needs no collective: the rank and world size of the group decide the shard.
    monkeypatch.setattr(margin_softmax.distributed, "world_size", lambda group=None: 3)
    for rank, (start, count) in enumerate([(0, 4), (4, 3), (7, 3)]):
        monkeypatch.setattr(margin_softmax.distributed, "rank", lambda group=None, r=rank: r)
        head = ShardedMarginSoftmax(10, 8, ArcFace())
        assert (head.class_start, head.num_local, head.world_size) == (start, count, 3)
        assert head.weight.shape == (count, 8)
    with pytest.raises(ValueError, match="num_classes"):
        ShardedMarginSoftmax(2, 8, ArcFace())


def test_sample_rate_sets_the_number_of_sampled_classes():
    assert ShardedMarginSoftmax(1000, 8, ArcFace(), sample_rate=0.1).num_sample == 100
    assert ShardedMarginSoftmax(1000, 8, ArcFace(), sample_rate=0.1234).num_sample == 123
    assert ShardedMarginSoftmax(10, 8, ArcFace(), sample_rate=0.01).num_sample == 1  # >= 1
    assert ShardedMarginSoftmax(10, 8, ArcFace()).num_sample == 10


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


# (classes, embedding size, batch, seed, dtype, rel. tolerance, duplicate labels, chunk size):
# float64 to 1e-10 (several rows sharing a class row), a batch of one, float32 to 1e-5.
REFERENCE_SETTINGS = [
    *[(23, 16, 12, 1, torch.float64, 1e-10, True, chunk) for chunk in (None, 1, 4, 64)],
    *[(7, 8, 1, 3, torch.float64, 1e-10, False, chunk) for chunk in (None, 3)],
    *[(37, 32, 16, 5, torch.float32, 1e-5, False, chunk) for chunk in (None, 5)],
]


@pytest.mark.parametrize(
    "num_classes, embedding_size, batch_size, seed, dtype, rel, duplicates, chunk_size",
    REFERENCE_SETTINGS,
)
@pytest.mark.parametrize("case", MARGIN_CASES, ids=MARGIN_IDS)
def test_matches_reference(
    case, num_classes, embedding_size, batch_size, seed, dtype, rel, duplicates, chunk_size
):
    _, make_margin, scale, psi = case
    torch.manual_seed(seed)
    head = ShardedMarginSoftmax(num_classes, embedding_size, make_margin(), chunk_size=chunk_size)
    head = head.to(dtype)
    embeddings, labels = make_batch(num_classes, embedding_size, batch_size, seed + 1, dtype)
    if duplicates:
        labels[:4] = 5  # several rows share one class row
    loss, grad_embeddings, grad_weight = assert_matches_reference(
        head, embeddings, labels, scale, psi, rel
    )
    assert loss.shape == () and loss.dtype == dtype
    assert grad_weight.dtype == dtype and grad_embeddings.dtype == dtype


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


@pytest.mark.parametrize("sampled", [False, True], ids=["all_rows", "row_index"])
@pytest.mark.parametrize("keep_logits", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("block_size", [1, 4, 100])
def test_local_statistics_against_autograd(block_size, keep_logits, sampled):
    # The statistics function: max / sum-exp over the non-target columns of the rows taking
    # part, and the target cosine, with gradients w.r.t. the embeddings and the RAW class
    # rows (their normalisation included). Rows whose target another rank owns (-1) get the
    # plain log-sum-exp of s * cos over every class taking part.
    generator = torch.Generator().manual_seed(16)
    norm_embeddings = F.normalize(torch.randn(7, 8, generator=generator, dtype=torch.float64))
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64)
    weight[4] = 0.0  # a zero row: normalises to zero, no NaN
    target_row = torch.tensor([-1, 3, -1, 10, 0, -1, 3])
    row_index = torch.tensor([0, 2, 3, 5, 10]) if sampled else None
    columns = row_index if sampled else torch.arange(11)
    scale = 20.0
    grad_sumexp = torch.rand(7, generator=generator, dtype=torch.float64)
    grad_target = torch.randn(7, generator=generator, dtype=torch.float64)

    inputs = [norm_embeddings.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    row_max, row_sumexp, target_cos = local_stats.LocalClassStats.apply(
        *inputs, row_index, target_row, scale, block_size, keep_logits, torch.float64
    )
    torch.autograd.backward([row_sumexp, target_cos], [grad_sumexp, grad_target])

    ref = [t.detach().clone().requires_grad_(True) for t in (norm_embeddings, weight)]
    cos = ref[0] @ F.normalize(ref[1], dim=1)[columns].T  # (N, K)
    is_target = columns[None, :] == target_row[:, None]
    logits = (cos * scale).masked_fill(is_target, -math.inf)
    ref_max = logits.detach().amax(dim=1)
    ref_sumexp = torch.exp(logits - ref_max[:, None]).sum(dim=1)
    owned = target_row >= 0
    ref_target_cos = (ref[0] * F.normalize(ref[1], dim=1)[target_row.clamp(min=0)]).sum(dim=1)
    ref_target_cos = torch.where(owned, ref_target_cos, 0.0)
    torch.autograd.backward([ref_sumexp, ref_target_cos], [grad_sumexp, grad_target])

    torch.testing.assert_close(row_max, ref_max, rtol=1e-12, atol=0)
    torch.testing.assert_close(row_sumexp, ref_sumexp, rtol=1e-12, atol=0)
    torch.testing.assert_close(target_cos, ref_target_cos, rtol=1e-12, atol=1e-15)
    for actual, expected in zip(inputs, ref, strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-10, atol=1e-12)
    if sampled:  # rows that do not take part and are no target get exactly zero
        assert (inputs[1].grad[[1, 4, 6, 7, 8, 9]] == 0).all()


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


def large_allocations(head, embeddings, labels, threshold):
    """Shapes of every op output with at least `threshold` elements in forward + backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # Views, detach and in-place ops reuse an input's memory: only new storage counts.
            inputs = torch.utils._pytree.tree_leaves((args, kwargs))
            reused = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            for tensor in out if isinstance(out, tuple | list) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.numel() >= threshold:
                    if tensor.untyped_storage().data_ptr() not in reused:
                        shapes.append((str(func), tuple(tensor.shape)))
            return out

    embeddings = embeddings.clone().requires_grad_(True)
    with Recorder():
        head(embeddings, labels).backward()
    return shapes


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_chunked_head_allocates_one_weight_sized_tensor_its_gradient(sample_rate):
    # Beyond the weight, the chunked head may allocate ONE tensor of the weight's size (its
    # gradient) and nothing of size (N, C_local): no normalised copy of the shard, no second
    # gradient for the target rows, no full logits.
    num_classes, dim, batch, chunk = 3000, 16, 32, 64
    torch.manual_seed(17)
    embeddings, labels = make_batch(num_classes, dim, batch, seed=18, dtype=torch.float32)
    head = ShardedMarginSoftmax(
        num_classes, dim, ArcFace(), chunk_size=chunk, sample_rate=sample_rate
    )
    big = large_allocations(head, embeddings, labels, threshold=batch * chunk * 4 + 1)
    assert [shape for _, shape in big] == [(num_classes, dim)], big
    # The test can tell: the unchunked head keeps (C_local, N) logits.
    unchunked = ShardedMarginSoftmax(num_classes, dim, ArcFace())
    big = large_allocations(unchunked, embeddings, labels, threshold=batch * chunk * 4 + 1)
    assert (num_classes, batch) in [shape for _, shape in big]


# ---- partial FC (sample_rate < 1), one process -------------------------------------------


def restricted_reference(embeddings, weight, labels, columns, scale, psi):
    """Float64 F.cross_entropy over the classes `columns` (sorted) only, and the gradients."""
    embeddings = embeddings.detach().double().requires_grad_(True)
    weight = weight.detach().double().requires_grad_(True)
    cos = F.normalize(embeddings, dim=1) @ F.normalize(weight, dim=1)[columns].T  # (B, K)
    sub_labels = torch.searchsorted(columns, labels)
    assert (columns[sub_labels] == labels).all(), "a positive class was not sampled"
    theta = torch.acos(cos.gather(1, sub_labels[:, None]).squeeze(1))
    logits = cos.scatter(1, sub_labels[:, None], psi(theta)[:, None]) * scale
    loss = F.cross_entropy(logits, sub_labels)
    loss.backward()
    return loss.detach(), embeddings.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("case", MARGIN_CASES, ids=MARGIN_IDS)
def test_partial_fc_loss_is_the_softmax_over_the_sampled_classes(case, chunk_size):
    _, make_margin, scale, psi = case
    torch.manual_seed(19)
    head = ShardedMarginSoftmax(
        40, 8, make_margin(), sample_rate=0.25, chunk_size=chunk_size, seed=3
    ).double()
    embeddings, labels = make_batch(40, 8, 6, seed=20)
    labels[:2] = 7  # duplicate labels
    loss, grad_embeddings, grad_weight = run_head(head, embeddings, labels)
    columns = head.sampled_index
    positives = labels.unique()
    assert columns.numel() == max(positives.numel(), 10)
    assert torch.isin(positives, columns).all()
    assert (columns[1:] > columns[:-1]).all()  # sorted, unique
    ref_loss, ref_grad_embeddings, ref_grad_weight = restricted_reference(
        embeddings, head.weight, labels, columns, scale, psi
    )
    assert_close_rel(loss, ref_loss, 1e-10)
    assert_close_rel(grad_embeddings, ref_grad_embeddings, 1e-10)
    assert_close_rel(grad_weight, ref_grad_weight, 1e-10)
    unsampled = torch.ones(40, dtype=torch.bool)
    unsampled[columns] = False
    assert (grad_weight[unsampled] == 0).all()


def test_partial_fc_keeps_every_positive_when_they_outnumber_the_sample():
    head = ShardedMarginSoftmax(40, 8, CosFace(), sample_rate=0.1)  # num_sample 4
    embeddings, _ = make_batch(40, 8, 12, seed=21, dtype=torch.float32)
    labels = torch.arange(0, 36, 3)  # 12 distinct positives
    head(embeddings, labels)
    assert head.sampled_index.tolist() == labels.tolist()


def test_partial_fc_sample_without_host_reads_is_the_counted_one(monkeypatch):
    """Where the sample holds every positive the batch can have, the positives are raised by
    a scatter and num_sample classes kept (nothing read on the host): the same rows as
    counting the positives (`torch.unique`) gives, with duplicate labels and labels other
    ranks own (-1); and the optimizer then steps those rows as they are."""
    from recognition.heads.partial_fc import RowSampler

    generator = torch.Generator().manual_seed(26)
    for trial in range(20):
        num_local, num_rows = 30, 12
        num_sample = num_rows + trial % 3  # >= the rows: every positive fits
        target_row = torch.randint(-1, num_local, (num_rows,), generator=generator)
        target_row[:3] = target_row[3]  # duplicates
        owned = target_row >= 0
        fixed, counted = (RowSampler(0, num_local, num_sample, seed=trial) for _ in range(2))
        assert fixed.fixed_count(num_rows)
        rows = fixed.sample(target_row, owned, gradient_dropped=True)
        with monkeypatch.context() as patch:
            patch.setattr(counted, "fixed_count", lambda num_rows: False)
            expected = counted.sample(target_row, owned, gradient_dropped=True)
        assert torch.equal(rows, expected), trial
        assert torch.isin(target_row[owned], rows).all() and rows.numel() == num_sample
        assert fixed._rows_to_update() is rows
        assert torch.equal(counted._rows_to_update(), expected)  # via the mask's nonzero
    assert not RowSampler(0, 30, 11, seed=0).fixed_count(12)
    assert RowSampler(0, 10, 9, seed=0).fixed_count(12) is False  # 9 < min(12, 10)
    assert RowSampler(0, 10, 10, seed=0).fixed_count(12)


def test_partial_fc_sampling_is_reproducible_and_roughly_uniform():
    def sampled_sets(seed, steps):
        head = ShardedMarginSoftmax(200, 4, CosFace(), sample_rate=0.2, seed=seed)
        embeddings = torch.randn(2, 4)
        labels = torch.tensor([5, 5])
        out = []
        for _ in range(steps):
            head(embeddings, labels)
            out.append(head.sampled_index.clone())
        return out, head

    first, head = sampled_sets(seed=7, steps=200)
    again, _ = sampled_sets(seed=7, steps=3)
    other, _ = sampled_sets(seed=8, steps=1)
    assert head.sampling_step == 200
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], first[1])
    counts = torch.zeros(200)
    for index in first:
        assert index.numel() == 40 and 5 in index.tolist()
        counts[index] += 1
    negatives = torch.cat([counts[:5], counts[6:]])
    # Each negative class is kept with probability 39/199; over 200 steps its count is
    # Binomial(200, 0.196): mean 39.2, sd 5.6. Every class lies within 5 sd of it.
    assert counts[5] == 200
    assert negatives.sum() == 200 * 39  # exactly 39 negatives a step
    assert negatives.min() > 39.2 - 5 * 5.6 and negatives.max() < 39.2 + 5 * 5.6


def test_partial_fc_is_off_in_eval_and_without_grad():
    torch.manual_seed(22)
    head = ShardedMarginSoftmax(30, 8, CosFace(), sample_rate=0.2).double()
    embeddings, labels = make_batch(30, 8, 5, seed=23)
    full = ShardedMarginSoftmax(30, 8, CosFace()).double()
    full.load_state_dict(head.state_dict())
    expected = full(embeddings, labels)
    with torch.no_grad():
        assert head(embeddings, labels).item() == pytest.approx(expected.item(), rel=1e-12)
    assert head.sampled_index is None
    head.eval()
    assert head(embeddings, labels).item() == pytest.approx(expected.item(), rel=1e-12)
    assert head.sampled_index is None and head.sampling_step == 0


def reference_sgd_rows(weight, buffer, grad, rows, lr, momentum, weight_decay):
    """torch.optim.SGD's rule applied to `rows` only, in float64 (buffer None: first step)."""
    weight, grad = weight.double().clone(), grad.double()
    buffer = torch.zeros_like(weight) if buffer is None else buffer.double().clone()
    step = grad[rows] + weight_decay * weight[rows]
    buffer[rows] = momentum * buffer[rows] + step
    weight[rows] -= lr * buffer[rows]
    return weight, buffer


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_attach_optimizer_updates_only_sampled_rows_sgd_momentum_weight_decay(chunk_size):
    torch.manual_seed(24)
    num_classes, dim = 50, 8
    head = ShardedMarginSoftmax(
        num_classes, dim, ArcFace(s=16.0), sample_rate=0.2, chunk_size=chunk_size
    ).double()
    lr, momentum, weight_decay = 0.5, 0.9, 0.05
    optimizer = torch.optim.SGD(
        head.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay
    )
    head.attach_optimizer(optimizer)
    weight, buffer = head.weight.detach().clone(), None
    ever_sampled = torch.zeros(num_classes, dtype=torch.bool)
    for step in range(4):
        optimizer.zero_grad(set_to_none=True)
        rows = torch.zeros(num_classes, dtype=torch.bool)
        grad = torch.zeros(num_classes, dim, dtype=torch.float64)
        # Step 2 accumulates two micro-batches: the rows of both are updated.
        for micro in range(2 if step == 2 else 1):
            embeddings, labels = make_batch(num_classes, dim, 4, seed=100 + 10 * step + micro)
            before = head.weight.detach().clone()
            loss = head(embeddings, labels)
            loss.backward()
            rows[head.sampled_index] = True
            # The gradient is that of the restricted softmax (checked above); take it from
            # the reference so the update below is computed independently of the head.
            _, _, ref_grad = restricted_reference(
                embeddings, before, labels, head.sampled_index, 16.0,
                lambda t: psi_arcface(t, 0.5),
            )  # fmt: skip
            grad += ref_grad
        before_buffer = optimizer.state[head.weight].get("momentum_buffer")
        before_buffer = None if before_buffer is None else before_buffer.clone()
        optimizer.step()
        weight, buffer = reference_sgd_rows(weight, buffer, grad, rows, lr, momentum, weight_decay)
        ever_sampled |= rows
        state_buffer = optimizer.state[head.weight]["momentum_buffer"]
        assert head.weight.shape == (num_classes, dim) and state_buffer.shape == weight.shape
        assert head.weight.grad.shape == weight.shape
        torch.testing.assert_close(head.weight.detach(), weight, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(state_buffer, buffer, rtol=1e-10, atol=1e-12)
        # Rows not sampled this step: bit for bit unchanged, weight and momentum alike.
        assert torch.equal(head.weight.detach()[~rows], before[~rows])
        if before_buffer is not None:
            assert torch.equal(state_buffer[~rows], before_buffer[~rows])
        assert (state_buffer[~ever_sampled] == 0).all()
    assert 0 < int(ever_sampled.sum()) < num_classes  # the test exercised both kinds of rows


def test_without_attach_optimizer_momentum_moves_unsampled_rows():
    # What attach_optimizer prevents: plain SGD decays and pushes every row every step.
    torch.manual_seed(25)
    head = ShardedMarginSoftmax(50, 8, CosFace(), sample_rate=0.2).double()
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=0.05)
    before = head.weight.detach().clone()
    embeddings, labels = make_batch(50, 8, 4, seed=26)
    head(embeddings, labels).backward()
    optimizer.step()
    unsampled = torch.ones(50, dtype=torch.bool)
    unsampled[head.sampled_index] = False
    assert not torch.equal(head.weight.detach()[unsampled], before[unsampled])


def test_attach_optimizer_rejects_an_optimizer_without_the_weight():
    head = ShardedMarginSoftmax(50, 8, CosFace(), sample_rate=0.2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(50, 8))], lr=0.1)
    with pytest.raises(ValueError, match="master"):
        head.attach_optimizer(optimizer)
