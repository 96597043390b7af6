"""Margins against float64 formulas written here from the angle (acos), plus their numerics."""

from __future__ import annotations

import math

import pytest
import torch

from recognition.heads.margins import (
    MARGINS,
    AMSoftmax,
    ArcFace,
    CombinedMargin,
    CosFace,
    Margin,
    SphereFace,
    build_margin,
)
from recognition.registry import load

PI = math.pi


# ---- references: psi(theta) written from the papers' definitions, in float64 ------------


def ref_arcface(theta: torch.Tensor, m: float) -> torch.Tensor:
    # cos(theta + m) while theta + m <= pi, then the documented continuous cosine fallback.
    return torch.where(theta + m <= PI, torch.cos(theta + m), torch.cos(theta) + math.cos(m) - 1)


def ref_cosface(theta: torch.Tensor, m: float) -> torch.Tensor:
    return torch.cos(theta) - m


def ref_sphereface(theta: torch.Tensor, m: int) -> torch.Tensor:
    k = torch.floor(m * theta / PI)
    return (-1.0) ** k * torch.cos(m * theta) - 2 * k


def ref_combined(theta: torch.Tensor, m1: float, m2: float, m3: float) -> torch.Tensor:
    theta_b = (PI - m2) / m1
    main = torch.cos(m1 * theta + m2) - m3
    fallback = torch.cos(theta) - math.cos(theta_b) - 1 - m3
    return torch.where(theta <= theta_b, main, fallback)


def sphere_joints(m: int) -> list[float]:
    # Where SphereFace's pieces join: smooth to first order only, so finite differences
    # straddling them pick up the jump in the second derivative.
    return [math.cos(j * PI / m) for j in range(1, m)]


# (id, margin, reference psi(theta), cosines where psi is not twice differentiable)
CASES = [
    ("arcface", ArcFace(), lambda t: ref_arcface(t, 0.5), [math.cos(PI - 0.5)]),
    ("arcface_m0.2", ArcFace(m=0.2), lambda t: ref_arcface(t, 0.2), [math.cos(PI - 0.2)]),
    ("arcface_m1.2", ArcFace(s=30.0, m=1.2), lambda t: ref_arcface(t, 1.2), [math.cos(PI - 1.2)]),
    ("cosface", CosFace(), lambda t: ref_cosface(t, 0.4), []),
    ("am_softmax", AMSoftmax(), lambda t: ref_cosface(t, 0.35), []),
    ("sphereface", SphereFace(), lambda t: ref_sphereface(t, 4), sphere_joints(4)),
    ("sphereface_m2", SphereFace(m=2), lambda t: ref_sphereface(t, 2), sphere_joints(2)),
    ("sphereface_m3", SphereFace(m=3), lambda t: ref_sphereface(t, 3), sphere_joints(3)),
    ("combined", CombinedMargin(), lambda t: ref_combined(t, 1.0, 0.5, 0.0), [math.cos(PI - 0.5)]),
    (
        "combined_1_0.3_0.2",
        CombinedMargin(m1=1.0, m2=0.3, m3=0.2),
        lambda t: ref_combined(t, 1.0, 0.3, 0.2),
        [math.cos(PI - 0.3)],
    ),
    (
        "combined_2_0.3_0.2",
        CombinedMargin(m1=2.0, m2=0.3, m3=0.2),
        lambda t: ref_combined(t, 2.0, 0.3, 0.2),
        [math.cos((PI - 0.3) / 2.0)],
    ),
    (
        "combined_1.35_0.25_0.1",
        CombinedMargin(m1=1.35, m2=0.25, m3=0.1),
        lambda t: ref_combined(t, 1.35, 0.25, 0.1),
        [math.cos((PI - 0.25) / 1.35)],
    ),
]
IDS = [case[0] for case in CASES]


def dense_theta(num: int = 20001) -> torch.Tensor:
    return torch.linspace(0.0, PI, num, dtype=torch.float64)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_match_acos_reference_float64(case):
    _, margin, reference, _ = case
    generator = torch.Generator().manual_seed(0)
    random_cos = torch.rand(4000, generator=generator, dtype=torch.float64) * 2 - 1
    grid_cos = torch.cos(torch.linspace(1e-6, PI - 1e-6, 4001, dtype=torch.float64))
    cos = torch.cat([random_cos, grid_cos])
    expected = reference(torch.acos(cos))
    actual = margin(cos)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_float32(case):
    _, margin, reference, _ = case
    cos64 = torch.cos(torch.linspace(1e-3, PI - 1e-3, 2001, dtype=torch.float64))
    cos32 = cos64.float()
    actual = margin(cos32)
    assert actual.dtype == torch.float32
    expected = reference(torch.acos(cos32.double()))
    # SphereFace's T_4 multiplies rounding by up to m^2 = 16; a few float32 ulps of that.
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_half_input_computes_and_returns_float32(case, dtype):
    _, margin, reference, _ = case
    cos = torch.cat([torch.linspace(-1, 1, 257), torch.tensor([1.0, -1.0])]).to(dtype)
    cos.requires_grad_(True)
    out = margin(cos)
    assert out.dtype == torch.float32
    # Computed from the half value exactly, not rounded back to half on the way.
    expected = reference(torch.acos(cos.detach().double().clamp(-1, 1)))
    torch.testing.assert_close(out.detach().double(), expected, rtol=0, atol=2e-5)
    out.sum().backward()
    assert cos.grad.dtype == dtype
    assert torch.isfinite(cos.grad).all()


def away_from(points, joints, distance):
    """The points farther than `distance` from every joint."""
    for joint in joints:
        points = points[(points - joint).abs() > distance]
    return points


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck_interior(case):
    _, margin, _, joints = case
    # Keep the finite differences away from the joints of the pieces.
    points = away_from(torch.linspace(-0.97, 0.97, 23, dtype=torch.float64), joints, 1e-3)
    points.requires_grad_(True)
    assert torch.autograd.gradcheck(margin, (points,), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_matches_acos_reference(case):
    # gradcheck compares against the code's own values; this compares the slope with the
    # slope of the independent formula (autograd through acos), away from +-1.
    _, margin, reference, joints = case
    # At the fallback's joint psi has two one-sided slopes; skip that point.
    cos = away_from(torch.linspace(-0.99, 0.99, 199, dtype=torch.float64), joints, 1e-6)
    cos_ref = cos.clone().requires_grad_(True)
    reference(torch.acos(cos_ref)).sum().backward()
    cos.requires_grad_(True)
    margin(cos).sum().backward()
    torch.testing.assert_close(cos.grad, cos_ref.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_finite_at_plus_and_minus_one(case, dtype):
    _, margin, reference, _ = case
    cos = torch.tensor([1.0, -1.0], dtype=dtype, requires_grad=True)
    out = margin(cos)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(cos.grad).all()
    # The values are the limits theta = 0 and theta = pi of the formula.
    expected = reference(torch.tensor([0.0, PI], dtype=torch.float64))
    torch.testing.assert_close(out.detach().double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_finite_just_outside_plus_and_minus_one(case):
    # Normalised dot products can round to 1 + ulp; that must not make a NaN.
    one = torch.tensor(1.0)
    beyond = torch.nextafter(one, torch.tensor(2.0))
    cos = torch.stack([beyond, -beyond]).requires_grad_(True)
    out = case[1](cos)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(cos.grad).all()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_monotone_decreasing_in_theta(case):
    _, margin, _, _ = case
    theta = dense_theta()
    psi64 = margin(torch.cos(theta))
    assert (psi64.diff() < 0).all(), "psi must fall strictly as theta grows (float64)"
    # In float32, neighbouring grid points can round to the same cosine: allow rounding.
    psi32 = margin(torch.cos(theta).float())
    assert (psi32.diff() <= 1e-6).all()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_target_logit_is_penalised(case):
    _, margin, _, _ = case
    theta = dense_theta()[1:]  # (0, pi]; at theta = 0 SphereFace has no margin
    cos = torch.cos(theta)
    assert (margin(cos) < cos).all()


def test_insightface_fallback_would_jump_but_ours_is_continuous():
    # At theta = pi - m the arc piece is cos(pi) = -1; the fallback meets it there.
    margin = ArcFace(m=0.5)
    theta_b = torch.tensor(PI - 0.5, dtype=torch.float64)
    around = torch.cos(torch.stack([theta_b - 1e-9, theta_b + 1e-9]))
    values = margin(around)
    torch.testing.assert_close(values, torch.full_like(values, -1.0), rtol=0, atol=1e-8)
    # insightface's unshifted piece would be cos(theta) - m sin(m) there: well below -1.
    insightface = math.cos(PI - 0.5) - 0.5 * math.sin(0.5)
    assert insightface < -1.1


def test_combined_margin_special_cases():
    cos = torch.cos(dense_theta(5001))
    torch.testing.assert_close(CombinedMargin(m1=1.0, m2=0.5, m3=0.0)(cos), ArcFace(m=0.5)(cos))
    torch.testing.assert_close(CombinedMargin(m1=1.0, m2=0.0, m3=0.35)(cos), CosFace(m=0.35)(cos))
    torch.testing.assert_close(CombinedMargin(m1=1.0, m2=0.0, m3=0.0)(cos), cos)


def test_sphereface_m1_is_plain_cosine():
    cos = torch.cos(dense_theta(5001))
    torch.testing.assert_close(SphereFace(m=1)(cos), cos)


def test_margins_are_modules_with_a_scale():
    for name in MARGINS:
        margin = load(MARGINS, name, "head.margin")()
        assert isinstance(margin, Margin), name
        assert margin.scale > 0


# ---- build_margin ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls", "defaults"),
    [
        ("arcface", ArcFace, {"scale": 64.0, "m": 0.5}),
        ("cosface", CosFace, {"scale": 64.0, "m": 0.4}),
        ("am_softmax", AMSoftmax, {"scale": 30.0, "m": 0.35}),
        ("sphereface", SphereFace, {"scale": 64.0, "m": 4}),
        ("combined", CombinedMargin, {"scale": 64.0, "m1": 1.0, "m2": 0.5, "m3": 0.0}),
    ],
)
def test_build_margin_defaults(name, cls, defaults):
    margin = build_margin(name)
    assert type(margin) is cls
    for key, value in defaults.items():
        assert getattr(margin, key) == value, key


def test_build_margin_overrides():
    arc = build_margin("arcface", scale=32.0, m=0.3)
    assert (arc.scale, arc.m) == (32.0, 0.3)
    sphere = build_margin("sphereface", m=2)
    assert sphere.m == 2 and sphere.scale == 64.0
    combined = build_margin("combined", scale=16.0, m1=1.2, m3=0.1)
    assert (combined.scale, combined.m1, combined.m2, combined.m3) == (16.0, 1.2, 0.5, 0.1)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "softmax"}, "head.margin"),
        ({"name": "combined", "m": 0.5}, "head.m"),
        ({"name": "arcface", "m1": 1.0}, "head.m1"),
        ({"name": "cosface", "m2": 0.1}, "head.m2"),
        ({"name": "sphereface", "m3": 0.1}, "head.m3"),
        ({"name": "arcface", "m": -0.1}, "head.m"),
        ({"name": "arcface", "m": 3.5}, "head.m"),
        ({"name": "cosface", "m": -0.4}, "head.m"),
        ({"name": "sphereface", "m": 2.5}, "head.m"),
        ({"name": "sphereface", "m": 0}, "head.m"),
        ({"name": "combined", "m1": 0.5}, "head.m1"),
        ({"name": "combined", "m2": -0.1}, "head.m2"),
        ({"name": "combined", "m3": -0.1}, "head.m3"),
        ({"name": "arcface", "scale": 0.0}, "head.scale"),
        ({"name": "cosface", "scale": -1.0}, "head.scale"),
    ],
)
def test_build_margin_rejects_bad_arguments(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_margin(**kwargs)
