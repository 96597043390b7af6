"""The prepared parameters and, under O2, the fp32 master weights that stand for them.

O2 accumulates gradients in the half model's `.grad` (which is where DDP all-reduces them)
and copies them into the fp32 masters' `.grad` once per step; the optimizer steps the
masters, whose values are then copied back into the half model. The fp32 parameters of O2
(BatchNorm) are their own masters: no copy is made for them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from recognition.sharded import copy_placement, mark_like


class MasterWeights:
    """Every distinct parameter of the prepared modules under a "<module index>.<parameter
    name>" key and, when `keep_masters` (O2), the fp32 master that the optimizer steps in its
    place. Tied weights get one entry: the first name wins."""

    def __init__(self, keep_masters: bool) -> None:
        self.keep_masters = keep_masters
        self.params: dict[str, nn.Parameter] = {}
        self._masters: dict[str, nn.Parameter] = {}
        self._num_modules = 0
        self._checked_optimizers: set[int] = set()

    def add(self, module: nn.Module, fp32: dict[int, Tensor] | None = None) -> None:
        """Record `module`'s parameters (already cast) under the next module index.

        `fp32`: by id of the parameter, its fp32 value before the cast, which its master
        takes (exact); a parameter without one gets the fp32 copy of its half value."""
        index = self._num_modules
        self._num_modules += 1
        seen = {id(p) for p in self.params.values()}
        for name, param in module.named_parameters():
            if id(param) in seen:  # tied weights: one master, first name wins
                continue
            seen.add(id(param))
            key = f"{index}.{name}"
            self.params[key] = param
            if self.keep_masters:
                self._masters[key] = _make_master(param, (fp32 or {}).get(id(param)))

    def fp32_values(self, module: nn.Module) -> dict[int, Tensor]:
        """Before the cast, by id of the parameter: the fp32 values `add` gives the masters
        (O2; empty otherwise). The masters keep what the module holds now (a loaded
        backbone's weights, train.init_backbone), not their half rounding: each takes over
        its parameter's fp32 storage, which the cast leaves behind (no copy is made)."""
        if not self.keep_masters:
            return {}
        return {id(p): p.detach() for p in module.parameters() if p.dtype == torch.float32}

    def items(self) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
        """(key, model parameter, fp32 master) for each prepared parameter under O2."""
        for key, master in self._masters.items():
            yield key, self.params[key], master

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer steps for the prepared `param`: its O2 master, or itself."""
        for key, model_param in self.params.items():
            if model_param is param:
                return self._masters.get(key, param)
        raise ValueError("Precision.optimizer_param: the parameter was not prepared")

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """`groups` with every key kept and "params" replaced by the masters under O2."""
        master_of = {id(self.params[key]): master for key, master in self._masters.items()}
        mapped = []
        for group_index, group in enumerate(groups):
            if "params" not in group:
                raise ValueError(f"Precision.param_groups: group {group_index} has no 'params'")
            params = group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            if self.keep_masters:
                unknown = [i for i, p in enumerate(params) if id(p) not in master_of]
                if unknown:
                    raise ValueError(
                        f"Precision.param_groups: group {group_index} holds parameters (indices "
                        f"{unknown[:5]}) of no module given to prepare(); O2 needs their masters"
                    )
                params = [master_of[id(p)] for p in params]
            mapped.append({**group, "params": params})
        return mapped

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Once per optimizer: under O2 an optimizer built on the half model parameters would
        # step them directly and the masters would silently overwrite the result.
        if not self.keep_masters or id(optimizer) in self._checked_optimizers:
            return
        model_ids = {id(p) for _, p, m in self.items() if m is not p}
        for group in optimizer.param_groups:
            if any(id(p) in model_ids for p in group["params"]):
                raise ValueError(
                    "Precision.step: the optimizer owns half model parameters; under O2 build it "
                    "from precision.param_groups(groups)"
                )
        self._checked_optimizers.add(id(optimizer))

    # ---------------------------------------------------------------- the step

    def grads_to_masters(self) -> None:
        """The half gradients into the masters' `.grad`, in fp32, by one multi-tensor copy (one
        kernel on a GPU, not one per parameter; `benchmarks/step_ops.py` counts the
        operations). A master without a gradient gets an empty one first (an allocation, no
        kernel: `torch._foreach_copy`'s functional form would clone the masters, a kernel
        each)."""
        masters, grads = [], []
        for _, param, master in self.items():
            if master is param:
                continue
            if param.grad is None:
                master.grad = None  # unused this step: the optimizer skips it
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master, memory_format=torch.preserve_format)
            masters.append(master.grad)
            grads.append(param.grad)
        if masters:
            torch._foreach_copy_(masters, grads)

    def masters_to_model(self) -> None:
        """The masters' values into the half model, rounded: one multi-tensor copy."""
        pairs = [(param, master) for _, param, master in self.items() if master is not param]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def zero_model_grads(self) -> None:
        for param in self.params.values():
            param.grad = None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Tensor]:
        """The masters by key, as live detached views; a row-sharded one carries its rows."""
        return {key: mark_like(master, self.params[key]) for key, master in self._masters.items()}

    def load_state_dict(self, saved: dict[str, Tensor], saved_level: object) -> None:
        """Copy `saved` (key for key, as `state_dict` gives) into the masters, then into the
        model; `saved_level` names the level they were saved at, for the error message."""
        if not saved:
            raise ValueError(
                f"Precision.load_state_dict: state saved at level {saved_level} holds no "
                "fp32 master weights, which O2 needs"
            )
        missing = sorted(set(self._masters) - set(saved))
        unexpected = sorted(set(saved) - set(self._masters))
        if missing or unexpected:
            raise ValueError(
                f"Precision.load_state_dict: master keys differ; missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        with torch.no_grad():
            for key, master in self._masters.items():
                value = saved[key]
                if value.shape != master.shape:
                    raise ValueError(
                        f"Precision.load_state_dict: master {key!r} has shape "
                        f"{tuple(value.shape)}, expected {tuple(master.shape)}"
                    )
                if value is not master:
                    master.copy_(value)
        self.masters_to_model()

    def fp32_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """`module.state_dict()` in fp32, with the masters' values in place of half weights."""
        master_of = self._master_of()
        state = module.state_dict()
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in master_of:
                state[name] = master_of[id(param)].detach().clone()
        return {
            name: value.float() if value.is_floating_point() else value
            for name, value in state.items()
        }

    def load_fp32_state_dict(self, module: nn.Module, state: dict[str, Tensor]) -> None:
        """Load an fp32 state dict into `module` (rounded) and its masters (exact)."""
        module.load_state_dict(state, strict=True)
        master_of = self._master_of()
        with torch.no_grad():
            for name, param in module.named_parameters(remove_duplicate=False):
                master = master_of.get(id(param))
                if master is not None and master is not param:
                    master.copy_(state[name])

    def _master_of(self) -> dict[int, nn.Parameter]:
        return {id(param): master for _, param, master in self.items()}


def _make_master(param: nn.Parameter, fp32: Tensor | None = None) -> nn.Parameter:
    """The fp32 parameter the optimizer steps in place of `param` (itself if already fp32):
    `fp32` (its value before the cast) when given, else a copy of its half value."""
    if param.dtype == torch.float32:
        return param
    if fp32 is not None and fp32.shape == param.shape:
        master = nn.Parameter(fp32, requires_grad=param.requires_grad)
    else:
        master = nn.Parameter(
            param.detach().to(torch.float32).clone(), requires_grad=param.requires_grad
        )
    copy_placement(master, param)  # a master of sharded rows is sharded alike
    return master


def master_weights(state: dict, module_index: int) -> dict[str, Tensor]:
    """From a saved `Precision.state_dict()`: the fp32 masters of the `module_index`-th
    prepared module, by parameter name (empty below O2)."""
    prefix = f"{module_index}."
    return {
        key.removeprefix(prefix): value
        for key, value in (state.get("masters") or {}).items()
        if key.startswith(prefix)
    }
