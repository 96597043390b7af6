"""Parameter groups and the warmup + decay schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from recognition.config import OptimConfig
from recognition.optim import build_optimizer, build_scheduler, lr_factor, param_groups


def test_no_weight_decay_on_bn_prelu_and_bias():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.PReLU(4), nn.Flatten(), nn.Linear(4, 2)
    )
    groups = param_groups([model], weight_decay=5e-4)
    decayed = {id(p) for p in groups[0]["params"]}
    undecayed = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 5e-4 and groups[1]["weight_decay"] == 0.0
    assert decayed == {id(model[0].weight), id(model[4].weight)}
    assert undecayed == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[2].weight),
        id(model[4].bias),
    }


def test_shared_parameter_counted_once():
    lin = nn.Linear(3, 3)
    groups = param_groups([lin, lin], weight_decay=0.1)
    assert sum(len(g["params"]) for g in groups) == 2


def reference_lr(step, total, warmup, peak, floor, schedule, power):
    """Written out independently of the module under test."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / (total - warmup)
    if schedule == "poly":
        return floor + (peak - floor) * (1 - t) ** power
    return floor + (peak - floor) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize("schedule", ["poly", "cosine"])
def test_schedule_stepped_per_optimizer_step(schedule):
    cfg = OptimConfig(lr=0.4, schedule=schedule, poly_power=2.0, min_lr=0.01)
    param = nn.Parameter(torch.zeros(2))
    opt = build_optimizer([{"params": [param], "weight_decay": 0.0}], cfg)
    total, warmup = 50, 5
    sched = build_scheduler(opt, total, warmup, cfg)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [reference_lr(s, total, warmup, 0.4, 0.01, schedule, 2.0) for s in range(total)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert max(seen) == pytest.approx(0.4)
    assert lr_factor(total, total, warmup, cfg) == pytest.approx(0.01 / 0.4)


def test_step_schedule_is_multisteplr_stepped_per_epoch():
    """schedule=step against torch's MultiStepLR stepped once per epoch (AdaFace's recipe),
    read at every optimizer step; milestones of fractional epochs round to steps."""
    steps_per_epoch, epochs = 7, 6
    cfg = OptimConfig(lr=0.1, schedule="step", milestones=[2, 4, 5], gamma=0.1)
    param = nn.Parameter(torch.zeros(2))
    opt = build_optimizer([{"params": [param], "weight_decay": 0.0}], cfg)
    sched = build_scheduler(opt, epochs * steps_per_epoch, 0, cfg, steps_per_epoch)
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    ref = torch.optim.lr_scheduler.MultiStepLR(ref_opt, milestones=[2, 4, 5], gamma=0.1)
    seen, expected = [], []
    for _ in range(epochs):
        for _ in range(steps_per_epoch):
            seen.append(opt.param_groups[0]["lr"])
            expected.append(ref_opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        ref_opt.step()
        ref.step()
    assert seen == pytest.approx(expected, rel=1e-12)
    assert len(set(seen)) == 4
    # Warmup multiplies in; a milestone of 1.5 epochs is step round(10.5) = 10.
    warm = OptimConfig(lr=0.1, schedule="step", milestones=[1.5], gamma=0.5)
    assert [lr_factor(s, 42, 4, warm, [10]) for s in (0, 3, 9, 10)] == [0.25, 1.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="steps_per_epoch"):
        build_scheduler(opt, 42, 0, cfg)


@pytest.mark.parametrize(
    ("optim", "train", "key"),
    [
        ({"milestones": [12]}, {}, "optim.milestones"),  # not a step schedule
        ({"schedule": "step", "milestones": [12, 12]}, {}, "optim.milestones"),
        ({"schedule": "step", "milestones": [0, 3]}, {}, "optim.milestones"),
        ({"schedule": "step", "milestones": [12, 30]}, {"epochs": 26}, "optim.milestones"),
        ({"schedule": "step", "gamma": 0.0}, {}, "optim.gamma"),
        ({"schedule": "step", "gamma": 1.5}, {}, "optim.gamma"),
    ],
)
def test_step_schedule_config_errors_name_the_key(optim, train, key):
    from recognition.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"optim": optim, "train": train})


def test_adamw_built_with_betas():
    cfg = OptimConfig(name="adamw", lr=1e-3, betas=[0.8, 0.9])
    opt = build_optimizer([{"params": [nn.Parameter(torch.zeros(1))], "weight_decay": 0.05}], cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert opt.param_groups[0]["weight_decay"] == 0.05


@pytest.mark.parametrize("name", ["sgd", "adamw", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_optimizer_steps_right_on_cpu_parameters_of_every_dtype(name, dtype):
    """Three steps of the project's optimizer (fused where `fused_is_sound` allows) against
    the same update written out in float64: within the parameters' own rounding. torch
    2.11's fused SGD gets bf16 momentum wrong on the CPU (garbage in the buffer), which is
    why it is not used there; this test fails if it were."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(64, generator=generator)
    grads = [torch.randn(64, generator=generator) for _ in range(3)]
    param = nn.Parameter(start.to(dtype))
    cfg = OptimConfig(name=name, lr=0.1)
    optimizer = build_optimizer([{"params": [param], "weight_decay": 0.01}], cfg)
    weight = start.to(dtype).double()
    buffer = torch.zeros(64, dtype=torch.float64)
    second = torch.zeros(64, dtype=torch.float64)
    beta1, beta2 = cfg.betas
    for step, grad in enumerate(grads, start=1):
        param.grad = grad.to(dtype)
        optimizer.step()
        g = grad.to(dtype).double()
        if name == "sgd":  # torch.optim.SGD: d = g + wd w; buf = m buf + d; w -= lr buf
            buffer = cfg.momentum * buffer + g + 0.01 * weight
            weight = weight - 0.1 * buffer
        else:  # AdamW: decoupled decay; Adam: an L2 term in the gradient; both bias-corrected
            if name == "adamw":
                weight = weight * (1 - 0.1 * 0.01)
            else:
                g = g + 0.01 * weight
            buffer = beta1 * buffer + (1 - beta1) * g
            second = beta2 * second + (1 - beta2) * g * g
            denominator = (second / (1 - beta2**step)).sqrt() + 1e-8
            weight = weight - 0.1 * (buffer / (1 - beta1**step)) / denominator
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 rounds each step's weight
    torch.testing.assert_close(param.detach().double(), weight, rtol=tolerance, atol=tolerance)
