"""Train a recognition model: `python train.py [--config NAME_OR_PATH] [key=value ...]`.

`--show-config` prints the config that would run (YAML, each key with the file that set it
and its doc) and exits.

Runs on one process as is, or on N with `torchrun --nproc_per_node N train.py ...` (and on
several machines with torchrun's rendezvous options; docs/distributed.md). With `--plan
--gpus N --gpu-memory GIB [--classes C]` it plans the run on this CPU instead
(docs/planning.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from recognition.compat import torch_version_error
from recognition.config import ConfigError, ExperimentConfig, load_config_sources

# Seconds a rank > 0 waits before leaving on an error every rank met, so that rank 0 says it
# before torchrun stops the job.
REPLICA_GRACE_S = 2.0
# When this process began to run train.py (the exit line says how long ago).
STARTED = time.monotonic()
# What --plan plans for without --gpus / --gpu-memory: one machine of 8 80 GiB GPUs.
PLAN_GPUS = 8
PLAN_GPU_MEMORY_GIB = 80.0


def _parser() -> argparse.ArgumentParser:
    """train.py's command line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--config",
        help="a name in configs/ or a path to a YAML file (default: default, the built-in run)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="plan the run on this CPU instead of training: each rank's memory and step-time "
        "bound, whether it fits, the largest batch and class count that fit",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help=f"with --plan: the number of GPUs, the world size (default: {PLAN_GPUS})",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help=f"with --plan: GiB of memory per GPU (default: {PLAN_GPU_MEMORY_GIB:g})",
    )
    parser.add_argument(
        "--classes",
        type=int,
        metavar="N",
        help="with --plan: the class count (default: the data set's, which must be here)",
    )
    parser.add_argument(
        "--show-config",
        action="store_true",
        help="print the resolved config (with --config and the overrides) as YAML, each key "
        "with its doc, and exit (docs/configuration.md lists every key)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. head.margin=cosface optim.lr=0.05",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # Intermixed: `--plan --gpus 8 key=value --classes N` reads as well as the options first.
    args = parser.parse_intermixed_args(argv)
    if (version_error := torch_version_error()) is not None:
        print(f"error: {version_error}", file=sys.stderr)
        return 2
    loaded = _checked_config(args)
    if loaded is None:
        return 2
    cfg, sources = loaded

    if args.show_config:
        from recognition.config.reference import show_config

        command = " ".join(["--config", args.config or "default", *args.overrides])
        print(show_config(cfg, command, sources), end="")
        return 0

    if args.plan:
        from recognition.training.plan.report import run_plan_command

        return run_plan_command(
            cfg,
            gpus=args.gpus or PLAN_GPUS,
            gpu_memory_gib=args.gpu_memory or PLAN_GPU_MEMORY_GIB,
            num_classes=args.classes,
        )

    # Before torch is imported or anything made: missing inputs are said in a second or two.
    from recognition.preflight import InputError, input_problems, toy_on_own_data

    rank = int(os.environ.get("RANK", "0"))
    if problems := input_problems(cfg):
        if rank == 0:
            print("\n".join(f"error: {problem}" for problem in problems), file=sys.stderr)
        else:
            time.sleep(REPLICA_GRACE_S)  # rank 0 says it
        return 1
    if args.config is None and toy_on_own_data(cfg, args.overrides):
        if (advice := _gpu_recipe_advice(cfg)) is not None:
            if rank == 0:
                print(f"error: {advice}", file=sys.stderr)
            return 2

    from recognition.data.workers import error_message
    from recognition.distributed import is_collective_failure
    from recognition.logging import log_to_files
    from recognition.pipeline import PipelineError
    from recognition.training import TrainingError, train
    from recognition.training.stopping import EXIT_STOPPED, RunStopped

    try:
        train(cfg, inputs_checked=True)
    except RunStopped as stopped:  # a stop signal or the time limit, with a checkpoint
        if rank == 0:
            print(stopped, file=sys.stderr)
        _log_exit(EXIT_STOPPED)
        return EXIT_STOPPED
    except Exception as raised:
        # OSError: files and folders (a missing or unreadable one, a full disk), named in the
        # message by the code that raised it. A pipeline schedule re-raises a stage's error
        # as the cause of its own RuntimeError: the cause is what to report.
        exc = _reported(raised, (TrainingError, ConfigError, ValueError, OSError))
        if exc is not None:
            message = error_message(exc)  # a loader worker's error without its traceback
            log_to_files(logging.ERROR, message)  # train.log (train.rank<R>.log) keeps it
            # What every rank finds alike (the config, the pipeline's layout, the checkpoint
            # rank 0 chose) is said once, by rank 0; the others give it a moment to.
            alike = ConfigError | InputError | PipelineError | TrainingError
            if rank > 0 and isinstance(exc, alike):
                time.sleep(REPLICA_GRACE_S)
            else:  # a line each (the inputs checked at the start report every problem)
                print("\n".join(f"error: {line}" for line in message.splitlines()), file=sys.stderr)
            return 1
        if not is_collective_failure(raised):
            raise
        _collective_failure(raised, rank, cfg.train.timeout_s, cfg.run_dir)
    _log_exit(0)
    return 0


def _log_exit(status: int) -> None:
    """The run's last line: the process exits now (its workers and process group are gone),
    so the time from this line to the process's end is the interpreter's own teardown."""
    logging.getLogger("recognition.train").info(
        "exiting with status %d, %.1f s after train.py started", status, time.monotonic() - STARTED
    )


def _checked_config(args: argparse.Namespace) -> tuple[ExperimentConfig, dict[str, str]] | None:
    """The config and what set each key (`load_config_sources`); None after printing every
    problem of the flags and the config at once, a line each."""
    problems = [f"error: {problem}" for problem in flag_problems(args)]
    loaded = None
    try:
        loaded = load_config_sources(args.config or "default", args.overrides)
    except ConfigError as exc:
        problems += [f"config error: {line}" for line in str(exc).splitlines()]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return None
    return loaded


def flag_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags alone, a line each: a flag without the flag it belongs to,
    two that exclude each other, a count below 1."""
    problems = []
    planning = {"--gpus": args.gpus, "--gpu-memory": args.gpu_memory, "--classes": args.classes}
    for flag, value in planning.items():
        if value is not None and not args.plan:
            problems.append(
                f"{flag}: only with --plan (it sizes the planned run; training "
                "takes its GPUs from torchrun and its classes from data.root)"
            )
        elif value is not None and not value > 0:
            problems.append(f"{flag}: must be positive, got {value:g}")
    if args.plan and args.show_config:
        problems.append(
            "--show-config and --plan: one at a time (--show-config prints the config "
            "--plan would plan, and exits)"
        )
    return problems


def _gpu_recipe_advice(cfg: ExperimentConfig) -> str | None:
    """On a GPU (what train.device=auto picks): the one line that names the config for an
    image folder of one's own; None on a CPU, where the built-in toy is the right model."""
    from recognition.distributed import pick_device

    try:
        if pick_device(cfg.train.device).type != "cuda":
            return None
    except ValueError:  # train.device=cuda without a GPU: the run says so itself
        return None
    root = cfg.data.root
    return (
        f"data.root={root} on a GPU: the built-in config trains its CPU toy (IResNet-18 at "
        f"width 1/8, 48x48); on this GPU run `python train.py --config folder data.root={root}` "
        "(IResNet-50, 112x112, O1 bf16), or add --config default to train the toy anyway"
    )


def _reported(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """`exc`, or the first exception of its cause chain, that is one of `kinds`; else None."""
    while exc is not None:
        if isinstance(exc, kinds):
            return exc
        exc = exc.__cause__
    return None


def _collective_failure(exc: BaseException, rank: int, timeout_s: float, run_dir) -> None:
    """Say that a peer rank failed (one line, this rank's), and leave at once."""
    from recognition.logging import log_to_files

    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = (
        f"rank {rank}: stopping, a collective operation failed: another rank died or did "
        f"not answer within train.timeout_s={timeout_s:g} s (its own log, "
        f"train.rank<R>.log or torchrun's output, says why). The last checkpoint in "
        f"{run_dir / 'checkpoints'} is intact; train.resume=auto continues from it. "
        f"[{detail}]"
    )
    log_to_files(logging.ERROR, message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    # A process group whose peer is gone cannot be torn down (gloo aborts, NCCL may block in
    # its destructors): leave at once, with the status torchrun expects.
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
