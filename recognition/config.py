"""Typed experiment configuration: nested dataclasses loaded from YAML.

A config file is a YAML mapping whose sections mirror the dataclasses below. A file may
name a `base:` file (relative to itself) that it overrides key by key, so each experiment
is a short file over one base. Command-line overrides use dotted names
(`head.margin=cosface optim.lr=0.05`); their values are parsed as YAML scalars.

Unknown keys, wrong types and bad combinations raise `ConfigError` with the dotted key.
Derived quantities (total steps, warmup steps) are computed where they are used and never
written back here, so the saved `config.yaml` is exactly what the user asked for.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from recognition.data.synthetic import SyntheticSpec

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

MARGIN_NAMES = ("arcface", "cosface", "sphereface", "am_softmax", "combined", "adaface")


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or conflicts with another key."""


@dataclass
class SyntheticConfig(SyntheticSpec):
    """The built-in synthetic dataset (`data.synthetic`): the generator's `SyntheticSpec`
    fields, and whether and where to generate it on first use."""

    enabled: bool = False
    root: str = "data/synthetic"

    def __post_init__(self) -> None:
        # The spec's own checks, reported under the config's dotted key.
        try:
            super().__post_init__()
        except ValueError as exc:
            message = str(exc).replace("SyntheticSpec.", "data.synthetic.", 1)
            raise ConfigError(message) from None

    def spec(self) -> SyntheticSpec:
        """The generator's spec: these fields, less `enabled` and `root`."""
        return SyntheticSpec(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(SyntheticSpec)}
        )


@dataclass
class DataConfig:
    root: str = "data/synthetic/train"
    """An image folder (one sub-folder per identity), a folder holding an insightface
    RecordIO pack (`train.rec` + `train.idx`) or a Market-1501 folder
    (`bounding_box_train/`); see `format`."""
    format: Literal["auto", "folder", "recordio", "market1501"] = "auto"
    """auto: recordio when root holds train.rec and train.idx, market1501 when it holds
    bounding_box_train/, else folder."""
    image_size: int | list[int] = 112
    """Input size in pixels: one side (a square, 112 for aligned faces) or [H, W] (e.g.
    [256, 128] for person crops); images of any size are resized to it."""
    flip: bool = True
    """Random horizontal flip during training."""
    num_workers: int = 2
    cache_dir: str | None = None
    """Where the image-folder index is cached; null: inside data.root (hidden file)."""
    rebuild_index: bool = False
    """Rebuild the cached image-folder index even if it looks current."""
    on_empty_class: Literal["error", "skip"] = "error"
    """An identity folder without images: stop with its name, or leave it out."""
    on_bad_image: Literal["error", "skip"] = "error"
    """An unreadable image: stop with its name, or replace it by another image of the same
    identity (counted, the first few logged, the total reported at the end of each epoch)."""
    sampler: Literal["random", "pk"] = "random"
    """random: a fresh permutation per epoch; pk: batches of P identities x K images."""
    pk_instances: int = 4
    """K, images per identity in a batch with sampler=pk (train.batch_size / K identities)."""
    pin_memory: bool | None = None
    """Page-locked batches for asynchronous copies to the GPU; null: on when training on GPU."""
    persistent_workers: bool = True
    """Keep the DataLoader worker processes from one epoch to the next."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead; null: torch's default (2). Needs num_workers > 0
    (`data.num_workers=0` on the command line clears a file's value)."""
    channels_last: bool = False
    """Feed the backbone NHWC (channels-last) tensors and convert its weights: faster convs
    on GPUs with tensor cores, especially under O1/O2."""
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    """Where images are decoded. cpu: in the DataLoader workers (PIL). gpu: the workers read
    the encoded bytes only and each batch is decoded on the training GPU (nvJPEG through
    torchvision.io.decode_jpeg) and augmented there; non-JPEG files are decoded by the
    workers. auto: gpu when training on a CUDA device and the data holds JPEGs, else cpu."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    @property
    def image_hw(self) -> tuple[int, int]:
        """`image_size` as (H, W): the one place a side becomes a pair."""
        return image_size_pair(self.image_size)

    def __post_init__(self) -> None:
        self.image_size = check_image_size(self.image_size, "data.image_size")
        if self.num_workers < 0:
            raise ConfigError("data.num_workers: must be 0 or more")
        if self.pk_instances < 1:
            raise ConfigError("data.pk_instances: must be at least 1")
        if self.prefetch_factor is not None:
            if self.prefetch_factor < 1:
                raise ConfigError("data.prefetch_factor: must be at least 1 (or null)")
            if self.num_workers == 0:
                raise ConfigError(
                    "data.prefetch_factor: only with worker processes (data.num_workers > 0); "
                    "with data.num_workers=0, set data.prefetch_factor=null"
                )


@dataclass
class ModelConfig:
    backbone: str = "iresnet50"
    embedding_size: int = 512
    width: float = 1.0
    """Channel multiplier of the backbone (1.0 = the published architecture)."""
    dropout: float = 0.0
    sync_bn: bool = False
    """With several processes, turn every BatchNorm into a SyncBatchNorm: batch statistics
    over the global batch instead of each rank's (with pipeline stages: over the
    data-parallel ranks of a stage, per micro-batch). Needs GPUs (torch's SyncBatchNorm
    does not run on CPU)."""
    pipeline_stages: int = 1
    """Cut the backbone into this many stages, one per rank, run as a pipeline over
    micro-batches (torch.distributed.pipelining); the world size must be a multiple of it
    (world / stages data-parallel replicas). 1: no pipeline."""
    micro_batch_size: int | None = None
    """Samples per pipeline micro-batch; must divide train.batch_size. null: the batch in
    2 x pipeline_stages micro-batches."""
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """gpipe: every micro-batch's forward, then every backward (activations of all
    micro-batches held); 1f1b: one forward, one backward in turn after a warm-up
    (activations of at most pipeline_stages micro-batches; needs as many micro-batches)."""
    pipeline_split: list[str] | None = None
    """The units where stages 2..P begin (P - 1 names such as layer3.0; the units are
    "stem", each block "layerI.J" and "embedding"); null: cut where the forward FLOPs of
    the stages are closest to equal."""

    def __post_init__(self) -> None:
        if self.embedding_size < 1:
            raise ConfigError("model.embedding_size: must be at least 1")
        if self.pipeline_stages < 1:
            raise ConfigError("model.pipeline_stages: must be at least 1")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError("model.micro_batch_size: must be at least 1 (or null)")
        if self.pipeline_split is not None and len(self.pipeline_split) != self.pipeline_stages - 1:
            raise ConfigError(
                f"model.pipeline_split: {len(self.pipeline_split)} names for "
                f"{self.pipeline_stages} stages (model.pipeline_stages); give one per stage "
                "after the first, or null"
            )
        if not 0.0 < self.width <= 4.0:
            raise ConfigError(f"model.width: {self.width} is outside (0, 4]")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: {self.dropout} is outside [0, 1)")


@dataclass
class HeadConfig:
    margin: str = "arcface"
    """arcface, cosface, sphereface, am_softmax, combined or adaface."""
    scale: float | None = None
    """Logit scale s; None takes the margin's default."""
    m: float | None = None
    """The margin of arcface / cosface / sphereface / am_softmax / adaface; None takes the
    default."""
    m1: float | None = None
    m2: float | None = None
    m3: float | None = None
    """Combined margin s*(cos(m1*theta + m2) - m3); only with margin=combined."""
    h: float | None = None
    """AdaFace: how far a norm must lie from the running mean, in running stds (1/h), for the
    full margin; >= 0, None takes 0.333. Only with margin=adaface."""
    t_alpha: float | None = None
    """AdaFace: weight of each batch in the running norm statistics, in [0, 1]; None takes
    0.01. Only with margin=adaface."""
    sample_rate: float = 1.0
    """Fraction of the negative classes each rank samples per step (Partial FC)."""
    chunk_size: int | None = None
    """Classes per logit chunk, recomputed in backward (memory O(batch x chunk_size));
    None keeps the logits of the whole shard for backward (faster, memory O(batch x
    classes per rank)). None is never replaced by a size chosen automatically."""
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """The head's local statistics: torch (the reference code), triton (fused kernels, CUDA
    or TRITON_INTERPRET=1) or auto (on CUDA the faster of the two, timed at the first step
    at the run's shapes and cached; torch elsewhere)."""
    tuning_cache: str | None = None
    """Folder of the head's measured choices (auto's kernel, the Triton tiles), a JSON file
    each; null: $XDG_CACHE_HOME/recognition (~/.cache/recognition)."""
    fused_update: bool = False
    """Apply the head's SGD step inside the Triton backward (no weight-sized gradient).
    Needs head.kernel=triton, optim.name=sgd, optim.grad_clip=null, train.accumulate_steps=1
    and precision O0, or O1 with bf16."""

    def __post_init__(self) -> None:
        if self.margin not in MARGIN_NAMES:
            choices = ", ".join(MARGIN_NAMES)
            raise ConfigError(f"head.margin: unknown {self.margin!r} (choose from {choices})")
        if self.margin == "combined" and self.m is not None:
            raise ConfigError("head.m: the combined margin takes head.m1, head.m2 and head.m3")
        if self.margin != "combined":
            for name in ("m1", "m2", "m3"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"head.{name}: only used with head.margin=combined")
        if self.margin == "adaface":
            self._check_adaface()
        else:
            for name in ("h", "t_alpha"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"head.{name}: only used with head.margin=adaface")
        if self.scale is not None and self.scale <= 0:
            raise ConfigError("head.scale: must be positive")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ConfigError(f"head.sample_rate: {self.sample_rate} is outside (0, 1]")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError("head.chunk_size: must be at least 1 (or null)")

    def _check_adaface(self) -> None:
        if self.m is not None and not 0.0 <= self.m < math.pi / 2:
            raise ConfigError(f"head.m: AdaFace's margin must lie in [0, pi/2), got {self.m}")
        if self.h is not None and self.h < 0:
            raise ConfigError(f"head.h: must be >= 0, got {self.h}")
        if self.t_alpha is not None and not 0.0 <= self.t_alpha <= 1.0:
            raise ConfigError(f"head.t_alpha: must lie in [0, 1], got {self.t_alpha}")


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    """Peak learning rate, reached at the end of warmup."""
    momentum: float = 0.9
    weight_decay: float = 5e-4
    """Not applied to BatchNorm / PReLU weights and biases (parameters with ndim <= 1)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_epochs: float = 0.0
    schedule: Literal["poly", "cosine", "constant", "step"] = "poly"
    """After warmup: poly or cosine decay to min_lr at the end, constant, or step (the lr
    multiplied by `gamma` at each of `milestones`)."""
    poly_power: float = 2.0
    min_lr: float = 0.0
    """The lr that poly and cosine end at."""
    milestones: list[float] = field(default_factory=list)
    """schedule=step: epochs (increasing, before train.epochs) from which the lr is multiplied
    by `gamma` once more, e.g. [12, 20, 24]; the steps are counted as epoch x steps per epoch,
    rounded."""
    gamma: float = 0.1
    """schedule=step: the factor applied at each milestone, in (0, 1]."""
    grad_clip: float | None = 5.0
    """Max global gradient norm; null disables clipping."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError("optim.lr: must be positive")
        if self.weight_decay < 0:
            raise ConfigError("optim.weight_decay: must be 0 or more")
        if len(self.betas) != 2:
            raise ConfigError("optim.betas: must hold two numbers")
        if self.warmup_epochs < 0:
            raise ConfigError("optim.warmup_epochs: must be 0 or more")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("optim.min_lr: must lie in [0, optim.lr]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("optim.grad_clip: must be positive (or null to disable)")
        if self.milestones and self.schedule != "step":
            raise ConfigError(
                f"optim.milestones: only used with optim.schedule=step (it is {self.schedule})"
            )
        if any(e <= 0 for e in self.milestones) or any(
            b <= a for a, b in zip(self.milestones, self.milestones[1:], strict=False)
        ):
            raise ConfigError(
                f"optim.milestones: must be positive and increasing epochs, got {self.milestones}"
            )
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"optim.gamma: must lie in (0, 1], got {self.gamma}")


@dataclass
class TrainConfig:
    batch_size: int = 128
    """Per process."""
    epochs: int = 20
    max_steps: int | None = None
    """Stop after this many optimizer steps; the schedule still spans `epochs`."""
    accumulate_steps: int = 1
    """Micro-batches per optimizer step; the loss is divided by this."""
    resume: bool | str = False
    """false: start (refusing to overwrite a run directory holding checkpoints); true: the
    latest checkpoint of the run directory; auto: the latest if there is one, else start (for
    torchrun --max-restarts); a path: that checkpoint directory."""
    device: str = "auto"
    dist_backend: str = "auto"
    """Process-group backend with several processes: auto (NCCL on GPU, gloo on CPU), nccl
    or gloo."""
    timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before it fails: how long a job whose
    rank hung takes to stop. It must exceed the longest gap between two collectives (a
    checkpoint save, the first batch of a slow data loader)."""
    log_every: int = 10
    checkpoint_every: int | None = None
    """Optimizer steps between checkpoints; null: at the end of every epoch."""
    keep_checkpoints: int = 2
    max_nonfinite_steps: int = 5
    """Stop the run after this many non-finite losses in a row."""
    memory_check: bool = True
    """On GPUs: before building the model, plan the run (README, "Planning a run") and
    refuse it when the planned peak does not fit the GPU's memory; false skips the check."""
    progress: bool = True
    compile: bool = False
    """torch.compile the backbone (the head stays eager: its collectives and custom autograd
    functions gain nothing). The first step compiles (logged once); see the README for when
    it pays off."""
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "default"
    """torch.compile's mode with train.compile."""
    compile_backend: str = "inductor"
    """torch.compile's backend: inductor (the one that makes kernels), or aot_eager / eager to
    tell a compiler problem from a model problem (they trace but do not speed up)."""
    deterministic: bool = False
    """Reproducible kernels: torch.use_deterministic_algorithms, cuDNN deterministic and not
    benchmarking, CUBLAS_WORKSPACE_CONFIG=:4096:8. Costs GPU speed (cuDNN cannot pick its
    fastest convolutions; some backward ops take slower deterministic paths, and an op with
    no deterministic version stops the run naming it). On CPU it changes nothing measurable."""

    def __post_init__(self) -> None:
        counts = ("batch_size", "epochs", "max_steps", "accumulate_steps", "log_every")
        counts += ("checkpoint_every", "keep_checkpoints", "max_nonfinite_steps")
        check_counts("train", self, counts, nullable=("max_steps", "checkpoint_every"))
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device: {self.device!r} is not auto, cpu or cuda")
        if self.dist_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(
                f"train.dist_backend: {self.dist_backend!r} is not auto, nccl or gloo"
            )
        if self.dist_backend == "nccl" and self.device == "cpu":
            raise ConfigError("train.dist_backend: nccl needs train.device=cuda (or auto)")
        if not self.timeout_s > 0:
            raise ConfigError(f"train.timeout_s: must be positive, got {self.timeout_s}")
        if isinstance(self.resume, str) and not self.resume:
            raise ConfigError("train.resume: empty path (use true, false, auto or a path)")


@dataclass
class PrecisionConfig:
    level: Literal["O0", "O1", "O2", "O3"] = "O0"
    dtype: Literal["fp16", "bf16"] = "bf16"
    """The half type of O1-O3; O0 ignores it."""


@dataclass
class EvalTarget:
    """A verification set: an LFW-style pairs file (and its image folder) or an insightface
    ``.bin``. Exactly one of ``pairs`` and ``bin`` is set."""

    pairs: str | None = None
    """An LFW-format pairs file (View 2 ``pairs.txt`` or ``pairsDevTest.txt``)."""
    bin: str | None = None
    """An insightface ``.bin`` (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin``)."""
    images: str | None = None
    """Image root of ``pairs``; defaults to the folder holding the pairs file."""
    name: str | None = None
    """Label in tables and metric names; defaults to the pairs file's folder name, or the
    ``.bin`` file's stem."""
    crop: int | None = None
    """Centre square (pixels, of the original image) cut before resizing; e.g. LFW's
    250x250 photos hold the face in their centre."""

    def check(self, key: str) -> None:
        """Raise ConfigError (naming `key`, e.g. `eval.targets[0]`) for a bad combination."""
        if (self.pairs is None) == (self.bin is None):
            raise ConfigError(
                f"{key}.pairs: each target needs exactly one of `pairs` (an LFW pairs file) or "
                f"`bin` (an insightface .bin), got pairs={self.pairs!r} bin={self.bin!r}"
            )
        if self.bin is not None and self.images is not None:
            raise ConfigError(
                f"{key}.images: belongs to a pairs file; the .bin {self.bin} holds its own images"
            )
        if self.crop is not None and self.crop < 1:
            raise ConfigError(f"{key}.crop: must be a positive size, got {self.crop}")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ConfigError(
                f"{key}.name: {self.name!r} must be non-empty and hold no '/' (it becomes part "
                "of metric names such as lfw/accuracy)"
            )

    @property
    def label(self) -> str:
        """The name in tables and metric keys (``name``, else derived from the file)."""
        if self.name:
            return self.name
        if self.bin is not None:
            return Path(self.bin).stem
        return Path(self.pairs or ".").resolve().parent.name


EVAL_METRICS = ("accuracy", "auc", "eer", "xnorm")
"""Metrics `eval.best_metric` may name besides `tar@far=<FAR>`; only `eer` is better lower."""


@dataclass
class EvalConfig:
    targets: list[EvalTarget] = field(default_factory=list)
    at_end: bool = True
    """Evaluate every target once training ends and print the table."""
    every_steps: int | None = None
    """Also evaluate every target every this many optimizer steps (rank 0 evaluates while
    the other ranks wait at a barrier: an evaluation must take less than train.timeout_s);
    results go to metrics.jsonl and TensorBoard as eval/<target>/<metric>. null: never."""
    best_metric: str | None = None
    """`<target>/<metric>` (e.g. `lfw/accuracy`, `agedb_30/tar@far=1e-4`, `lfw/eer`): keep
    the backbone of the best periodic evaluation as best_backbone.pt (with best.json).
    Metrics: accuracy, auc, eer (lower is better), xnorm, tar@far=<FAR>."""
    batch_size: int = 128
    flip: bool = True
    """Sum the embeddings of each image and its mirror image."""
    image_size: int | list[int] | None = None
    """Input size for evaluation, one side or [H, W]; null: the training size
    (data.image_size)."""

    def __post_init__(self) -> None:
        for i, target in enumerate(self.targets):
            target.check(f"eval.targets[{i}]")
        labels = [t.label for t in self.targets]
        duplicates = sorted({x for x in labels if labels.count(x) > 1})
        if duplicates:
            raise ConfigError(
                f"eval.targets: two targets are called {duplicates[0]!r}; give them distinct "
                "`name`s"
            )
        check_counts("eval", self, ("every_steps", "batch_size"), nullable=("every_steps",))
        if self.image_size is not None:
            self.image_size = check_image_size(self.image_size, "eval.image_size")
        if self.best_metric is not None:
            target, _, metric = self.best_metric.partition("/")
            if target not in labels:
                raise ConfigError(
                    f"eval.best_metric: {self.best_metric!r} names target {target!r}, but the "
                    f"targets are {labels or 'none'} (expected <target>/<metric>"
                    + ("; without targets, set eval.best_metric=null)" if not labels else ")")
                )
            parse_metric(metric, "eval.best_metric")
            if self.every_steps is None:
                raise ConfigError(
                    "eval.best_metric: needs eval.every_steps (the best is chosen among the "
                    "periodic evaluations)"
                )


MIN_IMAGE_SIDE = 16


def check_counts(
    section: str, config: Any, names: Sequence[str], nullable: Sequence[str] = ()
) -> None:
    """Raise a ConfigError naming `section.<name>` for the first of the fields `names` of
    `config` below 1; the `nullable` ones may also be null."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            or_null = " (or null)" if name in nullable else ""
            raise ConfigError(f"{section}.{name}: must be at least 1{or_null}")


def image_size_pair(image_size: int | Sequence[int]) -> tuple[int, int]:
    """`image_size` (an int, or (H, W)) as a (H, W) tuple of positive ints."""
    if isinstance(image_size, int):
        size: tuple = (image_size, image_size)
    elif isinstance(image_size, Sequence):
        size = tuple(image_size)
    else:
        size = ()
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ValueError(f"image_size must be a positive int or (H, W), got {image_size!r}")
    return size  # type: ignore[return-value]


def check_image_size(value: Any, key: str) -> int | list[int]:
    """`value` checked as an input size: one side (an int) or [H, W] (a list, a tuple
    becomes a list so that the saved config.yaml stays plain YAML).

    Raises ConfigError naming `key` for anything else or a side under MIN_IMAGE_SIDE.
    """
    if isinstance(value, (list, tuple)):
        sides = list(value)
        if len(sides) != 2 or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sides
        ):
            raise ConfigError(
                f"{key}: expected one side or [height, width] (two integers), got {value!r}"
            )
    elif isinstance(value, int) and not isinstance(value, bool):
        sides = [value]
    else:
        raise ConfigError(f"{key}: expected one side or [height, width], got {value!r}")
    if min(sides) < MIN_IMAGE_SIDE:
        raise ConfigError(f"{key}: {value!r} is too small (at least {MIN_IMAGE_SIDE} a side)")
    return sides if isinstance(value, (list, tuple)) else value


def parse_image_size(text: str, key: str) -> int | tuple[int, int]:
    """A command-line input size, `N` or `HxW` (e.g. `256x128`), as an int or (H, W).

    Raises ConfigError naming `key` (the option) for anything else.
    """
    parts = text.lower().split("x")
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2):
        raise ConfigError(f"{key}: expected N or HxW (e.g. 112 or 256x128), got {text!r}")
    size = check_image_size(sides[0] if len(sides) == 1 else sides, key)
    return size if isinstance(size, int) else (size[0], size[1])


def parse_metric(metric: str, key: str) -> tuple[str, float | None]:
    """(name, FAR or None) of a metric spelled `accuracy`, `eer`, ... or `tar@far=1e-3`.

    Raises ConfigError naming `key` for anything else.
    """
    if metric in EVAL_METRICS:
        return metric, None
    prefix = "tar@far="
    if metric.startswith(prefix):
        try:
            far = float(metric[len(prefix) :])
        except ValueError:
            far = float("nan")
        if 0.0 < far < 1.0:
            return "tar_at_far", far
    raise ConfigError(
        f"{key}: unknown metric {metric!r}; use one of {', '.join(EVAL_METRICS)} or "
        "tar@far=<FAR> (e.g. tar@far=1e-3)"
    )


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    output_dir: str | None = None
    """Run directory; null means runs/<name>."""
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.head.fused_update:
            check_fused_update(self)
        if self.model.pipeline_stages > 1:
            check_pipeline(self)
        late = [e for e in self.optim.milestones if e >= self.train.epochs]
        if late:
            raise ConfigError(
                f"optim.milestones: epoch {late[0]:g} is not before train.epochs="
                f"{self.train.epochs}, so it would never apply"
            )
        if self.data.decode == "gpu" and self.train.device == "cpu":
            raise ConfigError(
                "data.decode: gpu decodes on a CUDA device, but train.device=cpu trains on the "
                "CPU; use data.decode=cpu (or auto)"
            )

    @property
    def micro_batches(self) -> int:
        """Pipeline micro-batches per batch (1 without a pipeline)."""
        model = self.model
        if model.pipeline_stages == 1:
            return 1
        if model.micro_batch_size is None:
            return 2 * model.pipeline_stages
        return self.train.batch_size // model.micro_batch_size

    @property
    def eval_image_hw(self) -> tuple[int, int]:
        """The evaluation input size as (H, W): eval.image_size, else data.image_size."""
        return image_size_pair(self.eval.image_size or self.data.image_size)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir if self.output_dir else Path("runs") / self.name)


def check_fused_update(cfg: ExperimentConfig) -> None:
    """Refuse what head.fused_update cannot honour, naming both keys."""
    conflicts = []
    if cfg.head.kernel != "triton":
        conflicts.append(
            f"head.kernel={cfg.head.kernel} (the update runs in the Triton backward: set "
            "head.kernel=triton)"
        )
    if cfg.optim.name != "sgd":
        conflicts.append(f"optim.name={cfg.optim.name} (the fused update is SGD's)")
    if cfg.optim.grad_clip is not None:
        conflicts.append(
            f"optim.grad_clip={cfg.optim.grad_clip} (the head's rows are stepped before the "
            "gradient norm is known: set optim.grad_clip=null)"
        )
    if cfg.train.accumulate_steps != 1:
        conflicts.append(
            f"train.accumulate_steps={cfg.train.accumulate_steps} (every backward steps the "
            "head's rows)"
        )
    if cfg.precision.level in ("O2", "O3"):
        conflicts.append(
            f"precision.level={cfg.precision.level} (the fused update steps a float32 weight: "
            "use O0 or O1)"
        )
    elif cfg.precision.level == "O1" and cfg.precision.dtype == "fp16":
        conflicts.append(
            "precision.dtype=fp16 with precision.level=O1 (loss scaling would scale the "
            "rows' step: use bf16)"
        )
    if conflicts:
        raise ConfigError("head.fused_update=true cannot be combined with " + "; ".join(conflicts))


def check_pipeline(cfg: ExperimentConfig) -> None:
    """Refuse what a pipelined backbone (model.pipeline_stages > 1) cannot honour."""
    model, stages, batch = cfg.model, cfg.model.pipeline_stages, cfg.train.batch_size
    if model.micro_batch_size is None:
        if batch % (2 * stages):
            raise ConfigError(
                f"model.micro_batch_size: null splits train.batch_size={batch} into "
                f"{2 * stages} micro-batches (2 x model.pipeline_stages), which does not "
                "divide it; set model.micro_batch_size to a divisor of train.batch_size"
            )
    elif batch % model.micro_batch_size:
        raise ConfigError(
            f"model.micro_batch_size={model.micro_batch_size} does not divide "
            f"train.batch_size={batch}"
        )
    if batch // cfg.micro_batches < 2:
        raise ConfigError(
            f"model.micro_batch_size: micro-batches of {batch // cfg.micro_batches} sample "
            f"(train.batch_size={batch} in {cfg.micro_batches}) cannot train: BatchNorm "
            "needs at least 2 samples; set model.micro_batch_size >= 2 (or raise "
            "train.batch_size)"
        )
    if model.pipeline_schedule == "1f1b" and cfg.micro_batches < stages:
        raise ConfigError(
            f"model.pipeline_schedule=1f1b needs at least model.pipeline_stages={stages} "
            f"micro-batches, train.batch_size={batch} / model.micro_batch_size="
            f"{model.micro_batch_size} gives {cfg.micro_batches} (use gpipe, or smaller "
            "micro-batches)"
        )
    conflicts = []
    if cfg.train.accumulate_steps != 1:
        conflicts.append(
            f"train.accumulate_steps={cfg.train.accumulate_steps} (the pipeline's micro-batches "
            "already accumulate gradients: raise train.batch_size instead)"
        )
    if cfg.train.compile:
        conflicts.append("train.compile=true (the stages run eager)")
    if cfg.head.fused_update:
        conflicts.append(
            "head.fused_update=true (every micro-batch's backward would step the head)"
        )
    if conflicts:
        raise ConfigError(
            f"model.pipeline_stages={stages} cannot be combined with " + "; ".join(conflicts)
        )


# --------------------------------------------------------------------------- loading


def resolve_config_path(name_or_path: str) -> Path:
    """A bare name resolves to configs/NAME.yaml; anything else is a path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists() or len(path.parts) > 1:
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        return path
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(
            f"--config: no config named {name_or_path!r} in {CONFIG_DIR} "
            f"(known: {', '.join(known) or 'none'})"
        )
    return candidate


def load_config(
    name_or_path: str = "default", overrides: list[str] | None = None
) -> ExperimentConfig:
    """Load a config file (with its `base:` chain), apply dotted overrides, validate."""
    path = resolve_config_path(name_or_path)
    raw = _read_with_bases(path, seen=())
    raw.setdefault("name", path.stem)
    for item in overrides or []:
        _apply_override(raw, item)
    _followers_follow(raw, overrides or [])
    return config_from_dict(raw)


# (section, key, value, follower): that value set on the command line makes the config
# file's `follower` of the same section meaningless, so it becomes null, unless the command
# line sets it too (then a conflict is an error that names the override to add).
FOLLOWERS = (
    ("eval", "targets", [], "best_metric"),  # it names one of the targets just removed
    ("data", "num_workers", 0, "prefetch_factor"),  # batches each worker loads ahead
)


def _followers_follow(raw: dict[str, Any], overrides: list[str]) -> None:
    """Set to null the file's followers (`FOLLOWERS`) of what the command line set."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    for section_name, key, value, follower in FOLLOWERS:
        section = raw.get(section_name)
        if f"{section_name}.{key}" not in keys or f"{section_name}.{follower}" in keys:
            continue
        if isinstance(section, dict) and section.get(key) == value:
            if section.get(follower) is not None:
                section[follower] = None


def config_from_dict(raw: dict[str, Any]) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from a plain mapping."""
    return _build(ExperimentConfig, raw, prefix="")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: ExperimentConfig, path: Path) -> None:
    """Write the resolved config as YAML (a file `load_config` reads back unchanged)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save the config as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _read_with_bases(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: `base:` chain loops back to itself")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: must be a file name")
    base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
    if base_path.suffix == "":
        base_path = base_path.with_suffix(".yaml")
    if not base_path.is_file():
        raise ConfigError(f"{path}: base: no such file {str(base_path)!r}")
    return _deep_merge(_read_with_bases(base_path, seen + (path,)), data)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. optim.lr=0.05)")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {text!r}: {exc}") from exc
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"{key}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(
            f"{key}: unknown config key (known in {where}: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name in raw:
        kwargs[name] = _convert(raw[name], hints[name], prefix + name)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix + missing[0]}: required key is missing")
    return cls(**kwargs)


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None:
        raise ConfigError(f"{key}: must not be null (expected {_type_name(tp)})")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept it as the number it means.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{key}: unsupported annotation {tp!r}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
