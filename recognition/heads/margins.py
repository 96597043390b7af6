"""Angular and additive margins: the target class's cosine -> its penalised logit (before s).

Every margin here is a function psi(cos theta) applied to the target class's cosine only;
the head then multiplies every logit, penalised or not, by the margin's `scale` s:

    ArcFace      cos(theta + m)                                 additive angular
    CosFace      cos(theta) - m                                 additive cosine
    AMSoftmax    cos(theta) - m                                 the same, other defaults
    SphereFace   (-1)^k cos(m theta) - 2k, k = floor(m theta/pi) multiplicative angular
    Combined     cos(m1 theta + m2) - m3                        all three at once
    AdaFace      cos(theta + g_angle) - g_add, g from the norm  per row, adaptive

All but AdaFace act element-wise on the cosine. AdaFace's margin also depends on each row's
embedding norm (`uses_norms`): the head passes the norms of the raw embeddings beside the
cosines, and the margin keeps running statistics of them (buffers, checkpointed with the
head).

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

from recognition.registry import MARGINS, load


class Margin(nn.Module):
    """Base class: `forward(cos_target)` maps target cosines to margin logits (before s).

    `scale` is the s that the head multiplies every logit by. `forward` takes a tensor of
    any shape holding cosines in [-1, 1] (slightly outside is tolerated) and returns the
    same shape in float32, or float64 when the input is float64.

    `uses_norms`: False for the element-wise margins. True (AdaFace) means `forward` takes a
    second argument, `norms`, the L2 norms of the rows' raw embeddings (the shape of the
    cosines, detached), and the head passes them.
    """

    uses_norms = False

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


# AdaFace's constants, as the authors' code has them (github.com/mk-minchul/AdaFace, head.py).
ADAFACE_EPS = 1e-3  # added to the running std; the angle theta + g is clipped to [eps, pi - eps]
ADAFACE_NORM_CLIP = (1e-3, 100.0)  # norms are clipped to this range before any statistic
ADAFACE_INITIAL_MEAN = 20.0  # the running statistics before the first training forward
ADAFACE_INITIAL_STD = 100.0


class AdaFace(Margin):
    """Quality-adaptive margin (Kim et al., "AdaFace: Quality Adaptive Margin for Face
    Recognition", CVPR 2022): psi = cos(theta + g_angle) - g_add, per row.

    The embedding norm stands for image quality. Each row's norm is standardised by running
    statistics of the norms and squashed into [-1, 1]:

        norm_hat = clip((clip(norm, 0.001, 100) - mean) / (std + eps) * h, -1, 1)
        g_angle  = -m * norm_hat            (an ArcFace-like angular part)
        g_add    = m + m * norm_hat         (a CosFace-like additive part)
        psi      = cos(clip(theta + g_angle, eps, pi - eps)) - g_add,   eps = 1e-3

    so a high-norm (good) image gets a negative angular margin and up to 2m of additive one
    (hard samples weigh more), a low-norm one up to m of angular margin and no additive one
    (hard samples weigh less). The norm enters only through norm_hat, which is a constant
    for autograd: no gradient flows into the norms or the statistics.

    Running statistics (buffers `running_mean`, `running_std`, float64, starting at 20 and
    100): every training forward (module in training mode, grad enabled) first updates them
    with the batch's clipped norms, mean and unbiased std (Bessel's correction, as
    `Tensor.std`), as an exponential moving average with weight t_alpha on the batch, then
    computes norm_hat with the updated values; evaluation and no-grad forwards use them as
    they are. The head passes the norms of the whole global batch (every rank's embeddings,
    gathered), so the statistics are the same on every rank. They are state: the head's
    state_dict (and so its checkpoint) holds them, replicated.

    Followed: the formula and every constant of the authors' `AdaFace` head (head.py of
    github.com/mk-minchul/AdaFace: eps, the norm clip, the initial 20 / 100, the unbiased
    std, the update before use, the theta clip) and their published settings: m = 0.4 and
    h = 0.333 (the training scripts), s = 64 and t_alpha = 0.01 (config.py's defaults; the
    head class's own t_alpha default, 1.0, is not what they train with).
    Deliberate differences:
    - No acos (this module's numerical rules): cos(theta + g) comes from the angle-sum rule,
      and the clip of theta + g to [eps, pi - eps] from comparing the cosine with
      cos(eps - g) and cos(pi - eps - g), which is the same clip without the angle. The
      authors also clamp every cosine (each class's, not only the target's) to
      [-1 + eps, 1 - eps] before their acos; that only keeps acos's gradient finite, so it
      is left out here: the other classes' logits are s cos, and the target's psi is exact
      (and its gradient finite) up to |cos| = 1.
    - Statistics of the global batch. The authors' head sits inside DDP, whose buffer
      broadcast makes every rank use rank 0's statistics of rank 0's local batch.
    - A batch whose statistic is not finite (a NaN embedding) leaves that running value as
      it was, so one bad batch, skipped by the non-finite guard, does not poison every
      later margin; a batch of one row leaves the std as it was (no unbiased std exists).
    - Statistics in float64 whatever the precision level (precision/casting.py leaves the buffers
      named in `keep_dtype_buffers` alone), so the update of 1 % per step is not rounded.
    """

    uses_norms = True
    keep_dtype_buffers = ("running_mean", "running_std")

    def __init__(
        self, s: float = 64.0, m: float = 0.4, h: float = 0.333, t_alpha: float = 0.01
    ) -> None:
        super().__init__(s)
        if not 0.0 <= m < math.pi / 2:
            raise ValueError(f"head.m: AdaFace's margin must lie in [0, pi/2), got {m}")
        if not h >= 0.0:
            raise ValueError(f"head.h: must be >= 0, got {h}")
        if not 0.0 <= t_alpha <= 1.0:
            raise ValueError(f"head.t_alpha: must lie in [0, 1], got {t_alpha}")
        self.m, self.h, self.t_alpha = float(m), float(h), float(t_alpha)
        self.register_buffer(
            "running_mean", torch.tensor(ADAFACE_INITIAL_MEAN, dtype=torch.float64)
        )
        self.register_buffer("running_std", torch.tensor(ADAFACE_INITIAL_STD, dtype=torch.float64))

    def forward(self, cos_target: Tensor, norms: Tensor) -> Tensor:
        cos = cos_target.to(_compute_dtype(cos_target))
        if norms.shape != cos.shape:
            raise ValueError(
                f"AdaFace: norms of shape {tuple(norms.shape)} for cosines of {tuple(cos.shape)}"
            )
        if self.training and torch.is_grad_enabled():
            self.update_statistics(norms)
        norm_hat = self.norm_hat(norms, cos.dtype)
        g_angle = -self.m * norm_hat
        g_add = self.m + self.m * norm_hat
        # cos(theta + g) by the angle-sum rule (no acos: see the module docstring).
        shifted = cos * torch.cos(g_angle) - _sine(cos) * torch.sin(g_angle)
        # theta + g < eps  <=>  theta < eps - g  <=>  cos > cos(eps - g), when eps - g > 0
        # (|g| <= m < pi/2 keeps both angles below pi); likewise at the top, pi - eps - g < pi.
        low, high = ADAFACE_EPS - g_angle, (math.pi - ADAFACE_EPS) - g_angle
        below = (low > 0) & (cos > torch.cos(low))
        above = (high < math.pi) & (cos < torch.cos(high))
        clipped = math.cos(ADAFACE_EPS)  # cos(eps) = -cos(pi - eps)
        psi = torch.where(below, clipped, torch.where(above, -clipped, shifted))
        return psi - g_add

    def norm_hat(self, norms: Tensor, dtype: torch.dtype) -> Tensor:
        """The standardised, clipped norms in [-1, 1], in `dtype`, from the running values."""
        safe = norms.detach().to(dtype).clamp(*ADAFACE_NORM_CLIP)
        mean, std = self.running_mean.to(dtype), self.running_std.to(dtype)
        return ((safe - mean) / (std + ADAFACE_EPS) * self.h).clamp(-1.0, 1.0)

    @torch.no_grad()
    def update_statistics(self, norms: Tensor) -> None:
        """Move the running mean and std towards the batch's (weight t_alpha), in float64.

        On the device, no host read: a statistic that is not finite keeps the old value.
        """
        safe = norms.detach().to(torch.float64).clamp(*ADAFACE_NORM_CLIP).reshape(-1)
        batch = [(self.running_mean, safe.mean())]
        if safe.numel() > 1:  # one row has no unbiased std
            batch.append((self.running_std, safe.std()))
        for running, value in batch:
            moved = self.t_alpha * value + (1.0 - self.t_alpha) * running.to(torch.float64)
            running.copy_(torch.where(torch.isfinite(value), moved, running.to(torch.float64)))

    def extra_repr(self) -> str:
        return f"s={self.scale}, m={self.m}, h={self.h}, t_alpha={self.t_alpha}"


def build_margin(
    name: str,
    scale: float | None = None,
    m: float | None = None,
    m1: float | None = None,
    m2: float | None = None,
    m3: float | None = None,
    h: float | None = None,
    t_alpha: float | None = None,
) -> Margin:
    """The margin called `name` (a key of `recognition.registry.MARGINS`) with s = `scale`
    and its margin values.

    None takes the margin's own default. A value the margin's entry does not list in its
    `keys`, an unknown name, or an out-of-range value raises ValueError naming the config
    key (head.m, ...).
    """
    cls = load(MARGINS, name, "head.margin")
    kwargs: dict[str, float] = {}
    if scale is not None:
        kwargs["s"] = scale
    values = {"m": m, "m1": m1, "m2": m2, "m3": m3, "h": h, "t_alpha": t_alpha}
    takes = MARGINS[name].keys
    for key, value in values.items():
        if value is None:
            continue
        if key not in takes:
            users = " or ".join(n for n, entry in MARGINS.items() if key in entry.keys)
            raise ValueError(
                f"head.{key}: only used with head.margin={users}, not {name} (it takes "
                f"{', '.join(f'head.{k}' for k in takes) or 'no margin value'})"
            )
        kwargs[key] = value
    return cls(**kwargs)
