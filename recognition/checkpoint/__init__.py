"""Checkpoints: the sharded training state in `torch.distributed.checkpoint` (DCP) format,
resumable on any number of ranks, and the single-file backbone export.

One concern a module:
- `files`: single files written atomically; a run's `checkpoints/step_<N>` directories.
- `entries`: how a dict of `Stateful` parts becomes flat entries `<part>/<key>` and back.
- `planners`: DCP's planners and reader adapted: class rows saved as chunks of one global
  tensor and read back on any world size; the `.metadata` index read as data, never code.
- `store`: save, load, read whole and verify a training checkpoint (its entries, its
  format version).
- `backbone_files`: the backbone export, and telling and reading the files a backbone is
  loaded from.
- `rng`: a process's random streams as checkpoint data.
"""

from recognition.checkpoint.backbone_files import (
    BACKBONE_FORMAT,
    export_backbone,
    load_backbone,
    load_backbone_file,
)
from recognition.checkpoint.entries import flatten_state
from recognition.checkpoint.files import (
    CHECKPOINT_RE,
    METADATA_FILE,
    TMP_PREFIX,
    atomic_save,
    checkpoint_path,
    is_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_file,
)
from recognition.checkpoint.rng import rng_state, set_rng_state
from recognition.checkpoint.store import (
    FORMAT_ENTRY,
    FORMAT_VERSION,
    checkpoint_entries,
    checkpoint_version,
    load_checkpoint,
    read_checkpoint,
    read_part,
    save_checkpoint,
)
from recognition.checkpoint.verify import verify_checkpoint
from recognition.sharded import rows_of

__all__ = [
    "BACKBONE_FORMAT",
    "CHECKPOINT_RE",
    "FORMAT_ENTRY",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "TMP_PREFIX",
    "atomic_save",
    "checkpoint_entries",
    "checkpoint_path",
    "checkpoint_version",
    "export_backbone",
    "flatten_state",
    "is_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_backbone",
    "load_backbone_file",
    "load_checkpoint",
    "load_file",
    "read_checkpoint",
    "read_part",
    "rng_state",
    "rows_of",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]
