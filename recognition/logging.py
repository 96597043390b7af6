"""Run logging: console and `train.log` through `logging`, `metrics.jsonl`, TensorBoard.

Rank 0 logs everything; other ranks log warnings and errors only, to their own
`train.rank<R>.log`. Scalars are all-reduced by the caller before they reach `log`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from recognition.distributed import DistInfo

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(run_dir: Path | None, dist_info: DistInfo) -> None:
    """Route the `recognition` loggers to the console and the run's log file.

    Idempotent: handlers installed by an earlier call (an earlier run in the same
    process, as in tests) are removed first.
    """
    logger = logging.getLogger("recognition")
    for handler in list(logger.handlers):
        if getattr(handler, "_recognition", False):
            logger.removeHandler(handler)
            handler.close()
    level = logging.INFO if dist_info.is_main else logging.WARNING
    logger.setLevel(level)
    logger.propagate = False
    formatter = logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        name = "train.log" if dist_info.is_main else f"train.rank{dist_info.rank}.log"
        handlers.append(logging.FileHandler(run_dir / name))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.setLevel(level)
        handler._recognition = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def log_to_files(level: int, message: str) -> None:
    """Write `message` to the run's log file (`train.log`, `train.rank<R>.log`) only.

    For the error that stops a run: the entry point prints it to the console as its one
    line, and the log file must still say why the run stopped. Nothing is written before
    `setup_logging` has opened a file.
    """
    logger = logging.getLogger("recognition")
    record = logger.makeRecord(logger.name, level, "(entry point)", 0, message, (), None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler) and getattr(handler, "_recognition", False):
            handler.handle(record)


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and mirrors it to TensorBoard.

    Does nothing on ranks other than 0, so callers need no rank checks. `start_step` is the
    step the run starts (or resumes) from: lines of later steps already in metrics.jsonl,
    written by a run that died after its last checkpoint, are dropped, so that a resumed
    run (torchrun --max-restarts) leaves every step in the file once.
    """

    def __init__(
        self, run_dir: Path, dist_info: DistInfo, tensorboard: bool = True, start_step: int = 0
    ):
        self.enabled = dist_info.is_main
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _drop_records_after(run_dir / "metrics.jsonl", start_step)
        # Line-buffered so a crash loses at most the line being written.
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, step: int, values: dict[str, Any], prefix: str | None = "train") -> None:
        """Append {"step": step, **values}; TensorBoard tags are `prefix/key` (`key` if None)."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if key not in ("step", "epoch") and math.isfinite(value):
                        tag = key if prefix is None else f"{prefix}/{key}"
                        self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite the JSON-lines file `path` without its records of steps after `step`."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record_step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut short by a crash
        if isinstance(record_step, int) and record_step <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value
