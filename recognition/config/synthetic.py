"""The built-in synthetic data set's spec (`SyntheticSpec`: what to generate, which
`recognition.data.synthetic` takes) and its config section (`data.synthetic`: the spec, and
whether and where to generate it on first use)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from recognition.config.values import ConfigError

# Bumped whenever the drawing code (recognition.data.synthetic) changes, so that a data set
# drawn by an older version is regenerated rather than silently mixed with a new one.
GENERATOR_VERSION = 1


@dataclass
class SyntheticSpec:
    """What to generate. The defaults are the built-in default run's data set."""

    num_identities: int = 1000
    """Training identities (class folders under `train/`)."""
    images_per_identity: int = 16
    """Images per training identity."""
    num_val_identities: int = 200
    """Held-out identities under `val/`, disjoint from the training ones."""
    val_images_per_identity: int = 10
    """Images per held-out identity."""
    num_folds: int = 10
    """Folds of the verification pairs; each fold uses its own held-out identities."""
    pairs_per_fold: int = 150
    """Same-identity pairs per fold, and as many different-identity pairs."""
    image_size: int = 112
    """Side of the square images, in pixels."""
    seed: int = 0
    """Seed of everything; the same spec always gives byte-identical files."""

    @classmethod
    def training_set(
        cls, num_identities: int, images_per_identity: int, image_size: int = 112
    ) -> SyntheticSpec:
        """A spec for training images alone: the smallest held-out part the layout needs (2
        identities of 2 images, one fold of one pair each way)."""
        return cls(
            num_identities=num_identities,
            images_per_identity=images_per_identity,
            num_val_identities=2,
            val_images_per_identity=2,
            num_folds=1,
            pairs_per_fold=1,
            image_size=image_size,
        )

    def __post_init__(self) -> None:
        for name in (
            "num_identities",
            "images_per_identity",
            "num_val_identities",
            "val_images_per_identity",
            "num_folds",
            "pairs_per_fold",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SyntheticSpec.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.image_size, int) or self.image_size < 16:
            raise ValueError(
                f"SyntheticSpec.image_size must be an integer >= 16, got {self.image_size!r}"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(
                f"SyntheticSpec.seed must be a non-negative integer, got {self.seed!r}"
            )
        if self.val_images_per_identity < 2:
            raise ValueError(
                "SyntheticSpec.val_images_per_identity must be >= 2 to form same-identity "
                f"pairs, got {self.val_images_per_identity}"
            )
        # Folds are identity-disjoint (as in LFW View 2), and a different-identity pair needs
        # two identities inside one fold.
        if self.num_val_identities < 2 * self.num_folds:
            raise ValueError(
                f"SyntheticSpec.num_val_identities ({self.num_val_identities}) must be at least "
                f"2 * num_folds ({2 * self.num_folds}): each fold needs its own two identities"
            )
        smallest_fold = self.num_val_identities // self.num_folds
        num_images = self.val_images_per_identity
        max_same = smallest_fold * num_images * (num_images - 1) // 2
        max_different = smallest_fold * (smallest_fold - 1) // 2 * num_images * num_images
        if self.pairs_per_fold > min(max_same, max_different):
            raise ValueError(
                f"SyntheticSpec.pairs_per_fold ({self.pairs_per_fold}) exceeds the "
                f"{min(max_same, max_different)} distinct pairs that the smallest fold "
                f"({smallest_fold} identities x {num_images} images) can form; raise "
                "num_val_identities or val_images_per_identity, or lower pairs_per_fold"
            )

    def to_json(self) -> dict[str, int]:
        """The spec and the generator version as a JSON-ready dict (the `.complete` marker)."""
        return {"generator_version": GENERATOR_VERSION, **dataclasses.asdict(self)}


@dataclass
class SyntheticConfig(SyntheticSpec):
    """The built-in synthetic dataset (`data.synthetic`): the generator's `SyntheticSpec`
    fields, and whether and where to generate it on first use."""

    enabled: bool = True
    """Generate the set under `root` on first use, when the run reads it (data.root or an
    evaluation target lies in `root`); never for a run on other data."""
    root: str = "data/synthetic"
    """Where the set lives: root/train (identity folders), root/val with its pairs.txt."""

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
