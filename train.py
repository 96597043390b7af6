"""Train a recognition model: `python train.py [--config NAME_OR_PATH] [key=value ...]`.

Runs on one process as is, or on N with `torchrun --nproc_per_node N train.py ...`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from recognition.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--config",
        default="default",
        help="a name in configs/ (default: default) or a path to a YAML file",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. head.margin=cosface optim.lr=0.05",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    from recognition.engine import TrainingError, train

    try:
        train(cfg)
    except (TrainingError, ConfigError, ValueError, FileNotFoundError) as exc:
        logging.getLogger("recognition").error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
