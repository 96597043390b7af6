"""Angular and additive margins: the target class's cosine -> its penalised logit (before s).

Every margin here is a function psi(cos theta) applied to the target class's cosine only;
the head then multiplies every logit, penalised or not, by the margin's `scale` s:

    ArcFace      cos(theta + m)                                 additive angular
    CosFace      cos(theta) - m                                 additive cosine
    AMSoftmax    cos(theta) - m                                 the same, other defaults
    SphereFace   (-1)^k cos(m theta) - 2k, k = floor(m theta/pi) multiplicative angular
    Combined     cos(m1 theta + m2) - m3                        all three at once

Two numerical rules hold for all of them:

- The margin is computed in float32 (float64 for float64 input) and returned in that dtype,
  whatever the input dtype: half precision cannot resolve cos(m) or the sine near +-1.
- Nothing calls acos. Its derivative -1/sin(theta) is infinite at cos = +-1, which happens
  exactly when an embedding sits on its class centre (or opposite it). The sine is computed
  as sqrt((1 - c)(1 + c)) with the radicand clamped at the dtype's smallest normal number:
  only a radicand of exactly zero (or negative, when rounding pushes |c| past 1) is clamped,
  so values are exact and gradients are the true ones everywhere else, and at |c| = 1 the
  sine's derivative is taken as zero instead of infinite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class Margin(nn.Module):
    """Base class: `forward(cos_target)` maps target cosines to margin logits (before s).

    `scale` is the s that the head multiplies every logit by. `forward` takes a tensor of
    any shape holding cosines in [-1, 1] (slightly outside is tolerated) and returns the
    same shape in float32, or float64 when the input is float64.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"head.scale: must be positive, got {scale}")
        self.scale = float(scale)

    def forward(self, cos_target: Tensor) -> Tensor:
        raise NotImplementedError


def _compute_dtype(cos: Tensor) -> torch.dtype:
    """float32 for half and float32 input, float64 for float64 input."""
    return torch.promote_types(cos.dtype, torch.float32)


def _sine(cos: Tensor) -> Tensor:
    """sin(theta) from cos(theta), theta in [0, pi], finite in value and gradient at +-1."""
    # (1 - c)(1 + c) rather than 1 - c^2: no cancellation near c = +-1.
    radicand = (1.0 - cos) * (1.0 + cos)
    # The clamp only bites at a radicand of exactly 0 (or below, when rounding pushes |c|
    # past 1): the smallest nonzero (1 - c)(1 + c) is about 2 ulp(1), far above `tiny`.
    # Below the bound the clamp passes no gradient, so sqrt's infinite slope never enters.
    return torch.sqrt(radicand.clamp(min=torch.finfo(cos.dtype).tiny))


def _angle(cos: Tensor) -> Tensor:
    """theta = acos(cos) in [0, pi] with a finite gradient at +-1 (atan2 of sine, cosine)."""
    return torch.atan2(_sine(cos), cos)


def _check_angle(name: str, value: float) -> float:
    if not 0.0 <= value < math.pi:
        raise ValueError(f"{name}: an angular margin must lie in [0, pi), got {value}")
    return float(value)


class ArcFace(Margin):
    """Additive angular margin: psi = cos(theta + m) (Deng et al., ArcFace).

    cos(theta + m) stops decreasing once theta + m passes pi, which would reward a class
    for moving *away* from its centre. For theta > pi - m (cos < cos(pi - m)) this uses the
    insightface fallback cos(theta) - m*sin(m), a cosine margin, but shifted so that the two
    pieces meet: psi = cos(theta) + cos(m) - 1, which equals -1 = cos(pi) at theta = pi - m.
    (insightface's unshifted piece jumps down by 1 - cos(m) - m*sin(m) there.) The result is
    continuous and strictly decreasing on [0, pi], and below cos(theta) for every theta when
    m > 0.
    """

    def __init__(self, s: float = 64.0, m: float = 0.5) -> None:
        super().__init__(s)
        self.m = _check_angle("head.m", m)
        self.cos_m = math.cos(self.m)
        self.sin_m = math.sin(self.m)
        # The fallback takes over below this cosine (theta above pi - m).
        self.threshold = math.cos(math.pi - self.m)

    def forward(self, cos_target: Tensor) -> Tensor:
        cos = cos_target.to(_compute_dtype(cos_target))
        # cos(theta + m) by the angle-sum rule: no acos, so no infinite slope at +-1.
        arc = cos * self.cos_m - _sine(cos) * self.sin_m
        fallback = cos + (self.cos_m - 1.0)
        return torch.where(cos > self.threshold, arc, fallback)

    def extra_repr(self) -> str:
        return f"s={self.scale}, m={self.m}"


class CosFace(Margin):
    """Additive cosine margin: psi = cos(theta) - m (Wang et al., CosFace / LMCL)."""

    def __init__(self, s: float = 64.0, m: float = 0.4) -> None:
        super().__init__(s)
        if not m >= 0:
            raise ValueError(f"head.m: a cosine margin must be >= 0, got {m}")
        self.m = float(m)

    def forward(self, cos_target: Tensor) -> Tensor:
        return cos_target.to(_compute_dtype(cos_target)) - self.m

    def extra_repr(self) -> str:
        return f"s={self.scale}, m={self.m}"


class AMSoftmax(CosFace):
    """Additive margin softmax: psi = cos(theta) - m (Wang et al., AM-Softmax).

    The formula is CosFace's; the paper's defaults differ (s = 30, m = 0.35).
    """

    def __init__(self, s: float = 30.0, m: float = 0.35) -> None:
        super().__init__(s, m)


class SphereFace(Margin):
    """Multiplicative angular margin (Liu et al., SphereFace / A-Softmax).

    psi(theta) = (-1)^k cos(m theta) - 2k with k = floor(m theta / pi), which is continuous
    and strictly decreasing on [0, pi] (each piece falls from 1 - 2k to -1 - 2k). m must be a
    positive integer: cos(m theta) is then the Chebyshev polynomial T_m(cos theta), exact and
    smooth at cos = +-1, and k is counted from cos against the thresholds cos(j pi / m).

    This is the plain margin: there is no lambda annealing (the paper's
    (lambda cos + psi) / (1 + lambda) warm-up), and unlike the paper the features are
    normalised, with the head's s as their norm.
    """

    def __init__(self, s: float = 64.0, m: int = 4) -> None:
        super().__init__(s)
        if isinstance(m, bool) or not float(m).is_integer() or m < 1:
            raise ValueError(f"head.m: SphereFace needs a positive integer margin, got {m}")
        self.m = int(m)
        # theta >= j pi / m  <=>  cos <= cos(j pi / m), for j = 1..m.
        self.thresholds = [math.cos(j * math.pi / self.m) for j in range(1, self.m + 1)]

    def forward(self, cos_target: Tensor) -> Tensor:
        cos = cos_target.to(_compute_dtype(cos_target))
        # T_m by the recurrence T_{n+1} = 2 c T_n - T_{n-1}, T_0 = 1, T_1 = c.
        previous, current = torch.ones_like(cos), cos
        for _ in range(self.m - 1):
            previous, current = current, 2.0 * cos * current - previous
        k = torch.zeros_like(cos)
        for threshold in self.thresholds:
            k = k + (cos <= threshold).to(cos.dtype)
        sign = 1.0 - 2.0 * torch.remainder(k, 2.0)  # (-1)^k
        return sign * current - 2.0 * k

    def extra_repr(self) -> str:
        return f"s={self.scale}, m={self.m}"


class CombinedMargin(Margin):
    """insightface's combined margin: psi = cos(m1 theta + m2) - m3.

    m1 = 1, m3 = 0 is ArcFace; m1 = 1, m2 = 0 is CosFace; m2 = m3 = 0 with an integer m1 is
    SphereFace before its piecewise extension. Past theta_b = (pi - m2) / m1, where
    m1 theta + m2 passes pi and the cosine would turn back up, this uses ArcFace's fallback,
    the cosine margin that meets the curve at theta_b: psi = cos(theta) - cos(theta_b) - 1 - m3.
    So CombinedMargin(m1=1, m2=m, m3=0) is exactly ArcFace(m). The result is continuous and
    strictly decreasing on [0, pi] and, with m1 >= 1, m2 >= 0, m3 >= 0, never above cos(theta).
    """

    def __init__(self, s: float = 64.0, m1: float = 1.0, m2: float = 0.5, m3: float = 0.0) -> None:
        super().__init__(s)
        if not m1 >= 1.0:
            raise ValueError(f"head.m1: the multiplicative margin must be >= 1, got {m1}")
        if not m3 >= 0.0:
            raise ValueError(f"head.m3: the cosine margin must be >= 0, got {m3}")
        self.m1 = float(m1)
        self.m2 = _check_angle("head.m2", m2)
        self.m3 = float(m3)
        theta_b = (math.pi - self.m2) / self.m1
        self.threshold = math.cos(theta_b)

    def forward(self, cos_target: Tensor) -> Tensor:
        cos = cos_target.to(_compute_dtype(cos_target))
        if self.m1 == 1.0:
            # The angle-sum rule is exact and cheaper than going through the angle.
            main = cos * math.cos(self.m2) - _sine(cos) * math.sin(self.m2)
        else:
            main = torch.cos(self.m1 * _angle(cos) + self.m2)
        fallback = cos - (self.threshold + 1.0)
        return torch.where(cos > self.threshold, main, fallback) - self.m3

    def extra_repr(self) -> str:
        return f"s={self.scale}, m1={self.m1}, m2={self.m2}, m3={self.m3}"


MARGINS: dict[str, type[Margin]] = {
    "arcface": ArcFace,
    "cosface": CosFace,
    "sphereface": SphereFace,
    "am_softmax": AMSoftmax,
    "combined": CombinedMargin,
}


def build_margin(
    name: str,
    scale: float | None = None,
    m: float | None = None,
    m1: float | None = None,
    m2: float | None = None,
    m3: float | None = None,
) -> Margin:
    """The margin called `name` (a key of MARGINS) with s = `scale` and its margin values.

    None takes the margin's own default. `m` belongs to arcface / cosface / sphereface /
    am_softmax and `m1`, `m2`, `m3` to combined; giving one to the wrong margin, an unknown
    name, or an out-of-range value raises ValueError naming the config key (head.m, ...).
    """
    if name not in MARGINS:
        raise ValueError(f"head.margin: unknown margin {name!r} (choose from {', '.join(MARGINS)})")
    kwargs: dict[str, float] = {}
    if scale is not None:
        kwargs["s"] = scale
    if name == "combined":
        if m is not None:
            raise ValueError("head.m: the combined margin takes head.m1, head.m2 and head.m3")
        for key, value in (("m1", m1), ("m2", m2), ("m3", m3)):
            if value is not None:
                kwargs[key] = value
    else:
        for key, value in (("m1", m1), ("m2", m2), ("m3", m3)):
            if value is not None:
                raise ValueError(f"head.{key}: only used with head.margin=combined, not {name}")
        if m is not None:
            kwargs["m"] = m
    return MARGINS[name](**kwargs)
