"""Five-point face alignment: a similarity transform onto the standard 112x112 template.

Coordinates follow the convention of the published landmark files and template: pixel
(column i, row j) has its centre at (i, j), so the image spans [-0.5, W - 0.5]. The
transform is the least-squares similarity (rotation, uniform scale, translation; no
reflection) from the five detected points to the template's, in closed form from the
points' cross-covariance (Umeyama, 1991); the warp is PIL's bilinear affine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

# The five points of an aligned 112x112 face, in image coordinates (x right, y down): the
# eye on the image's left, the other eye, the nose tip, the mouth corner on the image's
# left, the other corner. The points every ArcFace-style model is trained on.
ARCFACE_TEMPLATE = np.array(
    [
        [38.2946, 51.6963],
        [73.5318, 51.5014],
        [56.0252, 71.7366],
        [41.5493, 92.3655],
        [70.7299, 92.2041],
    ],
    dtype=np.float64,
)
TEMPLATE_SIZE = 112


def template_points(size: int | Sequence[int]) -> np.ndarray:
    """The template's five points (5, 2) for an aligned square of side ``size``.

    The template is scaled about the image's corner at (-0.5, -0.5), so that a smaller or
    larger square holds the same face filling the same fraction. ``size`` is an int or
    (H, W) with H == W; raises ValueError for a non-square size, which a similarity
    transform cannot fill the way the template does.
    """
    if not isinstance(size, int):
        height, width = size
        if height != width:
            raise ValueError(
                f"image_size: five-point alignment makes square faces, got {height}x{width}"
            )
        size = int(height)
    if size < 1:
        raise ValueError(f"image_size: must be positive, got {size}")
    return (ARCFACE_TEMPLATE + 0.5) * (size / TEMPLATE_SIZE) - 0.5


def estimate_similarity(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The similarity (2, 3) matrix M minimising sum |M @ [s, 1] - t|^2 over point pairs.

    ``source`` and ``target`` are (K, 2) points, K >= 2. The rotation comes from the SVD of
    their cross-covariance, with the smallest singular direction flipped when the best
    orthogonal map would be a reflection; the scale is then the one that best fits the
    centred points. Raises ValueError when the shapes differ or the source points coincide
    or are not finite.
    """
    source = np.asarray(source, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if source.ndim != 2 or source.shape[1] != 2 or source.shape != target.shape:
        raise ValueError(
            f"points: expected two (K, 2) arrays of equal shape, got {source.shape} and "
            f"{target.shape}"
        )
    if len(source) < 2 or not (np.isfinite(source).all() and np.isfinite(target).all()):
        raise ValueError("points: need at least two finite point pairs")
    source_mean, target_mean = source.mean(axis=0), target.mean(axis=0)
    centred_source, centred_target = source - source_mean, target - target_mean
    source_variance = float(np.sum(centred_source**2)) / len(source)
    if source_variance <= 1e-12:
        raise ValueError("points: the source points coincide; no similarity fits them")
    covariance = centred_target.T @ centred_source / len(source)  # (2, 2)
    u, singular, vt = np.linalg.svd(covariance)
    # A rotation, never a mirror: a flipped face is another face.
    sign = np.ones(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[-1] = -1.0
    rotation = u @ np.diag(sign) @ vt
    scale = float(np.sum(singular * sign)) / source_variance
    matrix = np.empty((2, 3))
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = target_mean - scale * rotation @ source_mean
    return matrix


def warp_affine(image: Image.Image, matrix: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """``image`` resampled (bilinear) so that input point p lands on output point M @ [p, 1].

    ``matrix`` is (2, 3) in the pixel-centre convention of this module; ``size`` is the
    output (H, W). Outside the input the output is black.
    """
    forward = np.vstack([np.asarray(matrix, dtype=np.float64), [0.0, 0.0, 1.0]])
    inverse = np.linalg.inv(forward)  # output point -> input point
    # PIL asks for the output-to-input map in coordinates whose pixel centres sit at +0.5:
    # shift into our convention on the way in and back on the way out.
    shift = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [0.0, 0.0, 1.0]])
    unshift = np.array([[1.0, 0.0, -0.5], [0.0, 1.0, -0.5], [0.0, 0.0, 1.0]])
    coefficients = (shift @ inverse @ unshift)[:2].ravel()
    height, width = size
    return image.transform(
        (width, height),
        Image.Transform.AFFINE,
        tuple(float(c) for c in coefficients),
        resample=Image.Resampling.BILINEAR,
        fillcolor=(0, 0, 0) if image.mode == "RGB" else None,
    )


def align_face(image: Image.Image, landmarks: np.ndarray, size: int | Sequence[int]) -> Image.Image:
    """The face of ``image`` warped onto the template: a ``size`` square (int or (S, S)).

    ``landmarks`` (5, 2) are the detected points in the template's order (eye on the
    image's left, other eye, nose tip, mouth corner on the left, other corner).
    """
    target = template_points(size)
    side = int(size) if isinstance(size, int) else int(size[0])
    matrix = estimate_similarity(np.asarray(landmarks, dtype=np.float64).reshape(5, 2), target)
    return warp_affine(image, matrix, (side, side))
