"""The names a config gives its parts, and where each part's code is: the one table a new
margin, backbone, data format or evaluation protocol is added to (docs/extending.md).

Names only. An entry holds its code's import path ("package.module:attribute") as text, so
the config checks a name when it loads without importing torch, and the code is imported
when the part is built (`load`). Each table is a plain dict read when it is used: an entry
added at run time (`MARGINS["mine"] = Entry(...)`, before the config loads) counts as one
written here. The config's checks, `--show-config`, docs/configuration.md and the builders
all read these tables and nothing else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    """One name of a table: its code, what it is in a few words (listed in the reference),
    and what its table needs besides (see each table)."""

    code: str
    """"package.module:attribute", imported when the part is built."""
    about: str
    """A few words for docs/configuration.md (after the name, in brackets)."""
    keys: tuple[str, ...] = ()
    """MARGINS: the `head.*` values the margin takes besides `head.scale` (its constructor's
    keyword arguments of the same names; `scale` is passed as `s`). PROTOCOLS: the metrics
    the protocol reports. BACKBONES: ("width",) for a backbone of fixed widths, which takes
    model.width=1 only."""
    marker: tuple[str, ...] = ()
    """FORMATS: what `data.root` holds when it is this format (data.format=auto): the first
    path names the format, the others must be there beside it."""


MARGINS: dict[str, Entry] = {
    "arcface": Entry("recognition.heads.margins:ArcFace", "cos(theta + m)", ("m",)),
    "cosface": Entry("recognition.heads.margins:CosFace", "cos(theta) - m", ("m",)),
    "sphereface": Entry("recognition.heads.margins:SphereFace", "cos(m theta)", ("m",)),
    "am_softmax": Entry("recognition.heads.margins:AMSoftmax", "cos(theta) - m", ("m",)),
    "combined": Entry(
        "recognition.heads.margins:CombinedMargin", "cos(m1 theta + m2) - m3", ("m1", "m2", "m3")
    ),
    "adaface": Entry("recognition.heads.margins:AdaFace", "norm-adaptive", ("m", "h", "t_alpha")),
}
"""`head.margin`: a `recognition.heads.margins.Margin` subclass, called with `s` (head.scale)
and the `keys` that are set (unset ones take the class's defaults)."""

BACKBONES: dict[str, Entry] = {
    **{
        f"iresnet{depth}": Entry(f"recognition.models.iresnet:iresnet{depth}", "faces")
        for depth in (18, 34, 50, 100, 200)
    },
    **{
        name: Entry(f"recognition.models.mobilefacenet:{name}", "faces, MobileFaceNet")
        for name in ("mbf", "mbf_large")
    },
    **{
        name: Entry(f"recognition.models.vit:{name}", "faces, ViT")
        for name in ("vit_t", "vit_s", "vit_b", "vit_l", "vit_h")
    },
    "resnet50_reid": Entry(
        "recognition.models.resnet:resnet50_reid", "torchvision's, re-id", ("width",)
    ),
}
"""`model.backbone`: a function (or class) called with the keyword arguments
`embedding_size`, `width`, `dropout` and `image_size` ((H, W)) that returns the module
(images (B, 3, H, W) in, embeddings (B, embedding_size) out)."""

FORMATS: dict[str, Entry] = {
    "recordio": Entry(
        "recognition.data.recordio:RecordIODataset",
        "insightface train.rec + train.idx",
        marker=("train.rec", "train.idx"),
    ),
    "market1501": Entry(
        "recognition.data.market_train:Market1501TrainDataset",
        "bounding_box_train/",
        marker=("bounding_box_train",),
    ),
    "msmt17": Entry(
        "recognition.data.market_train:msmt17_train_dataset",
        "MSMT17 release, list_train.txt",
        marker=("list_train.txt",),
    ),
    "cuhk03": Entry(
        "recognition.data.market_train:cuhk03_train_dataset",
        "CUHK03 new protocol, cuhk03_new_protocol_config_*.mat",
        marker=("cuhk03_new_protocol_config_*.mat",),
    ),
    "folder": Entry(
        "recognition.data.image_folder:ImageFolderDataset", "one sub-folder per identity"
    ),
}
"""`data.format`: a `recognition.data.source.TrainSource` (or a function making one) called
with `root`, `image_size` ((H, W)) and the keyword `on_bad_image` (cuhk03 also
`cuhk03_boxes`; folder, whose cached index the ranks share, is built by
`recognition.data.build`). data.format=auto takes the first format whose `marker` data.root
holds (a name, or a glob pattern that some file matches), else folder."""

VERIFICATION_METRICS = ("accuracy", "auc", "eer", "xnorm", "tar@far=")

PROTOCOLS: dict[str, Entry] = {
    "pairs": Entry(
        "recognition.evaluation.protocols.verification:PairsVerification",
        "LFW-style pairs file",
        VERIFICATION_METRICS,
    ),
    "bin": Entry(
        "recognition.evaluation.protocols.verification:BinVerification",
        "insightface .bin",
        VERIFICATION_METRICS,
    ),
    "ijb": Entry(
        "recognition.evaluation.protocols.ijb:IJB",
        "IJB-B/C 1:1 or 1:N",
        ("auc", "tar@far=", "rank1", "rank5", "rank10", "tpir@fpir="),
    ),
    "reid": Entry(
        "recognition.evaluation.protocols.reid:ReID",
        "re-id ranking: Market-1501, MSMT17, CUHK03",
        ("mAP", "mINP", "rank1", "rank5", "rank10"),
    ),
}
"""Evaluation protocols, by the `eval.targets[i]` key that names their input (an
`EvalTarget` field of the same name): a `recognition.evaluation.protocols.Protocol`
subclass, called with the target. `keys`: the metrics it reports, as `eval.best_metric`
names them (one ending in `=` takes a rate after it: tar@far=1e-4)."""


def names(table: dict[str, Entry]) -> str:
    """The names of `table`, comma-separated, in its order."""
    return ", ".join(table)


def load(table: dict[str, Entry], name: str, key: str) -> Any:
    """The code of `table[name]` (imported now). Raises ValueError naming the config `key`
    for a name the table lacks, ImportError naming the entry for code that is not there."""
    if name not in table:
        raise ValueError(f"{key}: unknown {name!r} (choose from {names(table)})")
    return load_code(table[name].code, f"{key}={name}")


def code_problem(code: str) -> str | None:
    """What is wrong with the spelling of `code` ("package.module:attribute"), or None."""
    module, colon, attribute = code.partition(":")
    parts = [*module.split("."), attribute]
    if not colon or not all(part.isidentifier() for part in parts):
        return f"{code!r} is not package.module:attribute"
    return None


def load_code(code: str, key: str) -> Any:
    """The attribute that `code` ("package.module:attribute") names, imported now. Raises
    ImportError naming `key` when the module or the attribute is not there."""
    if (problem := code_problem(code)) is not None:
        raise ImportError(f"{key}: {problem}")
    module, _, attribute = code.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:
        raise ImportError(f"{key}: no module {exc.name!r} (for {code})") from None
    except AttributeError:
        raise ImportError(f"{key}: {module} has no {attribute!r}") from None
