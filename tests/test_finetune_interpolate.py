"""Tests for benchmarks/finetune_interpolate.py: the weight average and its table."""

from __future__ import annotations

import pytest
import torch

from benchmarks import finetune_interpolate as fi


def test_the_average_takes_alpha_of_the_fine_tuned_weights_and_its_integer_buffers():
    torch.manual_seed(0)
    before = {"w": torch.randn(3, 4), "bn.num_batches_tracked": torch.tensor(5)}
    after = {"w": torch.randn(3, 4), "bn.num_batches_tracked": torch.tensor(9)}
    mixed = fi.interpolate({"state_dict": before}, {"format": 1, "state_dict": after}, 0.25)
    expected = 0.75 * before["w"].double() + 0.25 * after["w"].double()
    assert torch.allclose(mixed["state_dict"]["w"].double(), expected, atol=1e-6)
    assert mixed["state_dict"]["bn.num_batches_tracked"].item() == 9
    assert mixed["format"] == 1
    for alpha, end in ((0.0, before), (1.0, after)):
        ends = fi.interpolate({"state_dict": before}, {"state_dict": after}, alpha)
        assert torch.equal(ends["state_dict"]["w"], end["w"])
    with pytest.raises(SystemExit, match="different tensors"):
        fi.interpolate({"state_dict": {"v": before["w"]}}, {"state_dict": after}, 0.5)


def test_the_table_gives_the_mean_and_the_mean_per_seed_gain_per_domain():
    runs = []
    for seed, (same, shifted) in enumerate(((0.80, 0.70), (0.78, 0.74))):
        for domain, accuracy in (("same", same), ("shifted", shifted)):
            runs.append({"seed": seed, "domain": domain, "variant": "init_backbone",
                         "alpha": 0.5, "accuracy": accuracy,
                         "no fine-tuning": 0.77 + 0.01 * seed, "init_backbone": 0.75})  # fmt: skip
    table = fi.markdown({"seeds": [0, 1], "runs": runs})
    row = next(line for line in table.splitlines() if line.startswith("| init_backbone |"))
    # same: mean 79.0, gains over no fine-tuning (80-77, 78-78) -> +1.5, over init +4.0;
    # shifted: mean 72.0, gains (70-77, 74-78) -> -5.5, over init -3.0.
    assert row == "| init_backbone | 0.5 | 79.0 | +1.5 | +4.0 | 72.0 | -5.5 | -3.0 |"
