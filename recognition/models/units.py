"""Backbones as chains of units: the places where a pipeline may cut them.

Every backbone of `BACKBONES` but the ViTs is a `UnitChain`: a fixed sequence of units (the
stem, each residual block, the embedding layer), each a function of the previous unit's output only,
whose composition is the backbone's forward. `keep_units(first, stop)` turns a backbone
into one pipeline stage in place: the modules of the other units are removed, the kept ones
stay where they were, so a stage's parameters and buffers have exactly the names they have
in the whole backbone (`layer3.4.conv1.weight`), which is what lets a checkpoint saved by
one layout of stages load into another (see `recognition.pipeline`).
"""

from __future__ import annotations

import torch
from torch import nn

from recognition.models.batch_norm import advance_batch_counts, counted_layers


class UnitChain(nn.Module):
    """A module whose forward applies `units()` in order, each through `forward_unit`.

    Subclasses set `unit_names` (in forward order) when they are built, and define
    `unit_modules(unit)` (the submodule paths that unit owns, for pruning) and
    `forward_unit(unit, x)`.
    """

    unit_names: tuple[str, ...] = ()
    _kept: tuple[int, int] | None = None

    def units(self) -> tuple[str, ...]:
        """Every unit of the whole backbone, in forward order (also after `keep_units`)."""
        return self.unit_names

    def unit_modules(self, unit: str) -> tuple[str, ...]:
        raise NotImplementedError

    def forward_unit(self, unit: str, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self) -> list[nn.Module]:
        """The modules of this module's units between the stem and the embedding (each one
        module: a residual, bottleneck or depthwise block), in forward order: what
        train.compile_scope=blocks compiles one by one."""
        found = []
        for unit in self.kept_units:
            paths = self.unit_modules(unit)
            if unit not in ("stem", "embedding") and len(paths) == 1:
                found.append(self.get_submodule(paths[0]))
        return found

    @property
    def kept_units(self) -> tuple[str, ...]:
        """The units this module runs: all of them, or a stage's after `keep_units`."""
        units = self.units()
        if self._kept is None:
            return units
        return units[self._kept[0] : self._kept[1]]

    @property
    def is_first_stage(self) -> bool:
        return self._kept is None or self._kept[0] == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            # One operation advances every BatchNorm's batch counter (models/batch_norm.py).
            advance_batch_counts(self._counted_layers())
        for unit in self.kept_units:
            x = self.forward_unit(unit, x)
        return x

    def _counted_layers(self) -> tuple[nn.Module, ...]:
        # Found once: the layers stay while the module trains (keep_units and train(),
        # after which a layer may have been replaced, find them again).
        layers = self.__dict__.get("_batch_counted")
        if layers is None:
            layers = self.__dict__["_batch_counted"] = counted_layers(self)
        return layers

    def train(self, mode: bool = True) -> UnitChain:
        self.__dict__.pop("_batch_counted", None)
        return super().train(mode)

    def keep_units(self, first: int, stop: int) -> None:
        """Keep units [first, stop) only: remove every other unit's modules, in place.

        Afterwards `forward` maps the output of unit first - 1 (or the images, when first
        is 0) to the output of unit stop - 1. Can be called once.
        """
        units = self.units()
        if self._kept is not None:
            raise ValueError("keep_units: this module is already a pipeline stage")
        if not 0 <= first < stop <= len(units):
            raise ValueError(f"keep_units: [{first}, {stop}) is not a range of {len(units)} units")
        for unit in units[:first] + units[stop:]:
            for path in self.unit_modules(unit):
                parent_path, _, name = path.rpartition(".")
                parent = self.get_submodule(parent_path) if parent_path else self
                # Deleting from _modules keeps the other children under their names
                # (layer1.2 stays "2" when "0" and "1" go), unlike del on a Sequential.
                del parent._modules[name]
        self._kept = (first, stop)
        self.__dict__.pop("_batch_counted", None)
