"""Verification on LFW-style pairs or insightface .bin files, re-id ranking, embedding export.

  python evaluate.py --checkpoint CKPT --pairs PAIRS [--images ROOT] [--json OUT.json]
  python evaluate.py --checkpoint CKPT --bin lfw.bin [--bin cfp_fp.bin ...]
  python evaluate.py --checkpoint CKPT --reid MARKET_ROOT     # query/ vs bounding_box_test/
  python evaluate.py --checkpoint CKPT --images FOLDER --export-embeddings EMB.npz
  python evaluate.py --embeddings EMB.npz --pairs PAIRS [--json OUT.json]
  python evaluate.py --embeddings EMB.npz --reid   # paths query/..., bounding_box_test/...
  python evaluate.py --checkpoint CKPT --reid MSMT17_V1 --rerank   # k-reciprocal re-ranking
  python evaluate.py --checkpoint CKPT --ijb IJB_ROOT --ijb-name ijbc [--save-features F.npz]
  python evaluate.py --checkpoint CKPT --ijb IJB_ROOT --ijb-name ijbc --ijb-mode 1n   # 1:N
  python evaluate.py                      # the last run of the default config, on what it
                                          # verified on (its held-out identities)

CKPT is a run's backbone.pt or any of its training checkpoints, an arcface_torch IResNet
state dict (backbone.pth, model.pt), a torchvision ResNet-50 state dict (re-id), or an ONNX
model (run by onnxruntime; its input normalisation --onnx-mean, --onnx-std, --onnx-bgr).
`--roc roc.png` draws the ROC; `--export-embeddings EMB.npz` writes the embeddings of
every image evaluated (with several targets, EMB.<target>.npz each). Several targets
(of any kinds: --pairs, --bin, --reid, --ijb together) give a table per kind; the JSON is
then keyed by target name (flat for a single target). Each kind is a protocol
(recognition/evaluation/protocols/), whose flags are its own; every flag is checked, and
every problem said, before any model is loaded.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recognition.compat import torch_version_error
from recognition.config import ConfigError, load_config, parse_image_size
from recognition.evaluation.protocols import Protocol, path_problem, protocol_class, protocol_for
from recognition.registry import PROTOCOLS

if TYPE_CHECKING:
    from torch import nn


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_source_args(parser)
    for kind in PROTOCOLS:  # each protocol's own flags (--pairs, --bin, --ijb ..., --reid)
        protocol_class(kind).add_arguments(parser)
    _add_output_args(parser)
    _add_extraction_args(parser)
    _add_onnx_args(parser)
    return parser.parse_args(argv)


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    """What is evaluated: a model or stored embeddings."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        type=Path,
        help="backbone.pt or a training checkpoint; an arcface_torch or torchvision state "
        "dict; an .onnx model",
    )
    source.add_argument("--embeddings", type=Path, help=".npz with embeddings and paths")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    """The run evaluated by default, and the files written."""
    parser.add_argument(
        "--config",
        default="default",
        help="with no --checkpoint/--embeddings: the config whose last run (its run "
        "directory) to evaluate on the targets it verified on (default: default)",
    )
    parser.add_argument("--json", type=Path, help="write the metrics as JSON here")
    parser.add_argument("--roc", type=Path, help="draw the ROC curve to this image file")
    parser.add_argument(
        "--export-embeddings",
        type=Path,
        metavar="EMB.npz",
        help="write the embeddings (and image paths) of every image evaluated",
    )


def _add_extraction_args(parser: argparse.ArgumentParser) -> None:
    """How the embeddings are made: input size, batch, flip, device, workers."""
    parser.add_argument(
        "--image-size",
        metavar="N|HxW",
        help="input size, a square side or HxW such as 256x128 (default: the checkpoint's)",
    )
    parser.add_argument(
        "--xnorm", action="store_true", help="also report the mean norm of the raw embeddings"
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--no-flip", action="store_true", help="do not add the embedding of the mirrored image"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--workers", type=int, default=2, help="image loading processes")


def _add_onnx_args(parser: argparse.ArgumentParser) -> None:
    """How an ONNX model wants its images (default: (pixel - 127.5) / 127.5 on RGB)."""
    parser.add_argument(
        "--onnx-mean",
        type=_channel_values,
        metavar="M|R,G,B",
        help="ONNX model: subtracted from the pixel values in [0, 255] (default 127.5)",
    )
    parser.add_argument(
        "--onnx-std",
        type=_channel_values,
        metavar="S|R,G,B",
        help="ONNX model: what the pixel values minus the mean are divided by (default 127.5)",
    )
    parser.add_argument(
        "--onnx-bgr", action="store_true", help="ONNX model: feed the channels in BGR order"
    )


def _channel_values(text: str) -> tuple[float, float, float]:
    """'127.5' or '123.7,116.3,103.5' as three per-channel (R, G, B) values."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (1, 3):
        raise argparse.ArgumentTypeError(f"expected one number or three (R,G,B), got {text!r}")
    return values * 3 if len(values) == 1 else values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (version_error := torch_version_error()) is not None:
        print(f"error: {version_error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Every problem of the flags at once, before a model or a file is read.
    if problems := argument_problems(args):
        print("\n".join(f"error: {problem}" for problem in problems), file=sys.stderr)
        return 1
    try:
        image_size = None
        if args.image_size is not None:
            image_size = parse_image_size(args.image_size, "--image-size")
        _evaluate(args, image_size)
    except (ConfigError, ValueError, OSError) as exc:
        from recognition.data.workers import error_message

        print(f"error: {error_message(exc)}", file=sys.stderr)
        return 1
    return 0


def argument_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags alone, a line each: sizes and counts, a flag without the
    one it needs, a flag the evaluation would not use, an output path that is a folder."""
    problems = []
    for kind in PROTOCOLS:
        problems += protocol_class(kind).problems(args)
    if args.image_size is not None:
        try:
            parse_image_size(args.image_size, "--image-size")
        except ConfigError as exc:
            problems.append(str(exc))
    if args.batch_size < 1:
        problems.append(f"--batch-size: must be at least 1, got {args.batch_size}")
    if args.workers < 0:
        problems.append(f"--workers: must be 0 or more, got {args.workers}")
    protocols = [protocol_for(t) for kind in PROTOCOLS for t in protocol_class(kind).targets(args)]
    if args.embeddings is not None:
        problems += _embeddings_problems(args, protocols)
    if args.images is not None and args.pairs is None and args.export_embeddings is None:
        problems.append("--images: with --pairs, or with --export-embeddings (embed a folder)")
    if args.roc is not None and args.reid is not None and not any(p.has_roc for p in protocols):
        problems.append("--roc: only verification (--pairs, --bin) and IJB 1:1 draw a ROC")
    for path, flag in ((args.json, "--json"), (args.roc, "--roc")):
        problems += [p for p in [path_problem(path, flag)] if p]  # found now, not hours later
    return problems


def _embeddings_problems(args: argparse.Namespace, protocols: list[Protocol]) -> list[str]:
    """What --embeddings cannot do: no target, a target that needs a model, model flags."""
    problems = [
        f"--embeddings: a {p.kind} target needs a model (--checkpoint)"
        for p in protocols
        if type(p).from_embeddings is Protocol.from_embeddings
    ]
    if not protocols:
        problems.append("--embeddings needs --pairs (or --reid)")
    problems += [
        f"{flag}: the embeddings are made already; --embeddings takes no {flag}"
        for flag, given in (
            ("--image-size", args.image_size is not None),
            ("--export-embeddings", args.export_embeddings is not None),
        )
        if given
    ]
    return problems


def _evaluate(args: argparse.Namespace, image_size_arg: tuple[int, int] | int | None) -> None:
    """The results of the command line's targets (or the run's), reported; or an image
    folder's embeddings written."""
    from recognition.evaluation.protocols import evaluate_protocols, report

    options = {kind: protocol_class(kind).options(args) for kind in PROTOCOLS}
    targets = [t for kind in PROTOCOLS for t in protocol_class(kind).targets(args)]
    if args.embeddings is not None:
        from recognition.evaluation.embeddings import load_embeddings

        protocols = [protocol_for(t, **options[t.kind]) for t in targets]
        embeddings, paths = load_embeddings(args.embeddings)
        results = {p.name: p.from_embeddings(embeddings, paths) for p in protocols}
        report(protocols, results, json_path=args.json, roc_path=args.roc, flat_json=True)
        return
    protocols = [protocol_for(t, **options[t.kind]) for t in targets]
    checkpoint = args.checkpoint
    if checkpoint is None and (not protocols or any(p.needs_model for p in protocols)):
        checkpoint, run_targets = _last_run(args)
        if not protocols:
            protocols = [protocol_for(t, **options[t.kind]) for t in run_targets]
    backbone, image_size, extraction = _model(args, checkpoint, protocols, image_size_arg)
    if not protocols and args.images is not None and args.export_embeddings:
        from recognition.evaluation.embeddings import export_folder

        # An image folder and nothing to verify: embeddings only.
        export_folder(
            backbone, args.images, args.export_embeddings, image_size, extraction, crop=args.crop
        )
        return
    if not protocols:
        raise ValueError("nothing to evaluate: pass --pairs (and --images), --bin, --reid or --ijb")
    results = evaluate_protocols(
        backbone,
        protocols,
        image_size,
        extraction,
        export_path=args.export_embeddings,
        xnorm=args.xnorm,
    )
    report(protocols, results, json_path=args.json, roc_path=args.roc, flat_json=True)


def _model(
    args: argparse.Namespace,
    checkpoint: Path | None,
    protocols: list[Protocol],
    image_size_arg: tuple[int, int] | int | None,
):
    """(backbone or None, input size, Extraction): the model is loaded when a protocol
    needs it (IJB finds its own, or reads cached features)."""
    from recognition.distributed import pick_device
    from recognition.evaluation.embeddings import Extraction
    from recognition.evaluation.onnx_model import load_model
    from recognition.evaluation.protocols import onnx_input

    device = pick_device(args.device)
    extraction = Extraction(args.batch_size, not args.no_flip, device, args.workers)
    if checkpoint is None or (protocols and not any(p.needs_model for p in protocols)):
        return None, image_size_arg, extraction
    backbone, image_size = load_model(checkpoint, device, onnx_input(args))
    _check_image_size(backbone, image_size_arg)
    return backbone, image_size_arg or image_size, extraction


def _last_run(args: argparse.Namespace) -> tuple[Path, list]:
    """The last run of --config (its run directory, runs/<name> or its output_dir): its
    backbone export and what it verified on, by the config.yaml it saved: its eval.targets,
    else its data's held-out identities (the synthetic set's pairs, or the pairs of the
    identities eval.holdout kept out, in the run directory)."""
    from recognition.evaluation.targets import run_targets

    cfg = load_config(args.config)
    if (cfg.run_dir / "config.yaml").is_file():
        cfg = load_config(str(cfg.run_dir / "config.yaml"))
    checkpoint = cfg.run_dir / "backbone.pt"
    if not checkpoint.is_file():
        raise FileNotFoundError(
            f"{checkpoint}: no trained backbone yet; run `python train.py "
            f"--config {args.config}` first, or pass --checkpoint"
        )
    return checkpoint, run_targets(cfg)


def _check_image_size(backbone: nn.Module, image_size: int | tuple[int, int] | None) -> None:
    """Refuse an --image-size that a backbone built for one input size cannot take (IResNet:
    its fc layer is sized for the map of its own input size), naming the flag."""
    from recognition.models import check_input_size

    check_input_size(backbone, image_size, "--image-size")


if __name__ == "__main__":
    sys.exit(main())
