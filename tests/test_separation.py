"""The centroid pass's separation statistic (recognition/training/finetune/separation.py) against a
plain float64 loop over every pair, and the warning it drives
(recognition/training/finetune/__init__.py). Over several ranks: tests/test_finetune.py's centroid
test checks what `init_centroids` returns at world sizes 1 and 3."""

from __future__ import annotations

import dataclasses
import math

import helpers
import pytest
import torch
import torch.nn.functional as F

from recognition.config import load_config
from recognition.training.finetune import (
    POOR_SEPARATION,
    held_near_start,
    poor_separation_warning,
)
from recognition.training.finetune.separation import PairMoments, Separation

# Class sizes: single images (no same pair), a class in one batch, classes that run over
# two and over three batches of the sizes below.
SIZES = [1, 3, 9, 2, 1, 7, 4, 1, 12, 2]


def embeddings_of(sizes: list[int], dim: int = 6, spread: float = 1.0):
    """(N, D) float64 unit embeddings around a random direction per class, sorted labels."""
    generator = torch.Generator().manual_seed(3)
    labels = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    centres = torch.randn(len(sizes), dim, generator=generator, dtype=torch.float64)
    noise = torch.randn(len(labels), dim, generator=generator, dtype=torch.float64)
    return F.normalize(centres[labels] + spread * noise, dim=1), labels


def separation_of(x: torch.Tensor, labels: torch.Tensor, batch: int) -> Separation:
    moments = PairMoments(x.shape[1], torch.device("cpu"))
    for rows in torch.arange(len(labels)).split(batch):
        moments.update(x[rows], labels[rows])
    return moments.finish()


@pytest.mark.parametrize("batch", [1, 4, 5, 100])
def test_pair_statistics_match_a_plain_loop_over_the_pairs(batch):
    x, labels = embeddings_of(SIZES)
    got = dataclasses.asdict(separation_of(x, labels, batch))
    want = helpers.plain_pair_statistics(x.numpy(), labels.numpy())
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    got_d = separation_of(x, labels, batch).d_prime
    pooled = math.sqrt((want["same_std"] ** 2 + want["different_std"] ** 2) / 2)
    assert got_d == pytest.approx((want["same_mean"] - want["different_mean"]) / pooled)


def test_without_same_identity_pairs_d_prime_is_nan_and_nothing_is_said():
    x, labels = embeddings_of([1] * 6)
    separation = separation_of(x, labels, 4)
    assert separation.num_same_pairs == 0 and math.isnan(separation.d_prime)
    assert poor_separation_warning(separation, ["model.freeze_bn=true"]) is None


def test_tight_classes_separate_better_than_loose_ones():
    tight = separation_of(*embeddings_of(SIZES, spread=0.1), batch=4).d_prime
    loose = separation_of(*embeddings_of(SIZES, spread=3.0), batch=4).d_prime
    assert tight > POOR_SEPARATION > loose


def cfg(*overrides: str):
    return load_config("finetune", ["train.init_backbone=x.pt", *overrides])


def test_the_settings_that_hold_the_backbone_near_its_start():
    free = ["model.freeze_bn=false", "optim.backbone_lr_scale=0.1", "train.head_only_steps=24"]
    assert held_near_start(cfg(*free), total_steps=100) == []
    held = held_near_start(
        cfg("model.freeze_bn=true", "optim.backbone_lr_scale=0.05", "train.head_only_steps=25"),
        total_steps=100,
    )
    assert held == [
        "model.freeze_bn=true",
        "optim.backbone_lr_scale=0.05",
        "train.head_only_steps=25 of 100",
    ]


def test_the_warning_speaks_only_when_held_near_start_and_poorly_separated():
    poor = separation_of(*embeddings_of(SIZES, spread=3.0), batch=4)
    good = separation_of(*embeddings_of(SIZES, spread=0.1), batch=4)
    message = poor_separation_warning(poor, ["model.freeze_bn=true"])
    assert message is not None and "\n" not in message
    assert "model.freeze_bn=true" in message and f"d' {poor.d_prime:.2f}" in message
    assert poor_separation_warning(good, ["model.freeze_bn=true"]) is None
    assert poor_separation_warning(poor, []) is None
