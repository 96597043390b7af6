"""Export a trained backbone to ONNX.

  python -m recognition.export --checkpoint runs/x/backbone.pt --onnx model.onnx

The graph takes ``images`` (B, 3, H, W) float32 at the checkpoint's input size (or
``--image-size N`` / ``HxW``), normalised like training inputs
(x / 127.5 - 1), and returns ``embeddings`` (B, D), not L2-normalised (normalise, and add
the mirrored image's embedding if wanted, in the application). The batch dimension is
dynamic. Needs the ``onnx`` and ``onnxscript`` packages (torch's exporter); with
``onnxruntime`` installed the export is checked against PyTorch on a random batch.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="backbone.pt or a checkpoint"
    )
    parser.add_argument("--onnx", type=Path, required=True, help="the ONNX file to write")
    parser.add_argument(
        "--image-size",
        metavar="N|HxW",
        help="input size, a square side or HxW such as 256x128 (default: the checkpoint's)",
    )
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument(
        "--no-check", action="store_true", help="skip the onnxruntime comparison with PyTorch"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from recognition.checkpoint import load_backbone
    from recognition.config import parse_image_size

    try:
        image_size_arg = None
        if args.image_size is not None:
            image_size_arg = parse_image_size(args.image_size, "--image-size")
        backbone, image_size = load_backbone(args.checkpoint, torch.device("cpu"))
        image_size = image_size_arg or image_size
        export_onnx(backbone, args.onnx, image_size, opset=args.opset)
        height, width = image_size_pair(image_size)
        log.info("wrote %s (input images: batch x 3 x %d x %d)", args.onnx, height, width)
        if not args.no_check:
            try:
                diff = check_onnx(args.onnx, backbone, image_size)
            except ImportError:
                log.warning("onnxruntime is not installed: the export was not checked")
            else:
                log.info("onnxruntime vs PyTorch: max abs difference %.3g", diff)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
