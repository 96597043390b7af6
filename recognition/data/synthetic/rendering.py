"""Rendering one image of an identity: its template under a random pose, on a cluttered
background, with lighting, colour cast, blur and sensor noise (the per-image nuisances)."""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image, ImageDraw

from recognition.data.synthetic.drawing import TEMPLATE_OVERSAMPLING

# Per-image nuisance strengths, tuned so that raw-pixel matching does poorly (see the package
# docstring) while a small CNN still learns the identities; the face stays fully visible.
MAX_ROTATION_DEG = 18.0
SCALE_RANGE = (0.85, 1.15)
MAX_SHIFT = 0.10  # of the image side
SQUEEZE_RANGE = (0.88, 1.0)  # horizontal squeeze, a cheap stand-in for yaw
MAX_LIGHT_GRADIENT = 0.45  # the light falls from 1 + g to 1 - g corner to corner
BRIGHTNESS_RANGE = (0.75, 1.25)
CONTRAST_RANGE = (0.75, 1.25)
MAX_COLOUR_CAST = 0.1
BLUR_PROBABILITY = 0.5
BLUR_CENTRE_WEIGHT = (1.0, 4.0)  # of the separable [1, w, 1] kernel of `_blur_rows`
NOISE_RANGE = (2.0, 10.0)  # standard deviation, 8-bit levels
NOISE_FIELD_MARGIN = 32  # pixels of offset range for the per-image noise crops
JPEG_QUALITY_RANGE = (70, 95)


@functools.lru_cache(maxsize=8)
def _ramp(size: int) -> np.ndarray:
    """(size,) float32 values from -0.5 to 0.5, cached (np.linspace is slow for its work)."""
    ramp = np.linspace(-0.5, 0.5, size, dtype=np.float32)
    ramp.flags.writeable = False
    return ramp


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    """A random cluttered RGB background: a colour gradient and 6 to 13 random shapes."""
    # A bilinear blend of four random corner colours, computed as (H, W * 3) rows (see the
    # note on row layout in `render_image`).
    corners = rng.uniform(0.0, 255.0, size=(2, 2, 3)).astype(np.float32)  # (top/bottom, l/r, 3)
    t = _ramp(size) + np.float32(0.5)  # (size,) from 0 to 1
    rows = corners[:, :1, :] + (corners[:, 1:, :] - corners[:, :1, :]) * t[None, :, None]
    top, bottom = rows.reshape(2, size * 3)  # (W * 3,) each
    array = top[None, :] + (bottom - top)[None, :] * t[:, None]  # (H, W * 3)
    image = Image.fromarray(array.astype(np.uint8).reshape(size, size, 3), "RGB")
    draw = ImageDraw.Draw(image)
    # All the shapes' random numbers in one call: per-call overhead dominates at this size.
    num_shapes = int(rng.integers(6, 14))
    colours = rng.integers(0, 256, size=(num_shapes, 3)).tolist()
    kinds = rng.integers(0, 3, size=num_shapes).tolist()
    corners = rng.uniform(-0.2, 1.0, size=(num_shapes, 2)) * size
    extents = rng.uniform(0.05, 0.5, size=(num_shapes, 2)) * size
    boxes = np.concatenate([corners, corners + extents], axis=1).tolist()  # x0, y0, x1, y1
    line_width = max(1, size // 30)
    for colour, kind, box in zip(colours, kinds, boxes, strict=True):
        if kind == 0:
            draw.ellipse(box, fill=tuple(colour))
        elif kind == 1:
            draw.rectangle(box, fill=tuple(colour))
        else:
            draw.line(box, fill=tuple(colour), width=line_width)
    return image


def _blur_rows(array: np.ndarray, centre: float, channels: int) -> np.ndarray:
    """`array` (H, W * channels) blurred by the separable 3 x 3 kernel [1, centre, 1] / sum.

    Edge pixels count themselves in place of their missing neighbour. A fixed-size kernel
    with a random centre weight varies the strength (1 is a box blur, larger is milder) at a
    third of the cost of PIL's filters on an image this small.
    """
    out = array * np.float32(centre)
    out[:, channels:] += array[:, :-channels]  # left neighbour
    out[:, :-channels] += array[:, channels:]  # right neighbour
    out[:, :channels] += array[:, :channels]
    out[:, -channels:] += array[:, -channels:]
    blurred = out * np.float32(centre)
    blurred[1:] += out[:-1]  # neighbour above
    blurred[:-1] += out[1:]  # neighbour below
    blurred[0] += out[0]
    blurred[-1] += out[-1]
    blurred *= np.float32(1.0 / (centre + 2.0) ** 2)
    return blurred


def render_image(
    template: Image.Image, noise: np.ndarray, rng: np.random.Generator, size: int
) -> Image.Image:
    """One RGB image of side `size`: `template` under a random pose, background and lighting.

    `template` is the identity's face in "RGBa" mode (colour premultiplied by alpha), of
    side `size * TEMPLATE_OVERSAMPLING`; `noise` is a float32 (N, N, 3) field of unit
    Gaussian noise with N >= size.
    """
    # Pose: the output pixel (x, y) samples the template at A @ (x, y) + b (PIL's convention:
    # the affine maps output to input coordinates), so A is the inverse of the forward pose.
    angle = math.radians(rng.uniform(-MAX_ROTATION_DEG, MAX_ROTATION_DEG))
    scale = math.exp(rng.uniform(math.log(SCALE_RANGE[0]), math.log(SCALE_RANGE[1])))
    squeeze = rng.uniform(*SQUEEZE_RANGE)
    shift = rng.uniform(-MAX_SHIFT, MAX_SHIFT, size=2) * size
    forward = np.array(
        [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]]
    ) @ np.diag([scale * squeeze, scale])
    # The face is resampled at TEMPLATE_OVERSAMPLING times the output size with nearest
    # neighbour and then box-averaged down: anti-aliased like bilinear sampling, at a tenth of
    # the cost of PIL's bilinear affine.
    work_size = size * TEMPLATE_OVERSAMPLING
    inverse = np.linalg.inv(forward) * (template.size[0] / work_size)
    centre_out = (np.array([size / 2.0, size / 2.0]) + shift) * TEMPLATE_OVERSAMPLING
    centre_in = np.array(template.size, dtype=np.float64) / 2.0
    offset = centre_in - inverse @ centre_out
    coefficients = (*inverse[0], offset[0], *inverse[1], offset[1])
    face = template.transform(
        (work_size, work_size),
        Image.Transform.AFFINE,
        coefficients,
        resample=Image.Resampling.NEAREST,
    ).reduce(TEMPLATE_OVERSAMPLING)

    # reduce() averaged premultiplied colours, so the edges blend right; paste() wants them
    # straight.
    image = _background(rng, size)
    face = face.convert("RGBA")
    image.paste(face, (0, 0), face)

    # Lighting: a directional gradient, contrast, brightness and a colour cast, applied as one
    # per-pixel gain and offset: (x * light - mean) * contrast + mean, times the channel gain.
    # The pixels are viewed as (H, W * 3) rows so that every numpy loop runs along a whole
    # row: broadcasting over a last axis of length 3 is ten times slower.
    array = np.asarray(image, dtype=np.float32).reshape(size, size * 3)
    light_angle = rng.uniform(0.0, 2.0 * np.pi)
    light_strength = 2.0 * rng.uniform(0.0, MAX_LIGHT_GRADIENT)
    contrast = rng.uniform(*CONTRAST_RANGE)
    gain = rng.uniform(*BRIGHTNESS_RANGE) * (
        1.0 + rng.uniform(-MAX_COLOUR_CAST, MAX_COLOUR_CAST, size=3)
    )  # (3,)
    ramp = _ramp(size)
    ramp_x = np.repeat(ramp, 3) * np.float32(light_strength * math.cos(light_angle) * 0.7071)
    ramp_y = ramp * np.float32(light_strength * math.sin(light_angle) * 0.7071)
    row_gain = np.tile((contrast * gain).astype(np.float32), size)  # (W * 3,)
    row_offset = np.tile((float(array.mean()) * (1.0 - contrast) * gain).astype(np.float32), size)
    array *= (1.0 + ramp_x[None, :] + ramp_y[:, None]) * row_gain  # (H, W * 3)
    array += row_offset
    # Defocus blur on half of the images, before the sensor noise.
    if rng.random() < BLUR_PROBABILITY:
        array = _blur_rows(array, rng.uniform(*BLUR_CENTRE_WEIGHT), channels=3)
    # Noise: a crop at a random place of the identity's noise field.
    y0, x0 = rng.integers(0, noise.shape[0] - size + 1, size=2)
    sigma = np.float32(rng.uniform(*NOISE_RANGE))
    array += noise[y0 : y0 + size, x0 : x0 + size].reshape(size, size * 3) * sigma
    np.clip(array, 0, 255, out=array)
    return Image.fromarray(array.astype(np.uint8).reshape(size, size, 3), "RGB")
