"""`Precision`: one precision level applied to a run's modules and optimizer.

It puts together the pieces beside it: the level's meaning (`levels`), the casts
(`casting`), the O2 fp32 masters (`masters`), the fp16 loss scaler (`scaling`) and the
update masked on the device (`update`).

Order of calls: move the modules to the device, `prepare(*modules)`, wrap in DDP, build the
optimizer from `param_groups(groups)`; per step `with autocast():` forward on
`cast_inputs(x)`, `backward(loss)` (k times for accumulation), `step(optimizer)`,
`zero_grad(optimizer)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from recognition.precision import casting
from recognition.precision.levels import Level
from recognition.precision.masters import MasterWeights
from recognition.precision.scaling import check_scaler_settings, make_scaler, updated_scale
from recognition.precision.update import MaskedUpdate, StepResult, total_grad_norm


class Precision:
    """One precision level: casts the model, owns the fp32 masters and the loss scaler.

    Args:
        level: "O0", "O1", "O2" or "O3" (see `recognition.precision.levels`).
        dtype: "fp16" or "bf16", the half dtype of levels O1-O3 (ignored by O0).
        device: the device the model runs on; picks the autocast and GradScaler backend.
        init_scale: first fp16 loss scale.
        growth_interval: good steps before the fp16 loss scale doubles.
        process_group: with several ranks whose optimizers see different gradients (a
            sharded head), the group over which the fp16 scaler's inf/NaN check is combined
            (torch's ShardedGradScaler), so every rank skips the same steps and keeps the
            same loss scale; None for one process.
    """

    def __init__(
        self,
        level: str,
        dtype: str,
        device: torch.device,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        process_group: ProcessGroup | None = None,
    ) -> None:
        self._level = Level.of(level, dtype)
        check_scaler_settings(init_scale, growth_interval)
        device = torch.device(device)
        self._level.check_device(device)
        self.level = level
        self.dtype = dtype
        self.device = device
        self.half_dtype = self._level.half_dtype
        self.compute_dtype = self._level.compute_dtype
        self.scaler = make_scaler(self._level, device, init_scale, growth_interval, process_group)
        self._weights = MasterWeights(keep_masters=self._level.keeps_masters)
        self._update = MaskedUpdate()
        self._unit_scale = torch.ones((), dtype=torch.float32, device=device)
        # Off while a CUDA graph captures the step (training/graphed.py), as torch asks: a
        # weight cast at each use rather than once per forward, the same values.
        self.autocast_cache = True

    def prepare(self, *modules: nn.Module) -> None:
        """Cast `modules` in place for this level and (O2) make the fp32 master copies.

        Call after moving the modules to `device` and before wrapping them in DDP and building
        the optimizer. May be called more than once; each module gets the next index in the
        keys of `state_dict()["masters"]`. O0 and O1 leave the modules untouched.
        """
        _check_bare_modules(modules)
        for module in modules:
            _check_on_device(module, self.device)
            fp32 = self._weights.fp32_values(module)  # taken before the cast, for O2's masters
            casting.cast_module(module, self._level)
            self._weights.add(module, fp32)

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """Map optimizer groups onto the parameters the optimizer must own.

        Takes groups as `torch.optim` does (`{"params": [...], "lr": ..., ...}`) holding the
        model's parameters, and returns new groups with every key kept and "params" replaced
        by the fp32 masters under O2 (unchanged at other levels).
        """
        return self._weights.param_groups(groups)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in: autocast for O1/O2, a no-op for O0/O3."""
        return casting.autocast(self._level, self.device, cache=self.autocast_cache)

    def cast_inputs(self, x: Tensor) -> Tensor:
        """`x` in the half dtype under O2/O3 (floating tensors only); unchanged otherwise."""
        return casting.cast_inputs(x, self._level)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """`loss` multiplied by the loss scale when fp16 scaling is on, else `loss` itself:
        what to backpropagate when something else (a pipeline schedule) calls backward."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: Tensor) -> None:
        """Backpropagate `loss`, multiplied by the loss scale when fp16 scaling is on.

        For gradient accumulation call it once per micro-batch with the loss divided by the
        number of micro-batches; gradients add up in the model's `.grad`.
        """
        self.scale_loss(loss).backward()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float | None = None,
        grad_norm_fn: Callable[[list[Tensor]], Tensor] | None = None,
        *,
        finite: Tensor | None = None,
    ) -> StepResult:
        """Unscale, clip, and apply the accumulated gradients; skip on inf/NaN, on the device.

        Under O2 the half gradients are first copied into the fp32 masters, and after the
        update the masters are copied back into the half model. `max_grad_norm` clips the
        total L2 norm of the unscaled gradients the optimizer sees. `grad_norm_fn` computes
        that norm (a 0-dim tensor) from the optimizer's parameters (their `.grad`); the
        default is the local norm, and a model whose gradients are sharded over ranks passes
        one that combines the ranks' parts, so that every rank clips and skips alike.
        `finite` (a 0-dim bool tensor, the same on every rank) is whether the loss was finite:
        False skips the update too. Nothing is read on the host when the optimizer is fused
        (see `recognition.precision.update`). Gradients are left in place;
        call `zero_grad()` next.
        """
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self._weights.check_optimizer(optimizer)
        if self._level.keeps_masters:
            self._weights.grads_to_masters()
        if self.scaler is not None:
            # Divides the grads the optimizer owns by the scale and records, on the device,
            # whether any is inf/NaN (updated_scale() below backs the scale off on it).
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if grad_norm_fn is None:
            grad_norm = total_grad_norm(params, self.device)
        else:
            grad_norm = grad_norm_fn(params)
        ok = torch.isfinite(grad_norm)
        if finite is not None:
            ok = ok & finite.to(ok.device)
        if max_grad_norm is not None:
            # A norm that is not finite turns the gradients into NaN here; the update that
            # would apply them is skipped. The norm goes in as float32, as it always has.
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm.to(torch.float32))
        self._update.apply(optimizer, ok)
        scale = self._unit_scale if self.scaler is None else updated_scale(self.scaler)
        if self._level.keeps_masters:
            # After a skipped update the masters hold what the model already holds.
            self._weights.masters_to_model()
        return StepResult(stepped=ok, grad_norm=grad_norm, scale=scale)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients of the optimizer's parameters and of the prepared model."""
        optimizer.zero_grad(set_to_none=True)
        self._weights.zero_model_grads()

    def state_dict(self) -> dict:
        """The loss scaler's state and (O2) the fp32 masters, keyed "<module>.<name>".

        The optimizer's state_dict holds no parameter values and the half model alone would
        lose the low bits of every weight, so a resume needs the masters from here. Masters
        are live detached views (a checkpoint loads into them in place); the master of a
        row-sharded parameter carries its rows (see `recognition.sharded`).
        """
        return {
            "level": self.level,
            "dtype": self.dtype,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "masters": self._weights.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict()` returned; call after `prepare()`.

        The scaler state is loaded when both sides use a scaler (a run resumed from bf16 into
        fp16 starts from `init_scale`). Under O2 the masters must match the prepared modules
        key for key; they are copied into the masters in place and then into the model.
        """
        if "scaler" not in state:
            raise ValueError("Precision.load_state_dict: state has no 'scaler' entry")
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        if self._level.keeps_masters:
            self._weights.load_state_dict(state.get("masters", {}), state.get("level"))

    def fp32_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """`module.state_dict()` in fp32, with the O2 masters' values in place of half weights.

        Gives a checkpoint or an export that does not depend on the precision level (a half
        weight cast back to fp32 would have lost its low bits; the master has them). Works on
        a prepared module or any module holding prepared ones.
        """
        return self._weights.fp32_state_dict(module)

    def load_fp32_state_dict(self, module: nn.Module, state: dict[str, Tensor]) -> None:
        """Load an fp32 state dict (as `fp32_state_dict` writes) into `module` and its masters.

        The module's half weights get the rounded values and the O2 masters the exact ones.
        Keys must match `module.state_dict()` exactly.
        """
        self._weights.load_fp32_state_dict(module, state)

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer steps for the prepared `param`: its O2 master, or itself."""
        return self._weights.optimizer_param(param)

    def masters(self) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
        """(key, model parameter, fp32 master) for each prepared parameter under O2.

        Keys are "<module index>.<parameter name>", the index counting the modules in the
        order prepare() received them. An fp32 parameter (BatchNorm) is its own master.
        """
        return self._weights.items()


def _check_bare_modules(modules: tuple[nn.Module, ...]) -> None:
    for module in modules:
        if isinstance(module, DistributedDataParallel):
            raise ValueError(
                "Precision.prepare: got a DistributedDataParallel module; prepare the bare "
                "module before wrapping it, since casting changes DDP's gradient buckets"
            )
        if not isinstance(module, nn.Module):
            raise ValueError(f"Precision.prepare: expected nn.Module, got {type(module)}")


def _check_on_device(module: nn.Module, device: torch.device) -> None:
    for name, param in module.named_parameters():
        if param.device.type != device.type:
            raise ValueError(
                f"Precision.prepare: parameter {name!r} is on {param.device}, expected "
                f"{device}; move the module to the device before prepare()"
            )
