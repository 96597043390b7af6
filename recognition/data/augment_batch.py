"""`augment_batch`: a batch's `SampleAugment`s applied on its device, batched (the GPU path).

The same operations as `recognition.data.augment.apply_augment`, which applies them one image
at a time with torchvision's functional transforms, written so that each is a few tensor
operations over every sample that has it, whatever the device (tests run them on CPU tensors
and compare with `apply_augment`):

    crop, low_res   separable linear maps: out = A_y @ image @ A_x^T with per-sample (H, H)
                    and (W, W) matrices holding torch's antialiased bilinear weights
                    (`interpolation_matrix`), so boxes and sizes differ from sample to sample
                    in one batched matmul
    in_place, erase a per-sample box mask and torch.where
    colour, grey    per-sample factors as (n, 1, 1, 1) tensors
    blur            one grouped convolution, a kernel per sample and channel

The parameters were drawn on the host (in the loader's workers); what goes to the device is
a handful of small tensors per batch, copied without waiting (`non_blocking`). Nothing here
reads a device value back, so the host never waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from recognition.data.augment import ERASE_VALUE, SampleAugment

_LUMA = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights (ITU-R 601-2)


def augment_batch(images: torch.Tensor, params: Sequence[SampleAugment]) -> torch.Tensor:
    """(B, 3, H, W) float `images` in [0, 1] augmented by `params` (one per sample), on
    their device: what `apply_augment` makes of each, to float rounding."""
    height, width = images.shape[-2:]
    device = images.device
    x = images

    resized = [i for i, p in enumerate(params) if p.crop is not None and not p.crop_in_place]
    if resized:
        boxes = _host([params[i].crop for i in resized], device)  # (n, 4) top, left, h, w
        n = len(resized)
        full_h = _host([height] * n, device)
        full_w = _host([width] * n, device)
        a_y = interpolation_matrix(boxes[:, 0], boxes[:, 2], full_h, height, height)
        a_x = interpolation_matrix(boxes[:, 1], boxes[:, 3], full_w, width, width)
        x = _at(x, resized, lambda sub: _linear_map(sub, a_y, a_x))

    in_place = [i for i, p in enumerate(params) if p.crop is not None and p.crop_in_place]
    if in_place:
        mask = _box_mask([params[i].crop for i in in_place], height, width, device)
        x = _at(x, in_place, lambda sub: torch.where(mask, sub, 0.0))

    if any(p.flip for p in params):
        flips = _host([p.flip for p in params], device, torch.bool).view(-1, 1, 1, 1)
        x = torch.where(flips, x.flip(-1), x)

    coloured = [i for i, p in enumerate(params) if p.colour is not None]
    if coloured:
        factors = _host([params[i].colour for i in coloured], device, torch.float32)
        x = _at(x, coloured, lambda sub: _colour(sub, factors))

    grey = [i for i, p in enumerate(params) if p.grey]
    if grey:
        x = _at(x, grey, lambda sub: _luma(sub).expand_as(sub))

    low = [i for i, p in enumerate(params) if p.low_res is not None]
    if low:
        sizes = _host([params[i].low_res for i in low], device)  # (n, 2)
        x = _at(x, low, lambda sub: _low_res(sub, sizes, [params[i].low_res for i in low]))

    blurred = [i for i, p in enumerate(params) if p.blur is not None]
    for kernel in sorted({params[i].blur[0] for i in blurred}):  # type: ignore[index]
        members = [i for i in blurred if params[i].blur[0] == kernel]  # type: ignore[index]
        sigmas = _host([params[i].blur[1] for i in members], device, torch.float32)  # type: ignore[index]
        x = _at(x, members, lambda sub, k=kernel, s=sigmas: _blur(sub, k, s))

    erased = [i for i, p in enumerate(params) if p.erase is not None]
    if erased:
        mask = _box_mask([params[i].erase for i in erased], height, width, device)
        x = _at(x, erased, lambda sub: torch.where(mask, ERASE_VALUE, sub))
    return x


def interpolation_matrix(
    start: torch.Tensor, length: torch.Tensor, out_length: torch.Tensor, out_size: int, in_size: int
) -> torch.Tensor:
    """(n, out_size, in_size): per sample, the linear map that resizes the span
    [start, start + length) of an axis of `in_size` pixels to `out_length` pixels, as torch's
    antialiased bilinear resize does (`interpolate(..., antialias=True)`).

    Output pixel i takes input pixel p with the weight tri((p - start + 0.5 - c_i) / s), c_i
    = scale (i + 0.5), scale = length / out_length, s = max(scale, 1), tri(t) = max(0, 1 -
    |t|), normalised over the span. The span may reach outside the axis (pad): those pixels
    are black, so their weights fall away unrenormalised. Rows from `out_length` on are 0
    (per-sample sizes under one `out_size`). All of start, length, out_length are (n,);
    length <= in_size.
    """
    start, length, out_length = (
        v.to(torch.float32).view(-1, 1, 1) for v in (start, length, out_length)
    )
    scale = length / out_length
    support = scale.clamp(min=1.0)
    centre = scale * (
        torch.arange(out_size, device=start.device, dtype=torch.float32).view(1, -1, 1) + 0.5
    )

    def tri(q: torch.Tensor) -> torch.Tensor:
        weight = (1.0 - ((q + 0.5 - centre) / support).abs()).clamp(min=0.0)
        return weight * ((q >= 0) & (q < length))

    pixels = torch.arange(in_size, device=start.device, dtype=torch.float32).view(1, 1, -1)
    # The weights over the whole span, black pixels included: positions 0 .. length - 1 of
    # the span (length <= in_size), whatever part of the axis they fall on.
    total = tri(pixels).sum(-1, keepdim=True)
    rows = torch.arange(out_size, device=start.device).view(1, -1, 1) < out_length
    return tri(pixels - start) / total.clamp(min=1e-12) * rows


def _linear_map(x: torch.Tensor, a_y: torch.Tensor, a_x: torch.Tensor) -> torch.Tensor:
    """(n, C, H', W') = a_y (n, H', H) @ x (n, C, H, W) @ a_x^T (n, W, W')."""
    return a_y.unsqueeze(1) @ x @ a_x.unsqueeze(1).transpose(-1, -2)


def _low_res(x: torch.Tensor, sizes: torch.Tensor, host_sizes: list) -> torch.Tensor:
    """Each sample down to its (h, w) of `sizes` and up again: one (H, H) and one (W, W) map."""
    n, _, height, width = x.shape
    max_h = max(h for h, _ in host_sizes)
    max_w = max(w for _, w in host_sizes)
    zeros = torch.zeros_like(sizes[:, 0])
    full_h = torch.full_like(sizes[:, 0], height)
    full_w = torch.full_like(sizes[:, 0], width)
    down_y = interpolation_matrix(zeros, full_h, sizes[:, 0], max_h, height)  # (n, h, H)
    down_x = interpolation_matrix(zeros, full_w, sizes[:, 1], max_w, width)
    up_y = interpolation_matrix(zeros, sizes[:, 0], full_h, height, max_h)  # (n, H, h)
    up_x = interpolation_matrix(zeros, sizes[:, 1], full_w, width, max_w)
    return _linear_map(x, up_y @ down_y, up_x @ down_x)


def _colour(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast, saturation as torchvision blends them, factors (n, 3)."""
    brightness, contrast, saturation = (factors[:, k].view(-1, 1, 1, 1) for k in range(3))
    x = (x * brightness).clamp(0.0, 1.0)
    mean = _luma(x).mean(dim=(-3, -2, -1), keepdim=True)
    x = (x * contrast + mean * (1.0 - contrast)).clamp(0.0, 1.0)
    return (x * saturation + _luma(x) * (1.0 - saturation)).clamp(0.0, 1.0)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """(n, 1, H, W) luma of (n, 3, H, W) RGB."""
    r, g, b = x.unbind(dim=-3)
    return r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(-3)


def _blur(x: torch.Tensor, kernel: int, sigmas: torch.Tensor) -> torch.Tensor:
    """Gaussian blur of side `kernel`, sigma per sample (n,), reflect-padded: two grouped 1-D
    convolutions over the n x C planes."""
    n, channels, height, width = x.shape
    half = (kernel - 1) / 2
    taps = torch.linspace(-half, half, kernel, device=x.device)
    weights = torch.exp(-0.5 * (taps.view(1, -1) / sigmas.view(-1, 1)) ** 2)
    weights = (weights / weights.sum(-1, keepdim=True)).repeat_interleave(channels, dim=0)
    pad = kernel // 2
    planes = F.pad(x, (pad, pad, pad, pad), mode="reflect").reshape(
        1, n * channels, *[s + 2 * pad for s in (height, width)]
    )
    planes = F.conv2d(planes, weights.view(-1, 1, kernel, 1), groups=n * channels)
    planes = F.conv2d(planes, weights.view(-1, 1, 1, kernel), groups=n * channels)
    return planes.view(n, channels, height, width)


def _box_mask(boxes: list, height: int, width: int, device: torch.device) -> torch.Tensor:
    """(n, 1, H, W) bool: True inside each sample's (top, left, h, w) box."""
    b = _host(boxes, device).view(-1, 4, 1, 1)
    rows = torch.arange(height, device=device).view(1, -1, 1)
    cols = torch.arange(width, device=device).view(1, 1, -1)
    inside = (
        (rows >= b[:, 0])
        & (rows < b[:, 0] + b[:, 2])
        & (cols >= b[:, 1])
        & (cols < b[:, 1] + b[:, 3])
    )
    return inside.unsqueeze(1)


def _at(
    x: torch.Tensor, members: list[int], op: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`x` with `op` applied to the samples `members` (all of them without indexing)."""
    if len(members) == len(x):
        return op(x)
    index = _host(members, x.device)
    return x.index_copy(0, index, op(x.index_select(0, index)))


def _host(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (host numbers) as a tensor on `device`, copied without waiting."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
