"""Verification on LFW-style pairs.

  python evaluate.py --checkpoint CKPT --pairs PAIRS [--images ROOT] [--json OUT.json]
  python evaluate.py --embeddings EMB.npz --pairs PAIRS [--json OUT.json]
  python evaluate.py                      # the last run of the default config

CKPT is a run's backbone.pt or any of its training checkpoints. `--roc roc.png` draws the
ROC; `--export-embeddings EMB.npz` writes the embeddings of every image the pairs name.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from recognition.config import ConfigError, EvalTarget, load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="backbone.pt or a training checkpoint")
    source.add_argument("--embeddings", type=Path, help=".npz with embeddings and paths")
    parser.add_argument("--pairs", type=Path, help="LFW-format pairs file")
    parser.add_argument(
        "--images",
        type=Path,
        help="folder the pairs' image names resolve in (default: the pairs' folder)",
    )
    parser.add_argument(
        "--config",
        default="default",
        help="with no --checkpoint/--embeddings: the config whose last run to "
        "evaluate (default: default)",
    )
    parser.add_argument("--json", type=Path, help="write the metrics as JSON here")
    parser.add_argument("--roc", type=Path, help="draw the ROC curve to this image file")
    parser.add_argument(
        "--export-embeddings",
        type=Path,
        metavar="EMB.npz",
        help="write the embeddings of every image the pairs name",
    )
    parser.add_argument("--image-size", type=int, help="input size (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--no-flip", action="store_true", help="do not add the embedding of the mirrored image"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--workers", type=int, default=2, help="image loading processes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from recognition.distributed import pick_device
    from recognition.evaluation.embeddings import index_paths, load_embeddings, verify_pairs
    from recognition.evaluation.run import evaluate_targets, load_backbone, report, target_name

    try:
        if args.embeddings is not None:
            # No model: score the pairs with embeddings someone already computed.
            if args.pairs is None:
                raise ValueError("--embeddings needs --pairs")
            from recognition.data.pairs import load_pairs

            embeddings, paths = load_embeddings(args.embeddings)
            target = EvalTarget(pairs=str(args.pairs))
            results = {
                target_name(target): verify_pairs(
                    embeddings, index_paths(paths), load_pairs(args.pairs)
                )
            }
        else:
            checkpoint, targets = args.checkpoint, None
            if checkpoint is None:
                # The last run of a config: its backbone export and its own eval targets.
                cfg = load_config(args.config)
                checkpoint = cfg.run_dir / "backbone.pt"
                if not checkpoint.is_file():
                    raise FileNotFoundError(
                        f"{checkpoint}: no trained backbone yet; run `python train.py "
                        f"--config {args.config}` first, or pass --checkpoint"
                    )
                targets = cfg.eval.targets
            if args.pairs is not None:
                targets = [
                    EvalTarget(
                        pairs=str(args.pairs), images=str(args.images) if args.images else None
                    )
                ]
            if not targets:
                raise ValueError("nothing to evaluate: pass --pairs (and --images)")
            device = pick_device(args.device)
            backbone, image_size = load_backbone(checkpoint, device)
            results = evaluate_targets(
                backbone,
                targets,
                args.image_size or image_size,
                batch_size=args.batch_size,
                flip=not args.no_flip,
                device=device,
                num_workers=args.workers,
                export_path=args.export_embeddings,
            )
        report(results, json_path=args.json, roc_path=args.roc, flat_json=True)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
