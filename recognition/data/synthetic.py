"""A built-in synthetic face data set, generated on first use, for the default run and tests.

Every identity is a procedural face drawn from a few dozen random shape parameters (face
outline, jaw, hairline and hair style, ears, eyes, brows, nose, mouth, beard, glasses and a
few distinctive marks). Every image of an identity re-draws that template under strong
nuisance variation: rotation, scale, translation, a yaw-like horizontal squeeze, a random
cluttered background, a lighting gradient, brightness / contrast / colour cast, blur,
noise and JPEG compression. The nuisances are strong enough that matching raw pixels does
poorly (`recognition.evaluation.synthetic_baseline`: about 67% on the default set's
pairs), while the identity
lives in the shapes of the face, which a small CNN learns in two minutes on two CPU cores
(about 97% on the same pairs).

Layout written under `root` (the same layout as a real image-folder training set plus
LFW-style verification data, so that the rest of the code sees no difference):

    root/train/id_00000/0.jpg ...                    training identities (ImageFolder)
    root/val/person_0000/person_0000_0001.jpg ...    held-out identities (LFW layout)
    root/val/pairs.txt                               LFW View-2 pairs over the val identities
    root/.generating                                 written first, removed at the end
    root/.complete                                   written last: the SyntheticSpec as JSON

The spec (`SyntheticSpec`, `GENERATOR_VERSION`) lives in `recognition.config.synthetic`, with
the config section that describes it, and is re-exported here.

The output depends only on the spec (seed included): every identity and image draws from
its own `numpy.random.Generator` seeded by (seed, split, identity, image), so the files are
byte-identical whatever the number of worker processes.
"""

from __future__ import annotations

import argparse
import colorsys
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# The spec lives with the config that describes it; re-exported here for the generator's callers.
from recognition.config.synthetic import GENERATOR_VERSION, SyntheticSpec  # noqa: F401
from recognition.data.pairs import write_pairs

logger = logging.getLogger(__name__)

TRAIN_DIR = "train"
VAL_DIR = "val"
PAIRS_FILE = "pairs.txt"
COMPLETE_MARKER = ".complete"
GENERATING_MARKER = ".generating"

# Seed-sequence tags that keep the random streams of the splits and the pairs apart.
_TRAIN_STREAM = 0
_VAL_STREAM = 1
_PAIRS_STREAM = 2
_FACES_STREAM = 3


def train_identity_name(index: int) -> str:
    """Folder name of training identity `index`."""
    return f"id_{index:05d}"


def val_identity_name(index: int) -> str:
    """Folder name (and file-name prefix) of held-out identity `index`."""
    return f"person_{index:04d}"


# ---------------------------------------------------------------------------------------------
# Drawing. All geometry is in "face units": the template canvas is 1 x 1, and the face sits
# around (0.5, 0.5) filling about two thirds of it, as in aligned 112 x 112 face crops.
# ---------------------------------------------------------------------------------------------


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[int, int, int]:
    """An (h, s, v) colour with components in [0, 1] as 8-bit RGB."""
    r, g, b = colorsys.hsv_to_rgb(h, s, v)
    return int(r * 255), int(g * 255), int(b * 255)


def _shade(colour: tuple[int, int, int], factor: float) -> tuple[int, int, int]:
    """`colour` scaled by `factor` and clipped to 8 bits (darker below 1, lighter above)."""
    return tuple(int(min(255, max(0, c * factor))) for c in colour)  # type: ignore[return-value]


def _ellipse_points(
    cx: float, cy: float, rx: float, ry: float, angle: float, num_points: int = 24
) -> list[tuple[float, float]]:
    """Outline of an ellipse centred at (cx, cy), radii (rx, ry), rotated by `angle` radians."""
    t = np.linspace(0.0, 2.0 * np.pi, num_points, endpoint=False)
    x, y = rx * np.cos(t), ry * np.sin(t)
    c, s = math.cos(angle), math.sin(angle)
    return list(zip((cx + c * x - s * y).tolist(), (cy + s * x + c * y).tolist(), strict=True))


def _sample_identity(rng: np.random.Generator) -> dict:
    """Random shape and colour parameters of one identity (face units, see above)."""
    u = rng.uniform
    skin = _hsv_to_rgb(u(0.0, 0.12), u(0.15, 0.65), u(0.35, 0.95))
    hair_choices = [
        _hsv_to_rgb(u(0.02, 0.12), u(0.3, 0.8), u(0.05, 0.35)),  # dark brown / black
        _hsv_to_rgb(u(0.08, 0.15), u(0.3, 0.7), u(0.55, 0.9)),  # blond
        _hsv_to_rgb(u(0.0, 0.05), u(0.5, 0.9), u(0.4, 0.7)),  # red
        _hsv_to_rgb(0.0, 0.0, u(0.5, 0.85)),  # grey
        _hsv_to_rgb(u(0.0, 1.0), u(0.4, 0.9), u(0.3, 0.9)),  # dyed, any hue
    ]
    hair = hair_choices[int(rng.choice(5, p=[0.45, 0.2, 0.1, 0.1, 0.15]))]
    identity = {
        "skin": skin,
        "hair": hair,
        # Face outline: a superellipse whose lower half narrows towards the chin.
        "face_rx": u(0.24, 0.34),
        "face_ry": u(0.30, 0.40),
        "face_cy": u(0.50, 0.56),
        "face_power": u(1.7, 3.2),
        "chin_taper": u(0.0, 0.45),
        # Hair: style 0 bald, 1 short crop, 2 long down the sides, 3 fringe, 4 tall top.
        "hair_style": int(rng.choice(5, p=[0.05, 0.3, 0.25, 0.25, 0.15])),
        "hairline": u(0.22, 0.40),
        "hair_harmonics": u(-1.0, 1.0, size=(4, 2)) * np.array([[0.05], [0.03], [0.02], [0.015]]),
        "hair_volume": u(0.02, 0.10),
        "hair_length": u(0.55, 0.85),
        "part": u(-0.5, 0.5),
        "ear_size": u(0.04, 0.08),
        "ear_y": u(0.45, 0.55),
        # Eyes and brows.
        "eye_y": u(0.40, 0.50),
        "eye_dx": u(0.08, 0.14),
        "eye_rx": u(0.035, 0.065),
        "eye_aspect": u(0.3, 0.75),
        "eye_tilt": u(-0.25, 0.25),
        "iris": _hsv_to_rgb(u(0.0, 1.0), u(0.3, 0.9), u(0.2, 0.7)),
        "iris_scale": u(0.45, 0.8),
        "brow_gap": u(0.04, 0.09),
        "brow_len": u(0.8, 1.6),
        "brow_thick": u(0.010, 0.030),
        "brow_tilt": u(-0.35, 0.35),
        "brow_arch": u(-0.015, 0.03),
        # Nose.
        "nose_len": u(0.08, 0.17),
        "nose_width": u(0.03, 0.08),
        "nose_shape": int(rng.integers(3)),
        # Mouth.
        "mouth_y": u(0.66, 0.78),
        "mouth_w": u(0.06, 0.15),
        "mouth_curve": u(-0.035, 0.045),
        "lip_thick": u(0.008, 0.03),
        "lip": _hsv_to_rgb(u(0.95, 1.05) % 1.0, u(0.3, 0.7), u(0.4, 0.8)),
        # Facial hair, glasses and marks (each identity gets its own set).
        "beard": int(rng.choice(4, p=[0.55, 0.15, 0.15, 0.15])),  # none, moustache, goatee, full
        "glasses": int(rng.choice(3, p=[0.7, 0.15, 0.15])),  # none, round, rectangular
        "glasses_colour": _hsv_to_rgb(u(0.0, 1.0), u(0.0, 0.8), u(0.0, 0.6)),
        "marks": [
            (u(-0.8, 0.8), u(-0.6, 0.8), u(0.012, 0.03), u(0.3, 0.8))
            for _ in range(int(rng.integers(0, 4)))
        ],
        "cheek_patch": bool(rng.random() < 0.3),
        "cheek_side": float(rng.choice([-1.0, 1.0])),
        # A birthmark: an irregular blob large enough to survive downscaling to 48 x 48.
        "birthmark": (
            {
                "x": u(-0.7, 0.7),
                "y": u(-0.5, 0.7),
                "radius": u(0.025, 0.06),
                "shape": u(0.5, 1.0, size=int(rng.integers(5, 9))),
                "angle": u(0.0, 2.0 * np.pi),
                "colour": _hsv_to_rgb(u(0.9, 1.1) % 1.0, u(0.3, 0.8), u(0.2, 0.6)),
            }
            if rng.random() < 0.5
            else None
        ),
    }
    return identity


def _face_outline(p: dict, num_points: int = 64) -> np.ndarray:
    """(num_points, 2) outline of the face: a superellipse with a tapered chin."""
    t = np.linspace(0.0, 2.0 * np.pi, num_points, endpoint=False)
    c, s = np.cos(t), np.sin(t)
    exponent = 2.0 / p["face_power"]
    x = p["face_rx"] * np.sign(c) * np.abs(c) ** exponent
    y = p["face_ry"] * np.sign(s) * np.abs(s) ** exponent
    # Narrow the lower half (y > 0 is down) towards the chin.
    x = x * (1.0 - p["chin_taper"] * np.clip(y / p["face_ry"], 0.0, 1.0) ** 2)
    return np.stack([0.5 + x, p["face_cy"] + y], axis=1)


class _Canvas:
    """An RGBA image of side `size` and its drawing context; coordinates are fractions."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
        self.draw = ImageDraw.Draw(self.image)

    def pts(self, points: np.ndarray | list) -> list[tuple[float, float]]:
        return [(float(x) * self.size, float(y) * self.size) for x, y in points]

    def width(self, w: float) -> int:
        return max(1, round(w * self.size))


def _render_template(p: dict, size: int) -> Image.Image:
    """Draw identity `p` as an RGBA image of side `size` (transparent outside the head).

    Back to front: hair behind the head, ears and face, the hairline over the forehead,
    eyes and brows, nose, mouth and facial hair, marks, glasses.
    """
    c = _Canvas(size)
    for step in (
        _draw_back_hair,
        _draw_face,
        _draw_hairline,
        _draw_eyes,
        _draw_nose,
        _draw_mouth,
        _draw_marks,
        _draw_glasses,
    ):
        step(c, p)
    return c.image


def _draw_back_hair(c: _Canvas, p: dict) -> None:
    """Hair behind and on top of the head, before the face covers its lower part."""
    hair, top, style = p["hair"], p["face_cy"] - p["face_ry"], p["hair_style"]
    # Hair behind the head (long styles) and on top of it, drawn before the face so that the
    # face covers its lower part; the hairline is a random smooth curve.
    if style == 2:
        back = _ellipse_points(
            0.5,
            p["face_cy"] + 0.05,
            p["face_rx"] + 0.06,
            p["hair_length"] - p["face_cy"] + 0.35,
            0.0,
        )
        back = [(x, min(y, p["hair_length"] + 0.15)) for x, y in back]
        c.draw.polygon(c.pts(back), fill=hair)
    if style in (1, 2, 3, 4):
        extra = p["hair_volume"] + (0.08 if style == 4 else 0.0)
        c.draw.ellipse(
            c.pts(
                [
                    (0.5 - p["face_rx"] - p["hair_volume"] * 0.6, top - extra),
                    (0.5 + p["face_rx"] + p["hair_volume"] * 0.6, top + 2 * p["face_ry"] * 0.55),
                ]
            ),
            fill=hair,
        )


def _draw_face(c: _Canvas, p: dict) -> None:
    """Ears, the face outline and an optional cheek patch."""
    skin, face = p["skin"], _face_outline(p)
    # Ears, then the face.
    for side in (-1.0, 1.0):
        ex = 0.5 + side * (p["face_rx"] * 0.97)
        c.draw.ellipse(
            c.pts(
                [
                    (ex - p["ear_size"] * 0.5, p["ear_y"] - p["ear_size"]),
                    (ex + p["ear_size"] * 0.5, p["ear_y"] + p["ear_size"]),
                ]
            ),
            fill=_shade(skin, 0.9),
        )
    c.draw.polygon(c.pts(face), fill=skin)
    if p["cheek_patch"]:
        cx = 0.5 + p["cheek_side"] * p["face_rx"] * 0.55
        c.draw.ellipse(
            c.pts([(cx - 0.06, p["mouth_y"] - 0.12), (cx + 0.06, p["mouth_y"] - 0.03)]),
            fill=_shade(skin, 0.8),
        )


def _draw_hairline(c: _Canvas, p: dict) -> None:
    """Hair over the forehead, above a random smooth hairline."""
    hair, top, style = p["hair"], p["face_cy"] - p["face_ry"], p["hair_style"]
    # Hair over the forehead: everything above the hairline curve, inside the hair mass.
    if style in (1, 2, 3, 4):
        xs = np.linspace(0.5 - p["face_rx"] - 0.02, 0.5 + p["face_rx"] + 0.02, 33)
        rel = (xs - 0.5) / p["face_rx"]
        line = np.full_like(xs, p["hairline"])
        for k, (a, b) in enumerate(p["hair_harmonics"], start=1):
            line += a * np.cos(k * np.pi * (rel + p["part"])) + b * np.sin(k * np.pi * rel)
        if style == 3:  # a fringe: lower in the middle
            line += 0.06 * (1.0 - rel**2)
        # The sides come down to the ears.
        line = line + 0.12 * np.clip(np.abs(rel) - 0.7, 0.0, None) / 0.3
        line = np.maximum(line, top + 0.02)
        polygon = [(xs[0], top - 0.2), *zip(xs, line, strict=True), (xs[-1], top - 0.2)]
        mask = Image.new("L", (c.size, c.size), 0)
        ImageDraw.Draw(mask).polygon(c.pts(polygon), fill=255)
        hair_mass = Image.new("L", (c.size, c.size), 0)
        ImageDraw.Draw(hair_mass).ellipse(
            c.pts(
                [
                    (0.5 - p["face_rx"] - p["hair_volume"], top - p["hair_volume"] - 0.1),
                    (0.5 + p["face_rx"] + p["hair_volume"], top + 2 * p["face_ry"]),
                ]
            ),
            fill=255,
        )
        mask = Image.fromarray(np.minimum(np.asarray(mask), np.asarray(hair_mass)))
        c.image.paste(Image.new("RGBA", (c.size, c.size), (*hair, 255)), (0, 0), mask)


def _draw_eyes(c: _Canvas, p: dict) -> None:
    """Eyes and brows, mirrored per side."""
    hair = p["hair"]
    # Eyes: sclera, iris, pupil, all tilted by the same angle per side (mirrored).
    for side in (-1.0, 1.0):
        cx, cy = 0.5 + side * p["eye_dx"], p["eye_y"]
        rx, ry = p["eye_rx"], p["eye_rx"] * p["eye_aspect"]
        tilt = side * p["eye_tilt"]
        c.draw.polygon(c.pts(_ellipse_points(cx, cy, rx, ry, tilt)), fill=(240, 240, 235))
        r_iris = min(ry * 0.95, rx * p["iris_scale"])
        c.draw.ellipse(
            c.pts([(cx - r_iris, cy - r_iris), (cx + r_iris, cy + r_iris)]), fill=p["iris"]
        )
        r_pupil = r_iris * 0.45
        c.draw.ellipse(c.pts([(cx - r_pupil, cy - r_pupil), (cx + r_pupil, cy + r_pupil)]), fill=0)
        c.draw.line(c.pts(_ellipse_points(cx, cy, rx, ry, tilt, 24)[12:] + [(cx + rx, cy)]), fill=0)

        # Brow: an arched polyline above the eye.
        by = cy - ry - p["brow_gap"]
        half = rx * p["brow_len"]
        xs = np.linspace(-half, half, 7)
        ys = -p["brow_arch"] * (1.0 - (xs / half) ** 2) + side * p["brow_tilt"] * xs * 0.3
        brow = [(cx + x, by + y) for x, y in zip(xs, ys, strict=True)]
        c.draw.line(
            c.pts(brow), fill=_shade(hair, 0.7), width=c.width(p["brow_thick"]), joint="curve"
        )


def _draw_nose(c: _Canvas, p: dict) -> None:
    """A shaded nose with nostrils, in one of three shapes."""
    skin = p["skin"]
    # Nose: a shaded wedge with nostrils, in one of three shapes.
    ny0 = p["eye_y"] + 0.02
    ny1 = ny0 + p["nose_len"]
    nw = p["nose_width"]
    dark = _shade(skin, 0.72)
    if p["nose_shape"] == 0:
        c.draw.polygon(
            c.pts([(0.5, ny0), (0.5 + nw, ny1), (0.5 - nw, ny1)]), fill=_shade(skin, 0.88)
        )
    elif p["nose_shape"] == 1:
        c.draw.line(
            c.pts([(0.5 - nw * 0.3, ny0), (0.5 - nw * 0.5, ny1)]), fill=dark, width=c.width(0.01)
        )
        c.draw.line(c.pts([(0.5 - nw, ny1), (0.5 + nw, ny1)]), fill=dark, width=c.width(0.012))
    else:
        c.draw.ellipse(
            c.pts([(0.5 - nw, ny1 - nw), (0.5 + nw, ny1 + nw * 0.5)]), fill=_shade(skin, 1.1)
        )
    for side in (-1.0, 1.0):
        nx = 0.5 + side * nw * 0.55
        r = nw * 0.25
        c.draw.ellipse(c.pts([(nx - r, ny1 - r * 0.5), (nx + r, ny1 + r * 0.5)]), fill=dark)


def _draw_mouth(c: _Canvas, p: dict) -> None:
    """Lips, then facial hair."""
    hair, face = p["hair"], _face_outline(p)
    # Mouth: two curved lips.
    my, mw, curve = p["mouth_y"], p["mouth_w"], p["mouth_curve"]
    xs = np.linspace(-mw, mw, 9)
    mid = my - curve * (1.0 - (xs / mw) ** 2) + curve
    upper = [(0.5 + x, y - p["lip_thick"]) for x, y in zip(xs, mid, strict=True)]
    lower = [(0.5 + x, y + p["lip_thick"] * 1.3) for x, y in zip(xs[::-1], mid[::-1], strict=True)]
    c.draw.polygon(c.pts(upper + lower), fill=p["lip"])
    c.draw.line(c.pts(list(zip(0.5 + xs, mid, strict=True))), fill=_shade(p["lip"], 0.5), width=1)

    # Facial hair.
    beard = p["beard"]
    beard_colour = _shade(hair, 0.85)
    if beard in (1, 3):
        c.draw.polygon(
            c.pts(
                [
                    (0.5 - mw * 1.1, my - p["lip_thick"] * 0.5),
                    (0.5 - mw * 0.8, my - p["lip_thick"] - 0.035),
                    (0.5 + mw * 0.8, my - p["lip_thick"] - 0.035),
                    (0.5 + mw * 1.1, my - p["lip_thick"] * 0.5),
                ]
            ),
            fill=beard_colour,
        )
    if beard == 2:
        chin = p["face_cy"] + p["face_ry"]
        c.draw.polygon(
            c.pts([(0.5 - mw * 0.6, my + 0.035), (0.5 + mw * 0.6, my + 0.035), (0.5, chin + 0.02)]),
            fill=beard_colour,
        )
    if beard == 3:
        jaw = face[(face[:, 1] > my - 0.02)]
        jaw = jaw[np.argsort(np.arctan2(jaw[:, 1] - p["face_cy"], jaw[:, 0] - 0.5))]
        c.draw.polygon(
            c.pts([*jaw, (0.5 + mw, my + 0.04), (0.5 - mw, my + 0.04)]), fill=beard_colour
        )


def _draw_marks(c: _Canvas, p: dict) -> None:
    """Moles and the birthmark."""
    skin = p["skin"]
    # Distinctive marks: moles of identity-specific size, darkness and place.
    for mark_x, mark_y, radius, darkness in p["marks"]:
        x = 0.5 + mark_x * p["face_rx"] * 0.8
        y = p["face_cy"] + mark_y * p["face_ry"] * 0.8
        c.draw.ellipse(
            c.pts([(x - radius, y - radius), (x + radius, y + radius)]),
            fill=_shade(skin, 1.0 - darkness),
        )

    # The birthmark: an irregular polygon, a star-shaped blob around its centre.
    mark = p["birthmark"]
    if mark is not None:
        angles = mark["angle"] + np.linspace(0.0, 2.0 * np.pi, len(mark["shape"]), endpoint=False)
        radii = mark["radius"] * mark["shape"]
        x = 0.5 + mark["x"] * p["face_rx"] * 0.8 + radii * np.cos(angles)
        y = p["face_cy"] + mark["y"] * p["face_ry"] * 0.8 + radii * np.sin(angles)
        c.draw.polygon(c.pts(np.stack([x, y], axis=1)), fill=mark["colour"])


def _draw_glasses(c: _Canvas, p: dict) -> None:
    """Glasses on top of everything."""
    # Glasses on top of everything.
    if p["glasses"]:
        frame = p["glasses_colour"]
        r = p["eye_rx"] * 1.5
        for side in (-1.0, 1.0):
            cx = 0.5 + side * p["eye_dx"]
            box = c.pts([(cx - r, p["eye_y"] - r * 0.8), (cx + r, p["eye_y"] + r * 0.8)])
            if p["glasses"] == 1:
                c.draw.ellipse(box, outline=frame, width=c.width(0.012))
            else:
                c.draw.rectangle(box, outline=frame, width=c.width(0.012))
        inner = p["eye_dx"] - r
        c.draw.line(
            c.pts([(0.5 - inner, p["eye_y"]), (0.5 + inner, p["eye_y"])]),
            fill=frame,
            width=c.width(0.012),
        )


def face_landmarks(p: dict) -> np.ndarray:
    """The five landmarks (5, 2) of identity `p` in face units, in the order of aligned-face
    templates: the eye on the image's left, the other eye, the nose tip, the mouth corner on
    the image's left, the other corner (where `_render_template` draws them)."""
    nose_y = p["eye_y"] + 0.02 + p["nose_len"]
    mouth_y = p["mouth_y"] + p["mouth_curve"]  # the lips' midline at the corners
    return np.array(
        [
            [0.5 - p["eye_dx"], p["eye_y"]],
            [0.5 + p["eye_dx"], p["eye_y"]],
            [0.5, nose_y],
            [0.5 - p["mouth_w"], mouth_y],
            [0.5 + p["mouth_w"], mouth_y],
        ]
    )


def draw_face(seed: int, index: int, size: int) -> tuple[Image.Image, np.ndarray]:
    """Face `index` of its own stream (disjoint from the train and val identities of `seed`),
    front-on and centred: (RGBA image of side `size`, transparent around the head; its five
    landmarks (5, 2) in pixels, pixel centres at integers, in `face_landmarks` order)."""
    params = _sample_identity(np.random.default_rng([seed, _FACES_STREAM, index]))
    image = _render_template(params, size * TEMPLATE_OVERSAMPLING).reduce(TEMPLATE_OVERSAMPLING)
    return image, face_landmarks(params) * size - 0.5


@functools.lru_cache(maxsize=8)
def _ramp(size: int) -> np.ndarray:
    """(size,) float32 values from -0.5 to 0.5, cached (np.linspace is slow for its work)."""
    ramp = np.linspace(-0.5, 0.5, size, dtype=np.float32)
    ramp.flags.writeable = False
    return ramp


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    """A random cluttered RGB background: a colour gradient and 6 to 13 random shapes."""
    # A bilinear blend of four random corner colours, computed as (H, W * 3) rows (see the
    # note on row layout in `_render_image`).
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


# Per-image nuisance strengths, tuned so that raw-pixel matching does poorly (see the module
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
# The template is drawn, and each image's face resampled, at twice the output size and then
# averaged down, which anti-aliases the polygon edges that PIL draws without anti-aliasing.
TEMPLATE_OVERSAMPLING = 2


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


def _render_image(
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


def _generate_identity(
    root: str, split: str, index: int, num_images: int, size: int, seed: int
) -> None:
    """Draw identity `index` of `split` ("train" or "val") and write its `num_images` JPEGs."""
    stream = _TRAIN_STREAM if split == TRAIN_DIR else _VAL_STREAM
    params = _sample_identity(np.random.default_rng([seed, stream, index]))
    template = _render_template(params, size * TEMPLATE_OVERSAMPLING).convert("RGBa")
    noise_rng = np.random.default_rng([seed, stream, index, 0])
    # Each image crops its noise from this field at a random offset: shifted crops of one
    # field are as good as fresh noise for a nuisance, and much cheaper than drawing it.
    margin = NOISE_FIELD_MARGIN
    noise = noise_rng.standard_normal((size + margin, size + margin, 3), dtype=np.float32)
    if split == TRAIN_DIR:
        name = train_identity_name(index)
        folder = Path(root) / TRAIN_DIR / name
        file_names = [f"{n}.jpg" for n in range(num_images)]
    else:
        name = val_identity_name(index)
        folder = Path(root) / VAL_DIR / name
        file_names = [f"{name}_{n + 1:04d}.jpg" for n in range(num_images)]
    folder.mkdir(parents=True, exist_ok=True)
    for n, file_name in enumerate(file_names):
        rng = np.random.default_rng([seed, stream, index, n + 1])
        image = _render_image(template, noise, rng, size)
        quality = int(rng.integers(JPEG_QUALITY_RANGE[0], JPEG_QUALITY_RANGE[1] + 1))
        image.save(folder / file_name, format="JPEG", quality=quality)


def _generate_identity_star(args: tuple) -> None:
    """`_generate_identity(*args)`, for `ProcessPoolExecutor.map`."""
    _generate_identity(*args)


def make_pairs(
    spec: SyntheticSpec,
) -> list[tuple[list[tuple[str, int, int]], list[tuple[str, int, str, int]]]]:
    """The verification pairs of `spec`'s held-out identities, fold by fold.

    Returns one (same, different) tuple per fold: `same` holds (name, n1, n2) and `different`
    holds (name1, n1, name2, n2), with image numbers 1-based as in LFW. Folds use disjoint
    sets of identities (as LFW View 2 does), and no pair repeats within a fold.
    """
    rng = np.random.default_rng([spec.seed, _PAIRS_STREAM])
    order = rng.permutation(spec.num_val_identities)
    num_images = spec.val_images_per_identity
    folds = []
    for fold_ids in np.array_split(order, spec.num_folds):
        fold_ids = sorted(int(i) for i in fold_ids)
        same: set[tuple[str, int, int]] = set()
        different: set[tuple[str, int, str, int]] = set()
        # Rejection sampling; __post_init__ checked that enough distinct pairs exist, and the
        # defaults use a small fraction of them, so this ends quickly.
        while len(same) < spec.pairs_per_fold:
            identity = int(rng.choice(fold_ids))
            n1, n2 = sorted(int(n) for n in rng.choice(num_images, size=2, replace=False) + 1)
            same.add((val_identity_name(identity), n1, n2))
        while len(different) < spec.pairs_per_fold:
            a, b = sorted(int(i) for i in rng.choice(fold_ids, size=2, replace=False))
            n1, n2 = (int(n) for n in rng.integers(1, num_images + 1, size=2))
            different.add((val_identity_name(a), n1, val_identity_name(b), n2))
        # Sets have no reproducible order across runs of differing hash seeds for str tuples,
        # so sort, then shuffle with the seeded generator.
        same_list = sorted(same)
        different_list = sorted(different)
        same_list = [same_list[i] for i in rng.permutation(len(same_list))]
        different_list = [different_list[i] for i in rng.permutation(len(different_list))]
        folds.append((same_list, different_list))
    return folds


def write_lfw_pairs(
    path: Path,
    folds: list[tuple[list[tuple[str, int, int]], list[tuple[str, int, str, int]]]],
) -> None:
    """Write `folds` (as returned by `make_pairs`) to `path` in LFW View-2 `pairs.txt` format.

    The first line is `num_folds<TAB>pairs_per_fold`; each fold then lists its same-identity
    lines `name<TAB>n1<TAB>n2` followed by its different-identity lines
    `name1<TAB>n1<TAB>name2<TAB>n2`.
    """
    write_pairs(path, folds)


def _read_marker(root: Path) -> dict | None:
    """The parsed `.complete` marker of `root`, or None when missing or unreadable."""
    try:
        return json.loads((root / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _default_num_workers() -> int:
    """Worker processes for generation: the CPUs this process may run on, at most 8."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(8, available))


def generate_synthetic_dataset(
    root: Path, spec: SyntheticSpec, num_workers: int | None = None
) -> None:
    """Write the data set of `spec` under `root` (see the module docstring for the layout).

    Writes `.generating` first and `.complete` (the spec as JSON) last, so that an interrupted
    run is recognised. `num_workers` processes draw identities in parallel (None: one per
    available CPU, at most 8; 1: in this process). The files do not depend on `num_workers`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / GENERATING_MARKER).write_text(json.dumps(spec.to_json()) + "\n")
    if num_workers is None:
        num_workers = _default_num_workers()
    jobs = [
        (str(root), TRAIN_DIR, i, spec.images_per_identity, spec.image_size, spec.seed)
        for i in range(spec.num_identities)
    ] + [
        (str(root), VAL_DIR, i, spec.val_images_per_identity, spec.image_size, spec.seed)
        for i in range(spec.num_val_identities)
    ]
    if num_workers <= 1:
        for job in jobs:
            _generate_identity(*job)
    else:
        with ProcessPoolExecutor(max_workers=num_workers) as pool:
            # chunksize amortises the inter-process round trips over several identities.
            list(pool.map(_generate_identity_star, jobs, chunksize=8))
    write_lfw_pairs(root / VAL_DIR / PAIRS_FILE, make_pairs(spec))
    (root / COMPLETE_MARKER).write_text(json.dumps(spec.to_json(), indent=2) + "\n")
    (root / GENERATING_MARKER).unlink()


def ensure_synthetic_dataset(
    root: Path, spec: SyntheticSpec | None = None, num_workers: int | None = None
) -> Path:
    """Make sure `root` holds the complete synthetic data set of `spec`, and return `root`.

    Does nothing when `root/.complete` records the same spec. Generates the data set when
    `root` is missing or empty, regenerates it when it is one this module started (an
    interrupted generation, or a complete one made with another spec or generator version),
    and raises a ValueError rather than touch a non-empty `root` that it did not write.
    `spec` defaults to `SyntheticSpec()`; `num_workers` is passed to
    `generate_synthetic_dataset`.
    """
    root = Path(root)
    spec = SyntheticSpec() if spec is None else spec
    if root.exists() and not root.is_dir():
        raise ValueError(f"synthetic data root {root} exists and is not a directory")
    marker = _read_marker(root)
    if marker == spec.to_json():
        return root
    ours = marker is not None or (root / GENERATING_MARKER).exists()
    if root.exists() and any(root.iterdir()) and not ours:
        raise ValueError(
            f"{root} is not empty and holds no synthetic data set ({COMPLETE_MARKER} is "
            "missing); refusing to write into it. Choose an empty or new directory for the "
            "synthetic data set."
        )
    if ours:
        reason = "an interrupted generation" if marker is None else "a different spec"
        logger.info("Regenerating synthetic data set in %s (found %s)", root, reason)
        # Remove only what this module writes: the marker proves that these are ours.
        (root / COMPLETE_MARKER).unlink(missing_ok=True)
        for name in (TRAIN_DIR, VAL_DIR):
            shutil.rmtree(root / name, ignore_errors=True)
    logger.info(
        "Generating synthetic data set in %s (%d train identities x %d images, "
        "%d val identities x %d images, %dx%d)",
        root,
        spec.num_identities,
        spec.images_per_identity,
        spec.num_val_identities,
        spec.val_images_per_identity,
        spec.image_size,
        spec.image_size,
    )
    start = time.perf_counter()
    generate_synthetic_dataset(root, spec, num_workers=num_workers)
    logger.debug("Generated %s in %.1f s", root, time.perf_counter() - start)
    return root


def main(argv: list[str] | None = None) -> None:
    """Command line: generate a synthetic data set (`python -m recognition.data.synthetic`)."""
    args, spec = parse_spec_arguments(argv)
    start = time.perf_counter()
    ensure_synthetic_dataset(args.out, spec, num_workers=args.workers)
    print(f"ready in {time.perf_counter() - start:.1f} s: {args.out}")


def parse_spec_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, SyntheticSpec]:
    """--out DIR, --workers N and one --<field> per SyntheticSpec field; returns the spec."""
    defaults = SyntheticSpec()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to generate into")
    for field in dataclasses.fields(SyntheticSpec):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=int, default=getattr(defaults, field.name)
        )
    parser.add_argument("--workers", type=int, default=None, help="worker processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = SyntheticSpec(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticSpec)}
    )
    return args, spec


if __name__ == "__main__":
    main()
