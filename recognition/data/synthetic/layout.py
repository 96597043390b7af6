"""What the synthetic data set looks like on disk (the folders, the pairs file, the markers and
the identities' names) and the tags that keep its random streams apart."""

from __future__ import annotations

TRAIN_DIR = "train"
VAL_DIR = "val"
PAIRS_FILE = "pairs.txt"
COMPLETE_MARKER = ".complete"
GENERATING_MARKER = ".generating"

# Seed-sequence tags that keep the random streams of the splits and the pairs apart.
TRAIN_STREAM = 0
VAL_STREAM = 1
PAIRS_STREAM = 2
FACES_STREAM = 3


def train_identity_name(index: int) -> str:
    """Folder name of training identity `index`."""
    return f"id_{index:05d}"


def val_identity_name(index: int) -> str:
    """Folder name (and file-name prefix) of held-out identity `index`."""
    return f"person_{index:04d}"
