"""AdaFace (head.margin=adaface) against references written here independently.

The margin follows each row's embedding norm through running statistics of the norms: the
references compute the margin straight from the paper's formula (theta from acos, the angle
clipped to [eps, pi - eps]) with the statistics recomputed in plain Python (`statistics.fmean`,
`statistics.stdev`) from the batches seen, and the loss as a full-matrix float64
F.cross_entropy (tests/test_head_distributed.py's `reference`). The sharded head must equal
them at W = 1, 2, 3 (spawned gloo ranks), chunked and not, with partial FC, over two steps
(the second margin uses statistics moved by both batches); the Triton kernel (interpreted)
too. Then the state: the statistics go through DCP checkpoints at another world size, a
train() run resumed mid-way continues the uninterrupted one, precision O2/O3 leave them in
float64, and the config keys are checked.
"""

from __future__ import annotations

import functools
import math
import statistics

import pytest
import test_head_distributed as hd
import torch
from test_head import assert_close_rel, assert_moved_alike, run_head, step_heads

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import ConfigError, config_from_dict, load_config
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.heads.margins import AdaFace, CosFace
from recognition.precision import Precision

M, H, SCALE, T_ALPHA = 0.4, 0.333, 16.0, 0.3
EPS = 1e-3
# Running statistics the head starts from here (the published 20 and 100 would keep every
# norm_hat near 0 in a few steps; these put rows on both clips of norm_hat).
START_MEAN, START_STD = 8.0, 6.0


# ---- references --------------------------------------------------------------------------


def reference_psi(theta, norms, mean, std):
    """psi(theta) of each row (the paper's formula, as the authors' head computes it)."""
    norm_hat = ((norms.clamp(1e-3, 100.0) - mean) / (std + EPS) * H).clamp(-1.0, 1.0)
    g_angle, g_add = -M * norm_hat, M + M * norm_hat
    return torch.cos((theta + g_angle).clamp(EPS, math.pi - EPS)) - g_add


def reference_statistics(mean, std, norms):
    """The running (mean, std) after one batch: an EMA of the clipped norms' mean and
    sample standard deviation, in plain Python floats."""
    values = [min(max(float(x), 1e-3), 100.0) for x in norms.detach()]
    return (
        T_ALPHA * statistics.fmean(values) + (1 - T_ALPHA) * mean,
        T_ALPHA * statistics.stdev(values) + (1 - T_ALPHA) * std,
    )


def adaface_problem(world_size, seed, dtype=torch.float64):
    """hd.full_problem's batch with norms from 0.5 to 60: row 0 long and at its class centre
    (theta + g below eps: the lower clip), row 1 short and opposite its class (above
    pi - eps), row 2 so long that its norm_hat clips at 1."""
    weight, embeddings, labels = hd.full_problem(world_size, "random", torch.float64, seed)
    generator = torch.Generator().manual_seed(1000 + seed)
    noise = 0.02 * torch.randn(embeddings.shape, generator=generator, dtype=torch.float64)
    unit = torch.nn.functional.normalize(embeddings, dim=1)
    unit[0] = torch.nn.functional.normalize(weight[labels[0]], dim=0) + noise[0]
    unit[1] = -torch.nn.functional.normalize(weight[labels[1]], dim=0) + noise[1]
    norms = 0.5 + 29.5 * torch.rand(embeddings.shape[0], generator=generator, dtype=torch.float64)
    norms[:3] = torch.tensor([25.0, 1.0, 60.0], dtype=torch.float64)
    return weight.to(dtype), (unit * norms[:, None]).to(dtype), labels


def make_head(kernel="torch", **kwargs):
    margin = AdaFace(s=SCALE, m=M, h=H, t_alpha=T_ALPHA)
    head = ShardedMarginSoftmax(hd.NUM_CLASSES, hd.EMBEDDING_SIZE, margin, kernel=kernel, **kwargs)
    with torch.no_grad():
        head.margin.running_mean.fill_(START_MEAN)
        head.margin.running_std.fill_(START_STD)
    return head


# ---- W = 1, 2, 3 ---------------------------------------------------------------------------


def check_steps_match_reference(check, rank, world_size, head, dtype, rel, name):
    """Two training steps of `head` against the float64 reference; the statistics too."""
    mean, std = START_MEAN, START_STD
    for step in range(2):
        weight, embeddings, labels = adaface_problem(world_size, step, dtype)
        loss, grad_w, grad_e = hd.run_head(head, weight, embeddings, labels, rank, world_size)
        mean, std = reference_statistics(mean, std, embeddings.double().norm(dim=1))
        columns = None
        if head.sampled_index is not None:
            columns = (head.class_start + head.sampled_index)[:, None]
            columns = hd.gather_rows(columns, world_size)[:, 0]
            check.true(f"{name}: some classes left out", columns.numel() < hd.NUM_CLASSES)
        psi = functools.partial(
            reference_psi, norms=embeddings.double().norm(dim=1), mean=mean, std=std
        )
        ref_loss, ref_grad_e, ref_grad_w, _ = hd.reference(
            embeddings, weight, labels, SCALE, psi, columns
        )
        where = f"{name} step {step}"
        check.close(f"{where}: loss", loss, ref_loss, rel)
        check.close(f"{where}: grad weight", grad_w, ref_grad_w, rel)
        check.close(f"{where}: grad embeddings", grad_e, ref_grad_e, rel)
        stats = torch.stack([head.margin.running_mean, head.margin.running_std])
        # float32 embeddings: the head's norms are float32 (the reference's float64).
        stats_rel = 1e-13 if dtype == torch.float64 else 1e-6
        expected = torch.tensor([mean, std], dtype=torch.float64)
        check.close(f"{where}: statistics", stats, expected, stats_rel)
        every_rank = distributed.all_gather_tensor(stats[None])
        check.true(f"{where}: same statistics on every rank", bool((every_rank == stats).all()))


def check_adaface_exact(check, rank, world_size):
    for chunk_size, sample_rate in [(None, 1.0), (2, 1.0), (None, 0.3), (2, 0.3)]:
        name = f"W={world_size} chunk={chunk_size} sample_rate={sample_rate}"
        head = make_head(chunk_size=chunk_size, sample_rate=sample_rate, seed=5).double()
        check_steps_match_reference(check, rank, world_size, head, torch.float64, 1e-9, name)


def check_adaface_triton(check, rank, world_size):
    # float32 kernels: the fp32 tolerance of the kernel tests.
    for sample_rate in (1.0, 0.3):
        name = f"W={world_size} triton sample_rate={sample_rate}"
        head = make_head(kernel="triton", sample_rate=sample_rate, seed=5)
        check_steps_match_reference(check, rank, world_size, head, torch.float32, 1e-5, name)


def check_statistics_reshard(check, rank, world_size, save_dir, load_dir):
    """Load the head a group of another size saved (statistics 1.5 / 2.5, rows = class id),
    check it, and save it again from this group."""
    head = make_head()
    if load_dir is not None:
        ckpt.load_checkpoint(ckpt.latest_checkpoint(load_dir), {"head": head})
        stats = [head.margin.running_mean.item(), head.margin.running_std.item()]
        check.true(f"W={world_size} statistics loaded: {stats}", stats == [1.5, 2.5])
        rows = torch.arange(head.class_start, head.class_start + head.num_local)
        expected = rows[:, None].float().expand(-1, hd.EMBEDDING_SIZE)
        check.true(f"W={world_size} rows loaded", torch.equal(head.weight.detach(), expected))
    else:
        with torch.no_grad():
            head.margin.running_mean.fill_(1.5)
            head.margin.running_std.fill_(2.5)
            rows = torch.arange(head.class_start, head.class_start + head.num_local)
            head.weight.copy_(rows[:, None].float().expand(-1, hd.EMBEDDING_SIZE))
    ckpt.save_checkpoint(save_dir, world_size, {"head": head}, keep=1)


def test_adaface_matches_reference_at_world_sizes_1_2_3(tmp_path):
    # W = 1 in this process (no group needed), then 2 and 3 on spawned gloo ranks. The
    # statistics of a head saved by 2 ranks load on 3 and on 1 (replicated, not rows).
    check = hd.Checker()
    check_adaface_exact(check, 0, 1)
    check_adaface_triton(check, 0, 1)
    assert not check.failures, "\n".join(check.failures)

    def reshard(save_dir, load_dir):  # a picklable check for the spawned ranks
        return functools.partial(check_statistics_reshard, save_dir=save_dir, load_dir=load_dir)

    saved_by_2, saved_by_3 = tmp_path / "w2", tmp_path / "w3"
    checks_2 = (check_adaface_exact, check_adaface_triton, reshard(saved_by_2, None))
    hd.assert_checks_pass_on_ranks(2, tmp_path, checks_2)
    checks_3 = (check_adaface_exact, reshard(saved_by_3, saved_by_2))
    hd.assert_checks_pass_on_ranks(3, tmp_path, checks_3)
    # The 3-rank checkpoint read back in one process: one class matrix, the statistics.
    check = hd.Checker()
    check_statistics_reshard(check, 0, 1, tmp_path / "w1", saved_by_3)
    assert not check.failures, "\n".join(check.failures)


def test_the_problem_reaches_every_clip():
    # What the reference checks above depend on: rows on both clips of the angle and of
    # norm_hat at the statistics of the first step.
    weight, embeddings, labels = adaface_problem(1, 0)
    norms = embeddings.norm(dim=1)
    mean, std = reference_statistics(START_MEAN, START_STD, norms)
    norm_hat = ((norms - mean) / (std + EPS) * H).clamp(-1.0, 1.0)
    cos = torch.nn.functional.cosine_similarity(embeddings, weight[labels], dim=1)
    angle = torch.acos(cos) - M * norm_hat
    assert (angle < EPS).any() and (angle > math.pi - EPS).any()
    assert (norm_hat == 1.0).any() and (norm_hat.abs() < 1).any()


# ---- the margin alone, the statistics, eval ----------------------------------------------


def test_margin_follows_the_formula_and_its_gradient_through_every_region():
    torch.manual_seed(0)
    margin = AdaFace(s=SCALE, m=M, h=H, t_alpha=T_ALPHA)
    theta = torch.linspace(0.0, math.pi, 401, dtype=torch.float64)[1:-1]
    norms = torch.linspace(0.0, 80.0, theta.numel(), dtype=torch.float64)[torch.randperm(399)]
    cos = torch.cos(theta).requires_grad_(True)
    psi = margin(cos, norms)
    mean, std = reference_statistics(20.0, 100.0, norms)
    expected = reference_psi(theta, norms, mean, std)
    assert psi.dtype == torch.float64
    assert_close_rel(psi, expected, 1e-12)
    # d psi / d cos: zero on both clips, sin(theta + g) / sin(theta) between.
    (grad,) = torch.autograd.grad(psi.sum(), cos)
    ref_cos = torch.cos(theta).requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(
        reference_psi(torch.acos(ref_cos), norms, mean, std).sum(), ref_cos
    )
    assert_close_rel(grad, ref_grad, 1e-10)
    # Float32 cosines give float32, within float32 rounding of the same values.
    margin32 = AdaFace(s=SCALE, m=M, h=H, t_alpha=T_ALPHA)
    psi32 = margin32(torch.cos(theta).float(), norms.float())
    assert psi32.dtype == torch.float32
    assert_close_rel(psi32, expected, 1e-5)


def test_running_statistics_after_k_steps_equal_a_recomputation():
    """k training forwards move the statistics as the EMA of the k batches' clipped norms;
    eval and no-grad forwards use them without moving them; a non-finite batch and a batch
    of one row leave what they cannot measure as it was."""
    head = ShardedMarginSoftmax(40, 6, AdaFace(t_alpha=T_ALPHA)).double()
    generator = torch.Generator().manual_seed(3)
    mean, std = 20.0, 100.0
    for step in range(5):
        rows = 4 + step
        scale = torch.rand(rows, 1, generator=generator, dtype=torch.float64) * 50 * (step + 1)
        embeddings = torch.randn(rows, 6, generator=generator, dtype=torch.float64) * scale
        labels = torch.randint(0, 40, (rows,), generator=generator)
        run_head(head, embeddings, labels)
        mean, std = reference_statistics(mean, std, embeddings.norm(dim=1))
        # Norms above 100 occur (clipped): the recomputation clips them too.
        assert head.margin.running_mean.item() == pytest.approx(mean, rel=1e-13)
        assert head.margin.running_std.item() == pytest.approx(std, rel=1e-13)
        # Forwards that do not train change nothing.
        with torch.no_grad():
            head(embeddings, labels)
        head.eval()
        head(embeddings.clone().requires_grad_(True), labels).backward()
        head.train()
        assert head.margin.running_mean.item() == pytest.approx(mean, rel=1e-13)
    assert mean > 20.0 and std < 100.0  # the statistics really moved (norms up to 250)
    nan_rows = torch.full((3, 6), float("nan"), dtype=torch.float64)
    head(nan_rows, torch.tensor([0, 1, 2]))
    one_row = torch.full((1, 6), 2.0, dtype=torch.float64)  # norm 2 * sqrt(6)
    head(one_row, torch.tensor([5]))
    assert head.margin.running_mean.item() == pytest.approx(
        T_ALPHA * 2 * math.sqrt(6) + (1 - T_ALPHA) * mean, rel=1e-13
    )
    assert head.margin.running_std.item() == pytest.approx(std, rel=1e-13)


def test_statistics_are_part_of_the_state_dict_and_stay_float64_at_o2_and_o3():
    for level in ("O2", "O3"):
        torch.manual_seed(0)
        backbone = torch.nn.Linear(12, 6)
        head = ShardedMarginSoftmax(9, 6, AdaFace(t_alpha=T_ALPHA))
        precision = Precision(level, "bf16", torch.device("cpu"))
        precision.prepare(backbone, head)
        assert head.weight.dtype == torch.bfloat16
        assert set(head.state_dict()) == {
            "weight",
            "_extra_state",
            "margin.running_mean",
            "margin.running_std",
        }
        images = torch.randn(8, 12, generator=torch.Generator().manual_seed(1)) * 20
        with precision.autocast():
            embeddings = backbone(precision.cast_inputs(images))
            loss = head(embeddings, torch.arange(8) % 9)
        precision.backward(loss)
        for buffer in (head.margin.running_mean, head.margin.running_std):
            assert buffer.dtype == torch.float64, level
        # The head takes the norms of the float32 gathered embeddings.
        mean, std = reference_statistics(20.0, 100.0, embeddings.float().norm(dim=1))
        assert head.margin.running_mean.item() == pytest.approx(mean, rel=1e-6), level
        assert head.margin.running_std.item() == pytest.approx(std, rel=1e-6), level
        # 0.01-sized steps survive: bf16 would have rounded 20 - 0.3 * (20 - mean) to 20.
        assert head.margin.running_mean.item() != 20.0


def test_fused_update_composes_with_adaface():
    """head.fused_update: the Triton backward steps the rows; the margin only changes the
    target cosine's gradient, so one step equals torch SGD on the torch path's gradient."""
    torch.manual_seed(4)
    fast, slow = make_head(kernel="triton"), make_head(kernel="torch")
    slow.load_state_dict(fast.state_dict())
    settings = {"lr": 0.5, "momentum": 0.9, "weight_decay": 5e-4}
    fast_opt = torch.optim.SGD(fast.parameters(), **settings)
    slow_opt = torch.optim.SGD(slow.parameters(), **settings)
    fast.attach_fused_update(fast_opt)
    slow.attach_optimizer(slow_opt)
    initial = fast.weight.detach().clone()
    for step in range(2):
        _, embeddings, labels = adaface_problem(3, step, torch.float32)
        step_heads(((fast, fast_opt), (slow, slow_opt)), embeddings, labels)
    assert_moved_alike(fast, slow, initial)
    assert torch.equal(fast.margin.running_mean, slow.margin.running_mean)
    config_from_dict(
        {
            "head": {"margin": "adaface", "kernel": "triton", "fused_update": True},
            "optim": {"grad_clip": None},
        }
    )


# ---- checkpoints and train() -----------------------------------------------------------------


def test_a_checkpoint_without_statistics_is_refused_by_name(tmp_path):
    cosface = ShardedMarginSoftmax(9, 6, CosFace())
    path = ckpt.save_checkpoint(tmp_path, 1, {"head": cosface}, keep=1)
    ckpt.load_checkpoint(path, {"head": ShardedMarginSoftmax(9, 6, CosFace())})
    with pytest.raises(ValueError, match="margin.running_mean"):
        ckpt.load_checkpoint(path, {"head": ShardedMarginSoftmax(9, 6, AdaFace())})


def test_resumed_run_continues_the_uninterrupted_one(image_folder, tmp_path):
    from test_engine import losses, tiny_config

    from recognition.training import train

    common = ("head.margin=adaface", "head.t_alpha=0.2", "train.checkpoint_every=3")
    straight = train(tiny_config(image_folder, tmp_path / "straight", "train.max_steps=6", *common))
    split = tmp_path / "split"
    train(tiny_config(image_folder, split, "train.max_steps=3", *common))
    train(tiny_config(image_folder, split, "train.max_steps=6", "train.resume=true", *common))
    a, b = losses(straight), losses(split)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    names = ["head/margin.running_mean", "head/margin.running_std"]
    at_3 = ckpt.read_checkpoint(ckpt.checkpoint_path(split, 3), names)
    want = ckpt.read_checkpoint(ckpt.checkpoint_path(straight, 6), names)
    got = ckpt.read_checkpoint(ckpt.checkpoint_path(split, 6), names)
    for name in names:
        assert got[name].dtype == torch.float64
        assert got[name].item() == pytest.approx(want[name].item(), rel=1e-6), name
        assert got[name].item() != at_3[name].item()  # steps 4-6 moved them


# ---- config ----------------------------------------------------------------------------------


def test_default_and_recipe_configs():
    margin = build_margin("adaface")
    assert (margin.scale, margin.m, margin.h, margin.t_alpha) == (64.0, 0.4, 0.333, 0.01)
    assert (margin.running_mean.item(), margin.running_std.item()) == (20.0, 100.0)
    cfg = load_config("ms1m_adaface")
    assert (cfg.head.margin, cfg.head.m, cfg.head.h, cfg.head.t_alpha) == (
        "adaface",
        0.4,
        0.333,
        0.01,
    )
    assert cfg.model.backbone == "iresnet100" and cfg.optim.milestones == [12, 20, 24]
    assert cfg.optim.schedule == "step" and cfg.train.epochs == 26 and cfg.optim.lr == 0.1
    assert cfg.train.batch_size * 8 == 512 and cfg.optim.weight_decay == 5e-4


@pytest.mark.parametrize(
    ("head", "key"),
    [
        ({"margin": "cosface", "h": 0.3}, "head.h"),
        ({"margin": "arcface", "t_alpha": 0.1}, "head.t_alpha"),
        ({"margin": "adaface", "m": 1.6}, "head.m"),
        ({"margin": "adaface", "m": -0.1}, "head.m"),
        ({"margin": "adaface", "h": -0.5}, "head.h"),
        ({"margin": "adaface", "t_alpha": 1.5}, "head.t_alpha"),
        ({"margin": "adaface", "m1": 1.0}, "head.m1"),
        ({"margin": "adaface", "h": "high"}, "head.h"),
    ],
)
def test_config_errors_name_the_key(head, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"head": head})


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "cosface", "h": 0.3}, "head.h"),
        ({"name": "combined", "t_alpha": 0.1}, "head.t_alpha"),
        ({"name": "adaface", "m": 2.0}, "head.m"),
        ({"name": "adaface", "h": -1.0}, "head.h"),
        ({"name": "adaface", "t_alpha": -0.1}, "head.t_alpha"),
        ({"name": "adaface", "m2": 0.1}, "head.m2"),
    ],
)
def test_build_margin_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_margin(**kwargs)
