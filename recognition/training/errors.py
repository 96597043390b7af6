"""`TrainingError`, the training package's error: a run that cannot go on, raised by
building, resuming, the loop, its hooks and the memory check alike, and told apart from a
bug by train.py (one line, no traceback)."""


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses, a run directory that would be overwritten)."""
