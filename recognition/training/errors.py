"""`TrainingError`: a run that cannot go on, raised by building, resuming, the loop, its
hooks and the memory check alike (below all of them, so that each imports it downward)."""


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses, a run directory that would be overwritten)."""
