"""Export a trained backbone to ONNX, or as the state dict arcface_torch loads.

  python -m recognition.export --checkpoint runs/x/backbone.pt --onnx model.onnx
  python -m recognition.export --checkpoint runs/x/backbone.pt --arcface-torch backbone.pth

The graph takes ``images`` (B, 3, H, W) float32 at the checkpoint's input size (or
``--image-size N`` / ``HxW``), normalised like training inputs
(x / 127.5 - 1), and returns ``embeddings`` (B, D), not L2-normalised (normalise, and add
the mirrored image's embedding if wanted, in the application). The batch dimension is
dynamic. Needs the ``onnx`` and ``onnxscript`` packages (torch's exporter); with
``onnxruntime`` installed the export is checked against PyTorch on a random batch.

``--arcface-torch`` (IResNet, MobileFaceNet and ViT backbones) writes the plain fp32 state
dict that arcface_torch's ``get_model(name, num_features=D).load_state_dict`` takes: r18 ...
r200 by the depth, mbf, mbf_large, vit_t, vit_s, vit_b, vit_h, and for vit_l its
"vit_l_dp005_mask_005" (the layouts are the same). arcface_torch builds width-1 models for
112x112 faces only; a narrower or other-sized model is written too (with a warning), and
loads here (``evaluate.py --checkpoint``, ``train.init_backbone``) but not into get_model.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recognition.config import image_size_pair

log = logging.getLogger(__name__)

DEFAULT_OPSET = 18


def export_onnx(
    backbone: nn.Module,
    path: str | os.PathLike,
    image_size: int | tuple[int, int],
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Write ``backbone`` (put in eval mode, on the CPU, fp32) as an ONNX model to ``path``.

    The input is ``images`` (batch, 3, H, W) with ``image_size`` = (H, W) or a square side
    and a dynamic batch, the output ``embeddings`` (batch, D). The file is replaced
    atomically. Returns the path. Raises RuntimeError saying what to install when the
    exporter's packages are missing.
    """
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError as exc:
            raise RuntimeError(
                f"ONNX export needs the {package!r} package: pip install onnx onnxscript "
                "onnxruntime"
            ) from exc
    model = backbone.float().cpu().eval()
    example = torch.randn(2, 3, *image_size_pair(image_size))
    batch = torch.export.Dim("batch", min=1, max=65536)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.onnx.export(
            model,
            (example,),
            tmp,
            input_names=["images"],
            output_names=["embeddings"],
            # Positional, so it fits whatever the model's forward calls its argument.
            dynamic_shapes=({0: batch},),
            dynamo=True,
            opset_version=opset,
            # One self-contained file; models over 2 GB would need ONNX external data.
            external_data=False,
            verbose=False,
        )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_onnx(
    path: str | os.PathLike,
    backbone: nn.Module,
    image_size: int | tuple[int, int],
    batch_size: int = 3,
) -> float:
    """Largest absolute difference between ONNX Runtime (CPU) and PyTorch on a random batch.

    Raises ImportError when onnxruntime is not installed.
    """
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    height, width = image_size_pair(image_size)
    images = torch.randn(batch_size, 3, height, width, generator=torch.Generator())
    (onnx_out,) = session.run(["embeddings"], {"images": images.numpy()})
    with torch.no_grad():
        torch_out = backbone.float().cpu().eval()(images).numpy()
    return float(np.abs(onnx_out - torch_out).max())


def arcface_torch_name(backbone: nn.Module) -> tuple[str, bool]:
    """The name arcface_torch's ``get_model`` builds ``backbone`` under ("r50", "mbf",
    "vit_b", ...) and whether it builds this one: at width 1 for 112x112 inputs only."""
    from recognition.models import (
        IRESNET_LAYERS,
        MBF_LAYOUTS,
        VIT_SIZES,
        MobileFaceNet,
        VisionTransformer,
    )
    from recognition.models.iresnet import STEM_CHANNELS

    if isinstance(backbone, MobileFaceNet):
        name = next(n for n, layout in MBF_LAYOUTS.items() if layout == backbone.layout)
        published = backbone.width == 1.0
    elif isinstance(backbone, VisionTransformer):
        name = next(n for n, size in VIT_SIZES.items() if size == backbone.size)
        published = backbone.width == 1.0
        # get_model's vit_l is its WebFace42M entry.
        name = "vit_l_dp005_mask_005" if name == "vit_l" else name
    else:
        layers = tuple(len(getattr(backbone, f"layer{i}")) for i in range(1, 5))
        # get_model calls iresnet50 "r50".
        name = next(
            f"r{n.removeprefix('iresnet')}" for n, v in IRESNET_LAYERS.items() if v == layers
        )
        published = backbone.get_submodule("conv1").out_channels == STEM_CHANNELS
    return name, published and tuple(backbone.image_size) == (112, 112)


def export_arcface_torch(backbone: nn.Module, path: Path) -> None:
    """Write ``backbone``'s fp32 state dict (an IResNet, a MobileFaceNet or a ViT) to
    ``path`` (atomically), as arcface_torch's ``get_model(name).load_state_dict`` takes it;
    warn when its width or input size is one arcface_torch does not build. Raises
    ValueError for another backbone."""
    from recognition.checkpoint import atomic_save
    from recognition.checkpoint.foreign import arcface_torch_state

    state = arcface_torch_state(backbone)
    atomic_save(state, path)
    name, loads = arcface_torch_name(backbone)
    if loads:
        log.info(
            "wrote %s: get_model(%r, num_features=%d) loads it",
            path,
            name,
            backbone.embedding_size,
        )
        return
    height, width = backbone.image_size
    log.warning(
        "wrote %s: a %s narrower than published or for %dx%d inputs; arcface_torch builds "
        "its models at width 1 for 112x112 only, so its get_model will not take this file "
        "(this project reads it)",
        path,
        name,
        height,
        width,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recognition.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="backbone.pt or a checkpoint"
    )
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--onnx", type=Path, help="the ONNX file to write")
    out.add_argument(
        "--arcface-torch",
        type=Path,
        metavar="OUT.pth",
        help="write the backbone's state dict as arcface_torch saves and loads it",
    )
    parser.add_argument(
        "--image-size",
        metavar="N|HxW",
        help="input size, a square side or HxW such as 256x128 (default: the checkpoint's)",
    )
    parser.add_argument(
        "--opset", type=int, help=f"with --onnx: the ONNX opset (default: {DEFAULT_OPSET})"
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="with --onnx: skip the onnxruntime comparison with PyTorch",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Every problem of the flags at once, before the checkpoint is read.
    if problems := argument_problems(args):
        print("\n".join(f"error: {problem}" for problem in problems), file=sys.stderr)
        return 1
    return _export(args)


def argument_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the export's flags alone, a line each: the input size (N or HxW,
    as train.py's data.image_size and evaluate.py's --image-size take it), the flags that
    belong to --onnx, an output path that is a folder."""
    from recognition.config import ConfigError, parse_image_size

    problems = []
    if args.image_size is not None:
        try:
            parse_image_size(args.image_size, "--image-size")
        except ConfigError as exc:
            problems.append(str(exc))
    if args.arcface_torch is not None:
        onnx_only = [
            ("--image-size", args.image_size is not None),
            ("--opset", args.opset is not None),
            ("--no-check", args.no_check),
        ]
        problems += [
            f"{flag}: only with --onnx (arcface_torch's state dict has no input size, opset "
            "or check)"
            for flag, given in onnx_only
            if given
        ]
    out = args.onnx if args.onnx is not None else args.arcface_torch
    if out.is_dir():
        problems.append(f"{'--onnx' if args.onnx else '--arcface-torch'}: {out} is a folder")
    return problems


def _export(args: argparse.Namespace) -> int:
    """Read the checkpoint and write the file the flags ask for; 1 on an error (one line)."""
    from recognition.checkpoint import load_backbone
    from recognition.config import parse_image_size
    from recognition.models import check_input_size

    try:
        image_size_arg = None
        if args.image_size is not None:
            image_size_arg = parse_image_size(args.image_size, "--image-size")
        backbone, image_size = load_backbone(args.checkpoint, torch.device("cpu"))
        if args.arcface_torch is not None:
            export_arcface_torch(backbone, args.arcface_torch)
            return 0
        check_input_size(backbone, image_size_arg, "--image-size")
        image_size = image_size_arg or image_size
        export_onnx(backbone, args.onnx, image_size, opset=args.opset or DEFAULT_OPSET)
        height, width = image_size_pair(image_size)
        log.info("wrote %s (input images: batch x 3 x %d x %d)", args.onnx, height, width)
        if not args.no_check:
            try:
                diff = check_onnx(args.onnx, backbone, image_size)
            except ImportError:
                log.warning("onnxruntime is not installed: the export was not checked")
            else:
                log.info("onnxruntime vs PyTorch: max abs difference %.3g", diff)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
