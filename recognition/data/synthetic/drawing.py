"""Drawing the synthetic identities: an identity's random shape and colour parameters, and its
face drawn front-on as an RGBA template (the five landmarks where it draws them).

All geometry is in "face units": the template canvas is 1 x 1, and the face sits around
(0.5, 0.5) filling about two thirds of it, as in aligned 112 x 112 face crops. A change here
changes the images: bump `GENERATOR_VERSION` (recognition.config.synthetic) so that data sets
drawn before it are regenerated.
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
from PIL import Image, ImageDraw

from recognition.data.synthetic.layout import FACES_STREAM

# The template is drawn, and each image's face resampled, at twice the output size and then
# averaged down, which anti-aliases the polygon edges that PIL draws without anti-aliasing.
TEMPLATE_OVERSAMPLING = 2


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


def sample_identity(rng: np.random.Generator) -> dict:
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


def render_template(p: dict, size: int) -> Image.Image:
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
    the image's left, the other corner (where `render_template` draws them)."""
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
    params = sample_identity(np.random.default_rng([seed, FACES_STREAM, index]))
    image = render_template(params, size * TEMPLATE_OVERSAMPLING).reduce(TEMPLATE_OVERSAMPLING)
    return image, face_landmarks(params) * size - 0.5
