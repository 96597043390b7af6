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
every image evaluated (with several targets, EMB.<target>.npz each). Several targets give
one table; the JSON is then keyed by target name (flat for a single target).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recognition.compat import torch_version_error
from recognition.config import ConfigError, EvalTarget, load_config, parse_image_size

if TYPE_CHECKING:
    from torch import nn


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_source_args(parser)
    _add_reid_args(parser)
    _add_ijb_args(parser)
    _add_output_args(parser)
    _add_extraction_args(parser)
    _add_onnx_args(parser)
    return parser.parse_args(argv)


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    """What is evaluated: a model or stored embeddings, and on which pairs, .bin or re-id set."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        type=Path,
        help="backbone.pt or a training checkpoint; an arcface_torch or torchvision state "
        "dict; an .onnx model",
    )
    source.add_argument("--embeddings", type=Path, help=".npz with embeddings and paths")
    parser.add_argument("--pairs", type=Path, help="LFW-format pairs file")
    parser.add_argument(
        "--images",
        type=Path,
        help="folder the pairs' image names resolve in (default: the pairs' folder); "
        "without --pairs, with --export-embeddings: embed every image under it",
    )
    parser.add_argument(
        "--bin",
        type=Path,
        action="append",
        default=[],
        metavar="FILE.bin",
        help="insightface verification set (lfw.bin, cfp_fp.bin, ...); may be repeated",
    )
    parser.add_argument(
        "--reid",
        type=Path,
        nargs="?",
        const=Path("."),
        metavar="ROOT",
        help="re-id ranking (CMC, mAP, mINP) on a re-id data set: Market-1501's (or "
        "DukeMTMC-reID's) ROOT/query and ROOT/bounding_box_test, MSMT17's list files, "
        "CUHK03's new-protocol split; with --embeddings of a Market-1501 layout no ROOT is "
        "needed",
    )


def _add_reid_args(parser: argparse.ArgumentParser) -> None:
    """The re-id ranking's options (--reid): k-reciprocal re-ranking, CUHK03's boxes."""
    parser.add_argument(
        "--rerank",
        action="store_true",
        help="rank by the k-reciprocal re-ranked distance (Zhong et al. 2017)",
    )
    parser.add_argument("--rerank-k1", type=int, metavar="K1", help="re-ranking's k1 (default 20)")
    parser.add_argument("--rerank-k2", type=int, metavar="K2", help="re-ranking's k2 (default 6)")
    parser.add_argument(
        "--rerank-lambda", type=float, metavar="L", help="re-ranking's lambda (default 0.3)"
    )
    parser.add_argument(
        "--cuhk03-boxes",
        choices=["labeled", "detected"],
        default="labeled",
        help="CUHK03: the split of the hand-labeled boxes or of the detected ones",
    )


def _reid_options(args: argparse.Namespace) -> dict:
    """evaluate_reid's keyword arguments from --rerank* and --cuhk03-boxes (flags checked)."""
    from recognition.evaluation.rerank import RerankParams

    flags = (("k1", args.rerank_k1), ("k2", args.rerank_k2), ("lambda_value", args.rerank_lambda))
    given = {name: value for name, value in flags if value is not None}
    if args.reid is None and (args.rerank or given):
        raise ValueError("--rerank: re-ranks the re-id ranking; use it with --reid")
    if given and not args.rerank:
        flag = "--rerank-" + next(iter(given)).replace("_value", "")
        raise ValueError(f"{flag}: only with --rerank")
    rerank = RerankParams(**given) if args.rerank else None
    return {"rerank": rerank, "cuhk03_boxes": args.cuhk03_boxes}


def _add_ijb_args(parser: argparse.ArgumentParser) -> None:
    """The IJB-B/C modes (--ijb ...)."""
    parser.add_argument(
        "--ijb",
        type=Path,
        metavar="ROOT",
        help="IJB-B/C templates on ROOT/meta and ROOT/loose_crop (see --ijb-mode)",
    )
    parser.add_argument("--ijb-name", choices=["ijbb", "ijbc"], help="which IJB set ROOT holds")
    parser.add_argument(
        "--ijb-mode",
        choices=["11", "1n"],
        default="11",
        help="11: 1:1 template verification (TAR@FAR); 1n: 1:N identification of the mixed "
        "probes in galleries G1/G2 (S1/S2 for IJB-B): CMC and TPIR@FPIR",
    )
    parser.add_argument(
        "--ijb-score-weight",
        action="store_true",
        help="weigh each image's feature by its detector score before pooling",
    )
    parser.add_argument(
        "--save-features",
        type=Path,
        metavar="F.npz",
        help="with --ijb: the image features are read from F.npz when it exists (no model "
        "runs), else computed and written there; one file serves both --ijb-modes",
    )


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
    """How the embeddings are made: input size, crop, batch, flip, device, workers."""
    parser.add_argument(
        "--image-size",
        metavar="N|HxW",
        help="input size, a square side or HxW such as 256x128 (default: the checkpoint's)",
    )
    parser.add_argument(
        "--crop",
        type=int,
        metavar="PIXELS",
        help="centre square cut from each original image before resizing (e.g. 150 for "
        "LFW's 250x250 photos)",
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


def _onnx_input(args: argparse.Namespace):
    """The --onnx-* flags as an OnnxInput; None when none is given (the default)."""
    from recognition.evaluation.onnx_model import OnnxInput

    if args.onnx_mean is None and args.onnx_std is None and not args.onnx_bgr:
        return None
    default = OnnxInput()
    return OnnxInput(args.onnx_mean or default.mean, args.onnx_std or default.std, args.onnx_bgr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (version_error := torch_version_error()) is not None:
        print(f"error: {version_error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        image_size = None
        if args.image_size is not None:
            image_size = parse_image_size(args.image_size, "--image-size")
        if args.rerank or (args.rerank_k1, args.rerank_k2, args.rerank_lambda) != (None,) * 3:
            _reid_options(args)  # a --rerank flag out of place stops before any work
        if args.ijb is not None:
            return _ijb(args, image_size)
        if args.embeddings is not None:
            results = _from_embeddings(args)
        else:
            results = _from_checkpoint(args, image_size)
        if results is not None:
            _report(args, results)
    except (ConfigError, ValueError, OSError) as exc:
        from recognition.data.workers import error_message

        print(f"error: {error_message(exc)}", file=sys.stderr)
        return 1
    return 0


def _from_checkpoint(
    args: argparse.Namespace, image_size_arg: tuple[int, int] | None
) -> dict[str, dict] | None:
    """Results of a checkpoint's backbone on the command line's targets (or its run's, or
    re-id); None when it only wrote the embeddings of an image folder."""
    from recognition.distributed import pick_device
    from recognition.evaluation import reid, run
    from recognition.evaluation.embeddings import Extraction
    from recognition.evaluation.onnx_model import load_model

    checkpoint, targets = _checkpoint_and_targets(args)
    device = pick_device(args.device)
    backbone, image_size = load_model(checkpoint, device, _onnx_input(args))
    extraction = Extraction(args.batch_size, not args.no_flip, device, args.workers)
    _check_image_size(backbone, image_size_arg)
    image_size = image_size_arg or image_size
    if args.reid is not None:
        name = args.reid.resolve().name
        options = _reid_options(args)
        return {
            name: reid.evaluate_reid(
                backbone,
                args.reid,
                image_size,
                extraction,
                export_path=args.export_embeddings,
                **options,
            )
        }
    if not targets and args.images is not None and args.export_embeddings:
        # An image folder and nothing to verify: embeddings only.
        run.export_folder(
            backbone, args.images, args.export_embeddings, image_size, extraction, crop=args.crop
        )
        return None
    if not targets:
        raise ValueError("nothing to evaluate: pass --pairs (and --images), --bin or --reid")
    return run.evaluate_targets(
        backbone,
        targets,
        image_size,
        extraction,
        export_path=args.export_embeddings,
        xnorm=args.xnorm,
    )


def _checkpoint_and_targets(args: argparse.Namespace) -> tuple[Path, list[EvalTarget] | None]:
    """--checkpoint and the targets named on the command line; without --checkpoint, the
    last run of --config (its run directory, runs/<name> or its output_dir): its backbone
    export and (unless targets are named) what it verified on, by the config.yaml it saved:
    its eval.targets, else its data's held-out identities (the synthetic set's pairs, or
    the pairs of the identities eval.holdout kept out, in the run directory)."""
    from recognition.evaluation.run import run_targets

    checkpoint, targets = args.checkpoint, None
    if checkpoint is None:
        cfg = load_config(args.config)
        if (cfg.run_dir / "config.yaml").is_file():
            cfg = load_config(str(cfg.run_dir / "config.yaml"))
        checkpoint = cfg.run_dir / "backbone.pt"
        if not checkpoint.is_file():
            raise FileNotFoundError(
                f"{checkpoint}: no trained backbone yet; run `python train.py "
                f"--config {args.config}` first, or pass --checkpoint"
            )
        targets = run_targets(cfg)
    return checkpoint, _targets(args) or targets


def _report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """Print the table of ``results``; write --json (and --roc for verification)."""
    from recognition.evaluation import reid, run

    if args.reid is not None:
        reid.report_reid(results, json_path=args.json)
    else:
        run.report(results, json_path=args.json, roc_path=args.roc, flat_json=True)


def _check_image_size(backbone: nn.Module, image_size: int | tuple[int, int] | None) -> None:
    """Refuse an --image-size that a backbone built for one input size cannot take (IResNet:
    its fc layer is sized for the map of its own input size), naming the flag."""
    from recognition.config import image_size_pair

    fixed = getattr(backbone, "image_size", None)
    if image_size is None or fixed is None:
        return
    height, width = image_size_pair(image_size)
    if (height, width) != tuple(fixed):
        raise ValueError(
            f"--image-size {height}x{width}: this checkpoint's backbone takes "
            f"{fixed[0]}x{fixed[1]} images only (its layers are sized for them); leave "
            "--image-size out"
        )


def _ijb(args: argparse.Namespace, image_size: tuple[int, int] | None) -> int:
    """IJB-B/C verification or identification (--ijb): the table, and JSON / ROC when asked."""
    from recognition.distributed import pick_device
    from recognition.evaluation.ijb.report import report_ijb, report_search
    from recognition.evaluation.ijb.search import evaluate_ijb_search
    from recognition.evaluation.ijb.verification import evaluate_ijb

    _check_ijb_args(args)
    evaluate_mode = evaluate_ijb_search if args.ijb_mode == "1n" else evaluate_ijb
    results = evaluate_mode(
        args.ijb,
        args.ijb_name,
        checkpoint=args.checkpoint,
        features_path=args.save_features,
        image_size=image_size,
        score_weight=args.ijb_score_weight,
        batch_size=args.batch_size,
        flip=not args.no_flip,
        device=pick_device(args.device),
        num_workers=args.workers,
        onnx_input=_onnx_input(args),
    )
    if args.ijb_mode == "1n":
        report_search(results, json_path=args.json)
    else:
        report_ijb(results, json_path=args.json, roc_path=args.roc)
    return 0


def _check_ijb_args(args: argparse.Namespace) -> None:
    """Refuse flags --ijb does not take, or output paths it could not write, before any work."""
    if args.embeddings is not None or args.pairs or args.bin or args.reid is not None:
        raise ValueError("--ijb: takes --checkpoint, not --embeddings, --pairs, --bin or --reid")
    if args.ijb_name is None:
        raise ValueError("--ijb: needs --ijb-name ijbb or ijbc")
    if args.ijb_mode == "1n" and args.roc is not None:
        raise ValueError("--roc: the 1:1 mode's curve; --ijb-mode 1n has none")
    for path, flag in ((args.json, "--json"), (args.roc, "--roc")):
        # Found now, not after hours of extraction.
        if path is not None and path.is_dir():
            raise ValueError(f"{flag}: {path} is a folder")


def _targets(args: argparse.Namespace) -> list[EvalTarget]:
    """The verification targets named on the command line, in order: --pairs, then --bin."""
    targets = []
    if args.pairs is not None:
        images = str(args.images) if args.images else None
        targets.append(EvalTarget(pairs=str(args.pairs), images=images, crop=args.crop))
    targets += [EvalTarget(bin=str(path), crop=args.crop) for path in args.bin]
    return targets


def _from_embeddings(args: argparse.Namespace) -> dict[str, dict]:
    """Results computed from an embeddings file alone (pairs verification or re-id)."""
    from recognition.data.pairs import load_pairs
    from recognition.evaluation import reid
    from recognition.evaluation.embeddings import index_paths, load_embeddings, verify_pairs

    embeddings, paths = load_embeddings(args.embeddings)
    if args.reid is not None:
        # --reid alone: Market-1501's names; --reid ROOT: the data set's lists.
        root = None if args.reid == Path(".") else args.reid
        return {
            args.embeddings.stem: reid.reid_from_embeddings(
                embeddings, paths, str(args.embeddings), root=root, **_reid_options(args)
            )
        }
    if args.pairs is None:
        raise ValueError("--embeddings needs --pairs (or --reid)")
    name = EvalTarget(pairs=str(args.pairs)).label
    return {name: verify_pairs(embeddings, index_paths(paths), load_pairs(args.pairs))}


if __name__ == "__main__":
    sys.exit(main())
