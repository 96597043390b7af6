"""Train a recognition model: `python train.py [--config NAME_OR_PATH] [key=value ...]`.

Runs on one process as is, or on N with `torchrun --nproc_per_node N train.py ...` (and on
several machines with torchrun's rendezvous options; see the README). With `--plan
--gpus N --gpu-memory GIB [--classes C]` it plans the run on this CPU instead (README,
"Planning a run").
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from recognition.compat import torch_version_error
from recognition.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--config",
        default="default",
        help="a name in configs/ (default: default) or a path to a YAML file",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="plan the run on this CPU instead of training: each rank's memory and step-time "
        "bound, whether it fits, the largest batch and class count that fit",
    )
    parser.add_argument("--gpus", type=int, default=8, help="with --plan: GPUs (world size)")
    parser.add_argument(
        "--gpu-memory", type=float, default=80.0, help="with --plan: GiB of memory per GPU"
    )
    parser.add_argument(
        "--classes",
        type=int,
        default=None,
        help="with --plan: the class count (default: the data set's, which must be here)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. head.margin=cosface optim.lr=0.05",
    )
    # Intermixed: `--plan --gpus 8 key=value --classes N` reads as well as the options first.
    args = parser.parse_intermixed_args(argv)
    if (version_error := torch_version_error()) is not None:
        print(f"error: {version_error}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    if args.plan:
        from recognition.training.plan_report import run_plan_command

        return run_plan_command(
            cfg, gpus=args.gpus, gpu_memory_gib=args.gpu_memory, num_classes=args.classes
        )

    from recognition.data.workers import error_message
    from recognition.distributed import is_collective_failure
    from recognition.logging import log_to_files
    from recognition.training import TrainingError, train

    try:
        train(cfg)
    # OSError: files and folders (a missing or unreadable one, a full disk), named in the
    # message by the code that raised it.
    except (TrainingError, ConfigError, ValueError, OSError) as exc:
        message = error_message(exc)  # a loader worker's error without its traceback
        # One line on the console (this one); train.log keeps it too.
        log_to_files(logging.ERROR, message)
        print(f"error: {message}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not is_collective_failure(exc):
            raise
        rank = os.environ.get("RANK", "0")
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = (
            f"rank {rank}: stopping, a collective operation failed: another rank died or did "
            f"not answer within train.timeout_s={cfg.train.timeout_s:g} s (its own log, "
            f"train.rank<R>.log or torchrun's output, says why). The last checkpoint in "
            f"{cfg.run_dir / 'checkpoints'} is intact; train.resume=auto continues from it. "
            f"[{detail}]"
        )
        log_to_files(logging.ERROR, message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        logging.shutdown()
        # A process group whose peer is gone cannot be torn down (gloo aborts, NCCL may
        # block in its destructors): leave at once, with the status torchrun expects.
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
