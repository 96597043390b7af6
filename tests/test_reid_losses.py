"""The re-id losses against plain float64 references: label smoothing on the sharded margin
softmax (F.cross_entropy(label_smoothing=eps) over the full logits) and the batch-hard
triplet loss (hardest positive and negative found by loops over the full distance matrix).

The multi-rank checks (`check_label_smoothing`, `check_triplet`) run inside the spawned
groups of tests/test_head_distributed.py (world sizes 1 to 4), where spawning is paid once.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recognition import distributed
from recognition.config import ConfigError, load_config
from recognition.heads import ShardedMarginSoftmax
from recognition.heads.margins import ArcFace, CosFace
from recognition.heads.smoothing import NormalizedRowSum

NUM_CLASSES = 23
EMBEDDING_SIZE = 8
LOCAL_BATCH = 3


# ---- references ---------------------------------------------------------------------------


def smoothed_reference(embeddings, weight, labels, scale, psi, eps):
    """Loss, d loss / d embeddings, d loss / d weight in float64: F.cross_entropy with
    label_smoothing=eps over the full (N, C) logits, the target's with the margin."""
    embeddings = embeddings.detach().double().requires_grad_(True)
    weight = weight.detach().double().requires_grad_(True)
    cos = F.normalize(embeddings, dim=1) @ F.normalize(weight, dim=1).T  # (N, C)
    theta = torch.acos(cos.gather(1, labels[:, None]).squeeze(1))
    logits = cos.scatter(1, labels[:, None], psi(theta)[:, None]) * scale
    loss = F.cross_entropy(logits, labels, label_smoothing=eps)
    loss.backward()
    return loss.detach(), embeddings.grad, weight.grad


def triplet_reference(features, labels, margin):
    """The batch-hard triplet loss and its gradient in float64, by loops: for each anchor
    with another sample of its label and a sample of another label, the largest Euclidean
    distance to a positive and the smallest to a negative; the mean over those anchors."""
    features = features.detach().double().requires_grad_(True)
    n = features.shape[0]
    terms = []
    for a in range(n):
        positives = [
            torch.sqrt(((features[a] - features[p]) ** 2).sum())
            for p in range(n)
            if p != a and labels[p] == labels[a]
        ]
        negatives = [
            torch.sqrt(((features[a] - features[q]) ** 2).sum())
            for q in range(n)
            if labels[q] != labels[a]
        ]
        if not positives or not negatives:
            continue
        hardest_positive = max(positives, key=lambda d: d.item())
        hardest_negative = min(negatives, key=lambda d: d.item())
        gap = hardest_positive - hardest_negative
        if margin is None:
            terms.append(torch.log(1 + torch.exp(gap)))
        else:
            terms.append(torch.clamp(gap + margin, min=0))
    loss = torch.stack(terms).mean()
    loss.backward()
    return loss.detach(), features.grad


PSI = {
    "cosface": (lambda: CosFace(s=16.0, m=0.35), 16.0, lambda t: torch.cos(t) - 0.35),
    "arcface": (lambda: ArcFace(s=32.0, m=0.5), 32.0, lambda t: torch.cos(t + 0.5)),
}


# ---- multi-rank checks (run by tests/test_head_distributed.py) ------------------------------


def check_label_smoothing(check, rank, world_size):
    """The sharded head with label smoothing: loss, weight and embedding gradients equal the
    full-logit F.cross_entropy(label_smoothing=eps) in float64, chunked or not."""
    from test_head_distributed import full_problem, run_head

    # Every margin, eps and chunking on random labels; the other scenarios (which rank owns
    # the targets, which the smoothing term reads too) once each.
    cases = [("random", margin, eps, chunk) for margin in PSI for eps in (0.1, 0.6)
             for chunk in (None, 2)]  # fmt: skip
    cases += [("one_shard", "cosface", 0.1, None), ("rank_owns_none", "arcface", 0.1, None)]
    for index, (scenario, margin_id, eps, chunk_size) in enumerate(cases):
        weight, embeddings, labels = full_problem(world_size, scenario, torch.float64, index)
        make_margin, scale, psi = PSI[margin_id]
        name = f"W={world_size} smoothing {eps} {scenario} {margin_id} chunk={chunk_size}"
        ref_loss, ref_grad_e, ref_grad_w = smoothed_reference(
            embeddings, weight, labels, scale, psi, eps
        )
        # The smoothed loss differs from the plain one: the check tells them apart.
        plain = smoothed_reference(embeddings, weight, labels, scale, psi, 0.0)[0]
        check.true(f"{name}: smoothing changes the loss", abs(plain - ref_loss) > 1e-3)
        head = ShardedMarginSoftmax(
            NUM_CLASSES, EMBEDDING_SIZE, make_margin(), chunk_size=chunk_size, label_smoothing=eps
        ).double()
        loss, grad_w, grad_e = run_head(head, weight, embeddings, labels, rank, world_size)
        check.close(f"{name}: loss", loss, ref_loss, 1e-10)
        check.close(f"{name}: grad weight", grad_w, ref_grad_w, 1e-10)
        check.close(f"{name}: grad embeddings", grad_e, ref_grad_e, 1e-10)


def check_triplet(check, rank, world_size):
    """The batch-hard triplet loss mined over every rank's batch: the same loss on every
    rank as the single-process reference on the whole batch, and each rank's features get
    W x its rows of the reference gradient (DDP's average then gives the whole batch's)."""
    from recognition.heads.triplet import batch_hard_triplet_loss

    generator = torch.Generator().manual_seed(5)
    local = 4
    features = torch.randn(local * world_size, 6, generator=generator, dtype=torch.float64)
    # P x K over the ranks: each identity's samples spread over two ranks' blocks.
    labels = torch.arange(local * world_size) % max(2, (local * world_size) // 2)
    for margin in (0.3, None, 5.0):
        name = f"W={world_size} triplet margin={margin}"
        ref_loss, ref_grad = triplet_reference(features, labels, margin)
        rows = slice(rank * local, (rank + 1) * local)
        local_features = features[rows].clone().requires_grad_(True)
        loss = batch_hard_triplet_loss(local_features, labels[rows], margin)
        loss.backward()
        check.close(f"{name}: loss", loss, ref_loss, 1e-12)
        check.close(f"{name}: grad", local_features.grad, world_size * ref_grad[rows], 1e-12)
        losses = distributed.all_gather_tensor(loss.detach().reshape(1))
        check.close(f"{name}: loss across ranks", losses, loss.detach().expand(world_size), 0)


# ---- single process ------------------------------------------------------------------------


def test_normalized_row_sum_and_its_gradient():
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    for block in (1, 4, 64):
        assert torch.autograd.gradcheck(
            lambda w, b=block: NormalizedRowSum.apply(w, torch.float64, b), (weight,)
        )
        expected = F.normalize(weight.detach(), dim=1).sum(0)
        assert torch.allclose(NormalizedRowSum.apply(weight, torch.float64, block), expected)
    # A zero row counts as F.normalize counts it: nothing in the sum, the slope 1/eps.
    with torch.no_grad():
        weight[3] = 0.0
    grad = torch.randn(5, dtype=torch.float64)
    reference = weight.detach().clone().requires_grad_(True)
    F.normalize(reference, dim=1).sum(0).backward(grad)
    ours = weight.detach().clone().requires_grad_(True)
    NormalizedRowSum.apply(ours, torch.float64, 4).backward(grad)
    assert torch.allclose(ours.grad, reference.grad, rtol=1e-12, atol=0)


def test_label_smoothing_in_float32_and_zero_is_the_plain_loss():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(NUM_CLASSES, EMBEDDING_SIZE, generator=generator)
    embeddings = torch.randn(6, EMBEDDING_SIZE, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (6,), generator=generator)
    make_margin, scale, psi = PSI["cosface"]
    for eps in (0.0, 0.1):
        head = ShardedMarginSoftmax(NUM_CLASSES, EMBEDDING_SIZE, make_margin(), label_smoothing=eps)
        with torch.no_grad():
            head.weight.copy_(weight)
        x = embeddings.clone().requires_grad_(True)
        loss = head(x, labels)
        loss.backward()
        ref_loss, ref_grad_e, ref_grad_w = smoothed_reference(
            embeddings, weight, labels, scale, psi, eps
        )
        assert loss.dtype == torch.float32
        assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-5)
        assert torch.allclose(x.grad.double(), ref_grad_e, atol=1e-6)
        assert torch.allclose(head.weight.grad.double(), ref_grad_w, atol=1e-6)


def test_smoothing_refuses_partial_fc_and_the_fused_update():
    with pytest.raises(ValueError, match="head.label_smoothing: not with partial FC"):
        ShardedMarginSoftmax(10, 4, CosFace(), sample_rate=0.5, label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        ShardedMarginSoftmax(10, 4, CosFace(), label_smoothing=1.0)
    head = ShardedMarginSoftmax(10, 4, CosFace(), kernel="torch", label_smoothing=0.1)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="head.fused_update: not with head.label_smoothing"):
        head.attach_fused_update(optimizer)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["head.label_smoothing=1.0"], "head.label_smoothing: 1.0 is outside"),
        (["head.label_smoothing=0.1", "head.sample_rate=0.5"], "not with partial FC"),
        (
            [
                "head.label_smoothing=0.1",
                "head.fused_update=true",
                "head.kernel=triton",
                "optim.grad_clip=null",
            ],
            "not with head.fused_update",
        ),
        (["head.triplet_weight=-1"], "head.triplet_weight: must be a finite number >= 0"),
        (["head.id_weight=0"], "both 0: no loss left"),
        (["head.triplet_margin=-0.1"], "head.triplet_margin: must be >= 0"),
        (["head.triplet_weight=1"], "head.triplet_weight: batch-hard mining needs"),
        (
            [
                "head.triplet_weight=1",
                "data.sampler=pk",
                "model.pipeline_stages=2",
                "train.batch_size=8",
            ],
            "cannot be combined with head.triplet_weight",
        ),
    ],
)
def test_config_refuses_what_the_losses_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", overrides)


def test_triplet_leaves_out_anchors_without_a_positive_or_a_negative():
    from recognition.heads.triplet import batch_hard_triplet_loss

    generator = torch.Generator().manual_seed(1)
    features = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 2, 2, 2])  # the anchor of identity 1 has no positive
    for margin in (0.3, None):
        ref_loss, ref_grad = triplet_reference(features, labels, margin)
        x = features.clone().requires_grad_(True)
        loss = batch_hard_triplet_loss(x, labels, margin)
        loss.backward()
        assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
        assert torch.allclose(x.grad, ref_grad, rtol=1e-12, atol=1e-15)
    # One identity: no anchor has a negative; the loss is 0 with a zero (not NaN) gradient.
    x = features.clone().requires_grad_(True)
    loss = batch_hard_triplet_loss(x, torch.zeros(6, dtype=torch.int64), 0.3)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))


def test_train_step_adds_the_triplet_loss_of_the_features_before_the_bn_neck():
    """Through `train_step`: the step's loss is id_weight x the head's loss on the BN neck's
    output + triplet_weight x the triplet loss (by loops) of the features before the BN
    (a tiny IResNet, whose neck is the BatchNorm1d after its fc)."""
    from recognition.config import OptimConfig
    from recognition.heads.triplet import TrainingLoss
    from recognition.models import iresnet, use_neck_features
    from recognition.optim import build_optimizer, param_groups
    from recognition.precision import Precision
    from recognition.training import train_step

    torch.manual_seed(0)
    backbone = iresnet("iresnet18", embedding_size=16, width=0.125, image_size=32)
    assert use_neck_features(backbone)
    head = ShardedMarginSoftmax(4, 16, CosFace(s=16.0, m=0.35), label_smoothing=0.1)
    images = torch.randn(8, 3, 32, 32)
    labels = torch.arange(8) // 2  # P x K = 4 x 2
    with torch.no_grad():
        features, embeddings = backbone(images)  # batch statistics: the step sees the same
        id_loss = head(embeddings, labels)
    assert torch.allclose(embeddings, backbone.features(features))
    expected = 0.5 * id_loss.double() + 2.0 * triplet_reference(features, labels, 0.3)[0]

    precision = Precision("O0", "bf16", torch.device("cpu"))
    groups = param_groups([backbone, head], 0.0)
    optimizer = build_optimizer(precision.param_groups(groups), OptimConfig(lr=1e-3))
    loss_fn = TrainingLoss.from_weights(0.5, 2.0, 0.3)
    result = train_step(
        backbone, head, [(images, labels)], optimizer, precision, None, training_loss=loss_fn
    )
    assert math.isclose(result.loss.item(), expected.item(), rel_tol=1e-5)
    backbone.eval()
    with torch.no_grad():
        assert backbone(images).shape == (8, 16)
    # The weights (1, 0) are the head's loss alone: no TrainingLoss at all.
    assert TrainingLoss.from_weights(1.0, 0.0, 0.3) is None


def test_reid_resnet_gives_the_pooled_features_before_its_bn_neck_in_training():
    from recognition.models import resnet50_reid, use_neck_features

    torch.manual_seed(0)
    backbone = resnet50_reid(embedding_size=2048)
    images = torch.randn(4, 3, 32, 16)
    with torch.no_grad():
        assert backbone(images).shape == (4, 2048)  # not asked: the embeddings alone
        assert use_neck_features(backbone)
        pooled, embeddings = backbone(images)
        assert torch.allclose(pooled, backbone.forward_features(images).mean(dim=(2, 3)))
        assert torch.allclose(embeddings, F.batch_norm(pooled, None, None, training=True))
        backbone.eval()
        assert torch.is_tensor(backbone(images))
