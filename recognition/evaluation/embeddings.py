"""Embedding extraction, ``.npz`` export (of any images, or of a whole folder:
`export_folder`) and verification of pairs from embeddings.

The embedding of an image is model(image) + model(horizontal flip of image), L2-normalised:
the flip sum is the usual test-time augmentation for faces, which are near-symmetric.
"""

from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from recognition.config import image_size_pair
from recognition.data.pairs import IMAGE_EXTENSIONS, Pairs
from recognition.data.transforms import center_crop, load_rgb, to_input_tensor
from recognition.data.workers import exit_with_parent
from recognition.evaluation.verification import balanced_folds, evaluate_verification

log = logging.getLogger(__name__)


def load_image(
    path: str | os.PathLike, size: int | tuple[int, int], crop: int | None = None
) -> torch.Tensor:
    """Read an image file as a (3, H, W) float32 tensor in [-1, 1].

    Exactly the training input transform (`recognition.data.transforms`): any PIL mode
    converted to RGB, resized to ``size`` = (H, W) (or a square side), x / 127.5 - 1. With
    ``crop``, the centred ``crop`` x ``crop`` square of the original is taken first (LFW's
    250x250 photos, whose face fills the centre). Raises FileNotFoundError for a missing file
    and ValueError naming the file when it cannot be decoded (a corrupt or truncated JPEG).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    image = load_rgb(path)
    if crop is not None:
        image = center_crop(image, crop)
    return to_input_tensor(image, image_size_pair(size))


class PathDataset(Dataset):
    """Images named by a list of paths, each loaded by :func:`load_image`.

    ``paths`` may be relative to ``root``. Item i is the (3, H, W) tensor of ``paths[i]``,
    centre-cropped to ``crop`` pixels first when given.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        size: int | tuple[int, int] = (112, 112),
        root: str | os.PathLike | None = None,
        crop: int | None = None,
    ) -> None:
        self.paths = [str(p) for p in paths]
        self.size = size
        self.root = Path(root) if root is not None else None
        self.crop = crop

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        path = self.paths[index]
        full = self.root / path if self.root is not None else path
        return load_image(full, self.size, self.crop)


@dataclass(frozen=True)
class Extraction:
    """How a backbone's embeddings are computed: batch size, flip-summing, device, loader
    workers and progress bar. Calling it runs `extract_embeddings` with these settings."""

    batch_size: int = 128
    flip: bool = True
    device: torch.device | None = None
    num_workers: int = 0
    progress: bool = True

    def __call__(
        self, model: nn.Module, images: Dataset, **options: bool
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        return extract_embeddings(
            model,
            images,
            batch_size=self.batch_size,
            flip=self.flip,
            device=self.device or torch.device("cpu"),
            num_workers=self.num_workers,
            progress=self.progress,
            **options,
        )


DEFAULT_EXTRACTION = Extraction()


def extract_embeddings(
    model: nn.Module,
    images: DataLoader | Dataset,
    *,
    batch_size: int = 64,
    flip: bool = True,
    device: torch.device | str | None = None,
    num_workers: int = 0,
    progress: bool = True,
    return_norms: bool = False,
    normalize: bool = True,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Embeddings (N, D) float32, L2-normalised, of every image, in dataset order.

    With ``normalize=False`` the rows are the raw outputs (flip summed), whose norms
    protocols that pool several images per subject use as weights.

    With ``return_norms`` also returns the L2 norm (N,) of the model's raw output for each
    (unflipped) image; their mean is the "XNorm" that insightface reports, a sign of how
    confident a margin-trained model is.

    ``images`` is a Dataset (or a DataLoader over one, whose own batch size and workers are
    then used) of (3, H, W) tensors already normalised like training inputs, or of tuples
    whose first element is that tensor (labels are ignored). The model is put in eval mode
    for the pass and its previous mode restored after; with ``device`` it is moved there
    (``Module.to`` acts in place), otherwise images go to the device of its parameters.
    Inputs are cast to the model's floating dtype, so a half-precision model works too.
    """
    if device is not None:
        model.to(device)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device(device or "cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    loader = _loader(images, batch_size, num_workers, device)

    was_training = model.training
    model.eval()
    chunks: list[torch.Tensor] = []
    norm_chunks: list[torch.Tensor] = []
    total = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
    bar = tqdm(total=total, desc="embeddings", unit="image", disable=not progress)
    try:
        with torch.no_grad():
            for batch in loader:
                x = _input_batch(batch).to(device, dtype=dtype, non_blocking=True)
                out, norms = _embed(model, x, flip)
                norm_chunks.append(norms.cpu())
                chunks.append((F.normalize(out, dim=1) if normalize else out).cpu())
                bar.update(len(out))
    finally:
        bar.close()
        model.train(was_training)
    if not chunks:
        raise ValueError("images: the dataset is empty")
    embeddings = torch.cat(chunks).numpy().astype(np.float32, copy=False)
    if return_norms:
        return embeddings, torch.cat(norm_chunks).numpy().astype(np.float32, copy=False)
    return embeddings


def _loader(
    images: DataLoader | Dataset, batch_size: int, num_workers: int, device: torch.device
) -> DataLoader:
    """``images`` itself when it is a DataLoader, else an ordered DataLoader over it."""
    if isinstance(images, DataLoader):
        return images
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    return DataLoader(
        images,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=exit_with_parent if num_workers > 0 else None,
    )


def _input_batch(batch: object) -> torch.Tensor:
    """The (B, C, H, W) images of a loader's batch (the first element of a tuple)."""
    if isinstance(batch, list | tuple):
        batch = batch[0]
    if not isinstance(batch, torch.Tensor) or batch.ndim != 4:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else None
        raise ValueError(
            "images: expected batches of (B, C, H, W) tensors, got "
            f"{type(batch).__name__} with shape {shape}"
        )
    return batch


def _embed(model: nn.Module, x: torch.Tensor, flip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw embeddings (B, D) float32, flip-summed with ``flip``; norms (B,) of the
    unflipped images' outputs) of the batch ``x`` (B, C, H, W)."""
    num_images = x.shape[0]
    if flip:
        # One forward over image and mirror: in eval mode BatchNorm uses its
        # running statistics, so the batch composition does not matter.
        x = torch.cat([x, torch.flip(x, dims=[3])])  # (2B, C, H, W)
    out = model(x)
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != len(x):
        raise ValueError(
            f"model: expected a ({len(x)}, D) embedding tensor, got "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)}"
        )
    out = out.float()
    norms = out[:num_images].norm(dim=1)
    if flip:
        out = out[:num_images] + out[num_images:]  # (B, D)
    return out, norms


def save_embeddings(path: str | os.PathLike, embeddings: np.ndarray, paths: Sequence[str]) -> None:
    """Write ``embeddings`` (N, D) as float32 and their image ``paths`` (N,) to an ``.npz``.

    The keys are ``embeddings`` and ``paths``; the file is replaced atomically and its
    folder created. Raises ValueError when the shapes disagree.
    """
    embeddings = np.asarray(embeddings)
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings: expected an (N, D) array, got shape {embeddings.shape}")
    if not np.issubdtype(embeddings.dtype, np.floating):
        raise ValueError(f"embeddings: expected floats, got dtype {embeddings.dtype}")
    paths_array = np.asarray([str(p) for p in paths], dtype=str)
    if paths_array.shape != (embeddings.shape[0],):
        raise ValueError(f"paths: {len(paths_array)} paths for {embeddings.shape[0]} embeddings")
    write_npz(Path(path), embeddings=embeddings.astype(np.float32), paths=paths_array)


def write_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write ``arrays`` to the ``.npz`` file ``path`` atomically (its folder created): a
    temporary file in the same folder, then a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # Through a file object: given a name, np.savez would append ".npz" to the temp name.
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_npz(path: Path, what: str) -> np.lib.npyio.NpzFile:
    """`path` opened as an .npz archive without pickle (a file from elsewhere must not be
    able to run code here); a ValueError naming the file and `what` it should be otherwise."""
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic.startswith(b"PK"):
            data = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable {what} (.npz): {e}") from e
    if magic == b"\x93NUMPY":
        raise ValueError(f"{path}: expected an .npz {what}, found a single .npy array")
    if not magic.startswith(b"PK"):
        # Checked before np.load, which takes any other bytes for a pickle and tells how to
        # load it unsafely: advice that must not reach a user holding a foreign file.
        raise ValueError(f"{path}: not a {what} (.npz): not a zip archive")
    return data


def load_embeddings(path: str | os.PathLike) -> tuple[np.ndarray, list[str]]:
    """Read an ``.npz`` written by :func:`save_embeddings`: (embeddings (N, D) float32, paths).

    Raises FileNotFoundError for a missing file and ValueError naming the file when it is
    not an ``.npz``, lacks a key, or its arrays have the wrong shapes.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"embeddings file not found: {path}")
    with open_npz(path, "embeddings file") as data:
        missing = [k for k in ("embeddings", "paths") if k not in data.files]
        if missing:
            raise ValueError(
                f"{path}: missing key(s) {missing}; expected 'embeddings' (N x D) and "
                f"'paths' (N), found {data.files}"
            )
        try:
            embeddings = data["embeddings"]
            paths = data["paths"]
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            # Object arrays (they need pickle) and damaged members both land here.
            raise ValueError(f"{path}: cannot read its arrays: {e}") from e
    if embeddings.ndim != 2 or not np.issubdtype(embeddings.dtype, np.floating):
        raise ValueError(
            f"{path}: 'embeddings' must be an (N, D) float array, got shape "
            f"{embeddings.shape} dtype {embeddings.dtype}"
        )
    if paths.shape != (embeddings.shape[0],) or paths.dtype.kind not in "US":
        raise ValueError(
            f"{path}: 'paths' must be {embeddings.shape[0]} strings (one per embedding), got "
            f"shape {paths.shape} dtype {paths.dtype}"
        )
    bad = ~np.isfinite(embeddings).all(axis=1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{path}: {int(bad.sum())} embedding(s) hold NaN or inf, the first row {first} "
            f"({str(paths[first])!r})"
        )
    return embeddings.astype(np.float32, copy=False), [str(p) for p in paths]


def index_paths(paths: Sequence[str]) -> dict[str, int]:
    """{path: row} for embeddings stored in the order of ``paths``; duplicates are an error."""
    index: dict[str, int] = {}
    for i, p in enumerate(paths):
        if p in index:
            raise ValueError(f"paths: {p!r} appears twice (rows {index[p]} and {i})")
        index[p] = i
    return index


def pair_scores(embeddings: np.ndarray, index: Mapping[str, int], pairs: Pairs) -> np.ndarray:
    """Cosine similarity (P,) float64 of each pair's two embeddings.

    A path missing from ``index`` is looked up again without its extension (embeddings
    exported from .png images still match a pairs file read as .jpg). Raises ValueError
    naming the pairs file and line of the first pair whose image has no embedding.
    """
    embeddings = np.asarray(embeddings, dtype=np.float64)
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings: expected an (N, D) array, got shape {embeddings.shape}")
    by_stem: dict[str, int | None] | None = None

    def row(p: str, i: int) -> int:
        nonlocal by_stem
        if p in index:
            return index[p]
        if by_stem is None:
            by_stem = {}
            for q, r in index.items():
                stem = os.path.splitext(q)[0]
                # An ambiguous stem (a.jpg and a.png) must not silently pick one.
                by_stem[stem] = None if stem in by_stem else r
        r = by_stem.get(os.path.splitext(p)[0])
        if r is None:
            raise ValueError(f"{pairs.location(i)}: no embedding for image {p!r}")
        return r

    left = np.array([row(p, i) for i, p in enumerate(pairs.left)], dtype=np.int64)
    right = np.array([row(p, i) for i, p in enumerate(pairs.right)], dtype=np.int64)
    if len(left) and max(left.max(), right.max()) >= len(embeddings):
        raise ValueError(f"index: row out of range for {len(embeddings)} embeddings")
    # Normalise again: stored embeddings may come from elsewhere, unnormalised.
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    return np.einsum("pd,pd->p", unit[left], unit[right])


def verify_pairs(
    embeddings: np.ndarray,
    index: Mapping[str, int],
    pairs: Pairs,
    num_folds: int = 10,
    far_targets: Sequence[float] | None = None,
) -> dict:
    """Verification metrics of ``pairs`` from precomputed embeddings.

    ``index`` maps each image path (as the pairs name it) to its row of ``embeddings``
    (N, D). Scores are cosine similarities; the folds are the file's own, except that a
    one-fold file (pairsDevTest.txt) is split by :func:`balanced_folds` into ``num_folds``.
    Returns :func:`evaluate_verification`'s dict.
    """
    scores = pair_scores(embeddings, index, pairs)
    if pairs.num_folds > 1:
        folds = pairs.fold
    else:
        folds = balanced_folds(pairs.issame, num_folds)
    kwargs = {} if far_targets is None else {"far_targets": far_targets}
    return evaluate_verification(scores, pairs.issame, folds=folds, **kwargs)


def list_images(root: Path) -> list[str]:
    """Every image file under ``root`` (recursively), relative to it, sorted; POSIX separators."""
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    suffixes = {e.lower() for e in IMAGE_EXTENSIONS}
    paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in suffixes
    )
    if not paths:
        raise ValueError(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)}) found")
    return paths


def export_folder(
    backbone: nn.Module,
    root: Path,
    out: Path,
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    crop: int | None = None,
) -> int:
    """Embed every image under ``root`` and write ``out`` (.npz: embeddings, relative paths).

    Returns the number of images.
    """
    paths = list_images(root)
    embeddings = extraction(backbone, PathDataset(paths, size=image_size, root=root, crop=crop))
    save_embeddings(out, embeddings, paths)
    log.info("wrote %d embeddings to %s", len(paths), out)
    return len(paths)
