"""insightface verification sets (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin``) without mxnet.

A ``.bin`` is a pickle of ``(bins, issame)``: ``bins`` holds 2N encoded images (JPEG or PNG
bytes), pair i being images 2i and 2i+1; ``issame`` holds N booleans. The files were written
by Python 2 (``bins`` then are ``str``) or Python 3 (``bytes``; sometimes 1-D uint8 numpy
arrays), ``issame`` as a list of bools or a numpy bool array.

Such a file comes from elsewhere, and ``pickle.load`` on it would run whatever callable the
file names. :func:`load_bin` therefore unpickles with :class:`RestrictedUnpickler`, which
resolves only the handful of globals these files need (numpy's array and dtype
reconstructors, ``_codecs.encode`` for bytes pickled by Python 3 at protocol 2) and refuses
every other one before anything is called: :class:`UnsafePickleError` names the file and the
global.
"""

from __future__ import annotations

import codecs
import io
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from recognition.config import image_size_pair
from recognition.data.transforms import center_crop, decode_rgb, to_input_tensor


class UnsafePickleError(ValueError):
    """A pickle names a global outside the allowed set; nothing of it was executed."""


def _checked_dtype(*args: Any) -> np.dtype:
    dtype = np.dtype(*args)
    # Object arrays would hold arbitrary Python objects; no .bin has any.
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"object dtype {dtype} is not allowed")
    return dtype


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(latin-1 text, "latin1").
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError(f"_codecs.encode only with latin1 text, got {encoding!r}")
    return text.encode("latin1")


def _checked(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, refusing any argument that is a dtype holding Python objects."""

    def call(*args: Any) -> Any:
        for arg in args:
            if isinstance(arg, np.dtype) and arg.hasobject:
                raise pickle.UnpicklingError(f"object dtype {arg} is not allowed")
        return function(*args)

    return call


# Taken from numpy's own pickles instead of imported by name: numpy 1 calls the module
# numpy.core, numpy 2 numpy._core, and both names must map onto the installed one.
_RECONSTRUCT = np.zeros(1).__reduce__()[0]
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]
_SCALAR = np.bool_(True).__reduce__()[0]

_ALLOWED: dict[tuple[str, str], Any] = {("_codecs", "encode"): _latin1_encode}
for _module in ("numpy", "numpy.core", "numpy._core"):
    _ALLOWED[(_module, "ndarray")] = np.ndarray
    _ALLOWED[(_module, "dtype")] = _checked_dtype
    for _sub in ("multiarray", "numeric"):
        _ALLOWED[(f"{_module}.{_sub}", "_reconstruct")] = _checked(_RECONSTRUCT)
        _ALLOWED[(f"{_module}.{_sub}", "scalar")] = _checked(_SCALAR)
        _ALLOWED[(f"{_module}.{_sub}", "_frombuffer")] = _checked(_FROMBUFFER)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals an insightface ``.bin`` needs.

    ``source`` names the file in the error. Every global (GLOBAL, STACK_GLOBAL, INST, OBJ
    and the extension-registry opcodes all go through :meth:`find_class`) outside the
    allowed set raises :class:`UnsafePickleError` before it is called; persistent ids are
    refused by :class:`pickle.Unpickler` itself.
    """

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        # latin1 maps Python 2 str byte-for-byte onto text (turned back into bytes below) and
        # is what numpy needs to read arrays pickled by Python 2.
        super().__init__(file, encoding="latin1")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise UnsafePickleError(
                f"{self.source}: refusing to unpickle global '{module}.{name}': an insightface "
                ".bin holds only encoded images and booleans, so this file is either not such "
                "a file or crafted to run code; nothing from it was executed"
            )
        return allowed


@dataclass(frozen=True)
class BinPairs:
    """An insightface verification set: ``images`` (2N encoded images), ``issame`` (N,) bool.

    Pair i is ``images[2 * i]`` and ``images[2 * i + 1]``.
    """

    images: list[bytes]
    issame: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.issame)


def load_bin(path: str | os.PathLike) -> BinPairs:
    """Read an insightface ``.bin`` safely (see :class:`RestrictedUnpickler`).

    Returns the pairs. Raises FileNotFoundError for a missing file, UnsafePickleError for a
    pickle that names any global outside the allowed set, and ValueError naming the file for
    anything else that is not ``(bins, issame)`` with ``len(bins) == 2 * len(issame)``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f".bin file not found: {path}")
    with open(path, "rb") as f:
        try:
            data = RestrictedUnpickler(f, str(path)).load()
        except UnsafePickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
            raise ValueError(f"{path}: not a readable insightface .bin pickle: {e}") from e
    if not isinstance(data, tuple | list) or len(data) != 2:
        raise ValueError(
            f"{path}: expected a pickled (bins, issame) pair, got {type(data).__name__}"
        )
    bins, issame = data
    if not isinstance(bins, list | tuple):
        raise ValueError(
            f"{path}: bins must be a list of encoded images, got {type(bins).__name__}"
        )
    images = [_as_bytes(item, path, i) for i, item in enumerate(bins)]
    issame_array = _as_bools(issame, path)
    if len(images) != 2 * len(issame_array):
        raise ValueError(
            f"{path}: {len(images)} images for {len(issame_array)} pairs; a .bin holds two "
            "images per pair"
        )
    if len(issame_array) == 0:
        raise ValueError(f"{path}: no pairs")
    return BinPairs(images=images, issame=issame_array, source=str(path))


def _as_bytes(item: Any, path: Path, index: int) -> bytes:
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str):
        return item.encode("latin1")  # a Python 2 str, decoded as latin1 by the unpickler
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim == 1:
        return item.tobytes()
    raise ValueError(
        f"{path}: bins[{index}] must be encoded image bytes, got {type(item).__name__}"
        + (f" {item.dtype} {item.shape}" if isinstance(item, np.ndarray) else "")
    )


def _as_bools(issame: Any, path: Path) -> np.ndarray:
    if isinstance(issame, np.ndarray):
        if issame.ndim != 1 or issame.dtype.kind not in "bui":
            raise ValueError(
                f"{path}: issame must be a 1-D bool array, got {issame.dtype} {issame.shape}"
            )
        values = issame
    elif isinstance(issame, list | tuple):
        if not all(isinstance(v, bool | int | np.bool_ | np.integer) for v in issame):
            raise ValueError(f"{path}: issame must hold booleans")
        values = np.asarray(issame)
    else:
        raise ValueError(f"{path}: issame must be a list of booleans, got {type(issame).__name__}")
    if values.size and not np.isin(values, (0, 1)).all():
        raise ValueError(f"{path}: issame must hold booleans (0/1)")
    return values.astype(bool).reshape(-1)


def decode_image(
    data: bytes, size: tuple[int, int], where: str, crop: int | None = None
) -> torch.Tensor:
    """Encoded image bytes as a (3, H, W) float32 input in [-1, 1] at `size` = (H, W), like
    training inputs.

    ``crop`` (pixels) takes a centre square of that side before resizing. Raises ValueError
    naming ``where`` when the bytes do not decode.
    """
    rgb = decode_rgb(data, where)
    if crop is not None:
        rgb = center_crop(rgb, crop)
    return to_input_tensor(rgb, size)


class BinDataset(Dataset):
    """The images of a :class:`BinPairs`, item i the (3, H, W) input tensor of image i.

    `size` is (H, W) or a square side (`size` then holds it as (H, W)).
    """

    def __init__(
        self, pairs: BinPairs, size: int | tuple[int, int] = 112, crop: int | None = None
    ) -> None:
        self.pairs = pairs
        self.size = image_size_pair(size)  # once, not per image
        self.crop = crop

    def __len__(self) -> int:
        return len(self.pairs.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        where = f"{self.pairs.source}: image {index}"
        return decode_image(self.pairs.images[index], self.size, where, self.crop)
