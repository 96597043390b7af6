"""Apex-style precision levels O0-O3 on top of `torch.amp`.

| level | model weights        | forward                  | optimizer owns     | fp16 scaling |
|-------|----------------------|--------------------------|--------------------|--------------|
| O0    | fp32                 | fp32, no autocast        | the model params   | no           |
| O1    | fp32                 | `torch.autocast(half)`   | the model params   | GradScaler   |
| O2    | half, BatchNorm fp32 | half inputs + autocast   | fp32 master copies | GradScaler   |
| O3    | half, BatchNorm too  | half inputs, no autocast | the model params   | no (1.0)     |

"half" is fp16 or bf16; bf16 has fp32's exponent range, so it never needs a loss scaler.

Choices made here and why:
- O2 keeps only BatchNorm (every `_BatchNorm`: 1d/2d/3d, SyncBatchNorm) in fp32, as apex's
  `keep_batchnorm_fp32` does. BN's running variance and its batch statistics are what lose
  most in half; `batch_norm` accepts a half input with fp32 weights on CPU and CUDA and returns
  the input's dtype, so no cast is needed around it. PReLU goes half like every other layer:
  autocast runs `prelu` in half anyway, and its fp32 master keeps the precise slope.
- A module may name buffers that keep their dtype at every level in a `keep_dtype_buffers`
  attribute (a tuple of names): running statistics moved by small steps, which half
  precision would round away (AdaFace's running norm statistics, heads/margins.py).
- O2 also turns autocast on. With half weights it changes nothing for convs and matmuls, but
  it makes mixed-dtype ops legal (an fp32 tensor the code creates meeting a half activation in
  a matmul) and runs the ops autocast lists as fp32 (softmax, log-softmax, losses, norms) in
  fp32, as O1 does. O3 leaves autocast off: it is the pure-half speed baseline.
- O2 accumulates gradients in the half model's `.grad` (which is where DDP all-reduces them)
  and copies them into the fp32 masters' `.grad` once, in `step()`. The fp32 parameters of O2
  (BatchNorm) are their own masters: no copy is made for them.
- `step()` skips the update at every level when the gradient norm (or the loss, when the
  caller passes its finiteness) is not finite, so NaNs never reach the weights; with a scaler
  the scale also halves. The skip is decided on the device, without a host read: a fused
  optimizer (`torch.optim.SGD`/`AdamW` with `fused=True`, as `recognition.optim` builds them)
  is handed the flag as its `found_inf` and leaves every parameter and every state tensor
  (momentum, Adam's moments and step count) as it was; fused SGD gets zero momentum buffers
  before its first step, since on a skipped first step it would keep uninitialised ones. The
  caller sees the flag in `StepResult.stepped`, a device tensor. Another optimizer is stepped
  or not by a host read of the flag: one sync per step.
- fp16 loss scaling goes through GradScaler's `unscale_` and `update` only (neither syncs on
  a GPU); the update is the optimizer's own, masked as above, instead of `GradScaler.step`,
  which reads found-inf on the host unless the optimizer is fused.

Order of calls: move the modules to the device, `prepare(*modules)`, wrap in DDP, build the
optimizer from `param_groups(groups)`; per step `with autocast():` forward on
`cast_inputs(x)`, `backward(loss)` (k times for accumulation), `step(optimizer)`,
`zero_grad(optimizer)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from recognition.sharded import copy_placement, mark_like

LEVELS = ("O0", "O1", "O2", "O3")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, as 0-dim tensors on the step's device.

    Nothing here has been read on the host: a training step launches no synchronisation,
    and whoever needs a value (the log window, at its interval) reads it then. `Precision.step()`
    fills the first three; the training step (`recognition.training.step`) adds the loss,
    whether it was finite and the accuracy of its micro-batches.

    stepped: bool; False when the loss or the gradients held inf/NaN and the update was
        skipped (no weight and no optimizer state changed).
    grad_norm: total L2 norm of the unscaled gradients before clipping (inf/NaN when they
        held inf/NaN); float32 or float64.
    scale: float32, the loss scale after this step's update (1.0 when no scaler is used).
    loss: mean loss over the step's micro-batches (not divided by their number); None when
        the caller knows no loss.
    finite: bool; False when a micro-batch's loss was NaN or inf (the step was then skipped);
        None when the caller knows no loss.
    accuracy: share of the global batch whose target logit was the largest (mean over
        micro-batches); None when the head reports none.
    """

    stepped: Tensor
    grad_norm: Tensor
    scale: Tensor
    loss: Tensor | None = None
    finite: Tensor | None = None
    accuracy: Tensor | None = None


class Precision:
    """One precision level: casts the model, owns the fp32 masters and the loss scaler.

    Args:
        level: "O0", "O1", "O2" or "O3" (see the module docstring).
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
        if level not in LEVELS:
            raise ValueError(f"precision.level: unknown level {level!r} (use one of {LEVELS})")
        if dtype not in DTYPES:
            raise ValueError(f"precision.dtype: unknown dtype {dtype!r} (use fp16 or bf16)")
        if not init_scale > 0:
            raise ValueError(f"precision init_scale must be > 0, got {init_scale}")
        if growth_interval < 1:
            raise ValueError(f"precision growth_interval must be >= 1, got {growth_interval}")
        device = torch.device(device)
        if (
            level != "O0"
            and dtype == "bf16"
            and device.type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ValueError("precision.dtype: bf16 is not supported on this GPU (use fp16)")
        self.level = level
        self.dtype = dtype
        self.device = device
        self.half_dtype = DTYPES[dtype]
        self.compute_dtype = torch.float32 if level == "O0" else self.half_dtype
        # Loss scaling guards fp16's narrow exponent range. O3 goes without, like apex's O3
        # (loss scale 1.0): it is the unprotected baseline.
        use_scaler = dtype == "fp16" and level in ("O1", "O2")
        self.scaler: torch.amp.GradScaler | None = None
        if use_scaler and process_group is not None:
            # A GradScaler that all-reduces its found-inf flags (it needs no FSDP model).
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(
                device.type,
                init_scale=init_scale,
                growth_interval=growth_interval,
                process_group=process_group,
            )
        elif use_scaler:
            self.scaler = torch.amp.GradScaler(
                device.type, init_scale=init_scale, growth_interval=growth_interval
            )
        # Filled by prepare(): every distinct parameter of the prepared modules under a
        # "<module index>.<parameter name>" key, and (O2) the master that stands for it.
        self._model_params: dict[str, nn.Parameter] = {}
        self._masters: dict[str, nn.Parameter] = {}
        self._num_modules = 0
        self._checked_optimizers: set[int] = set()
        # Fused optimizers ready to skip steps on the device (see _skips_on_device).
        self._device_skipping: dict[int, bool] = {}
        self._unit_scale = torch.ones((), dtype=torch.float32, device=device)

    # ---------------------------------------------------------------- setup

    def prepare(self, *modules: nn.Module) -> None:
        """Cast `modules` in place for this level and (O2) make the fp32 master copies.

        Call after moving the modules to `device` and before wrapping them in DDP and building
        the optimizer. May be called more than once; each module gets the next index in the
        keys of `state_dict()["masters"]`. O0 and O1 leave the modules untouched.
        """
        for module in modules:
            if isinstance(module, DistributedDataParallel):
                raise ValueError(
                    "Precision.prepare: got a DistributedDataParallel module; prepare the bare "
                    "module before wrapping it, since casting changes DDP's gradient buckets"
                )
            if not isinstance(module, nn.Module):
                raise ValueError(f"Precision.prepare: expected nn.Module, got {type(module)}")
        seen = {id(p) for p in self._model_params.values()}
        for module in modules:
            index = self._num_modules
            self._num_modules += 1
            for name, param in module.named_parameters():
                if param.device.type != self.device.type:
                    raise ValueError(
                        f"Precision.prepare: parameter {name!r} is on {param.device}, expected "
                        f"{self.device}; move the module to the device before prepare()"
                    )
            if self.level in ("O2", "O3"):
                _cast_floating(module, self.half_dtype, keep_batchnorm=self.level == "O2")
            for name, param in module.named_parameters():
                if id(param) in seen:  # tied weights: one master, first name wins
                    continue
                seen.add(id(param))
                key = f"{index}.{name}"
                self._model_params[key] = param
                if self.level == "O2":
                    self._masters[key] = _make_master(param)

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """Map optimizer groups onto the parameters the optimizer must own.

        Takes groups as `torch.optim` does (`{"params": [...], "lr": ..., ...}`) holding the
        model's parameters, and returns new groups with every key kept and "params" replaced
        by the fp32 masters under O2 (unchanged at other levels).
        """
        master_of = {id(self._model_params[key]): master for key, master in self._masters.items()}
        mapped = []
        for group_index, group in enumerate(groups):
            if "params" not in group:
                raise ValueError(f"Precision.param_groups: group {group_index} has no 'params'")
            params = group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            if self.level == "O2":
                unknown = [i for i, p in enumerate(params) if id(p) not in master_of]
                if unknown:
                    raise ValueError(
                        f"Precision.param_groups: group {group_index} holds parameters (indices "
                        f"{unknown[:5]}) of no module given to prepare(); O2 needs their masters"
                    )
                params = [master_of[id(p)] for p in params]
            mapped.append({**group, "params": params})
        return mapped

    # ---------------------------------------------------------------- forward

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in: autocast for O1/O2, a no-op for O0/O3."""
        if self.level in ("O1", "O2"):
            return torch.autocast(self.device.type, dtype=self.half_dtype)
        return contextlib.nullcontext()

    def cast_inputs(self, x: Tensor) -> Tensor:
        """`x` in the half dtype under O2/O3 (floating tensors only); unchanged otherwise."""
        if self.level in ("O2", "O3") and x.is_floating_point():
            return x.to(self.half_dtype)
        return x

    # ---------------------------------------------------------------- backward and step

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
        (see the module docstring). Gradients are left in place;
        call `zero_grad()` next.
        """
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self._check_optimizer(optimizer)
        if self.level == "O2":
            self._model_grads_to_masters()
        if self.scaler is not None:
            # Divides the grads the optimizer owns by the scale and records, on the device,
            # whether any is inf/NaN (update() below backs the scale off on it).
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if grad_norm_fn is None:
            grad_norm = _total_grad_norm(params, self.device)
        else:
            grad_norm = grad_norm_fn(params)
        ok = torch.isfinite(grad_norm)
        if finite is not None:
            ok = ok & finite.to(ok.device)
        if max_grad_norm is not None:
            # A norm that is not finite turns the gradients into NaN here; the update that
            # would apply them is skipped. The norm goes in as float32, as it always has.
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm.to(torch.float32))
        self._apply(optimizer, ok)
        scale = self._unit_scale
        if self.scaler is not None:
            self.scaler.update()
            # get_scale() would read the scale on the host; this is the tensor itself, cloned
            # since the scaler updates it in place.
            scale = self.scaler._get_scale_async().clone()
        if self.level == "O2":
            # After a skipped update the masters hold what the model already holds.
            self._masters_to_model()
        return StepResult(stepped=ok, grad_norm=grad_norm, scale=scale)

    def _apply(self, optimizer: torch.optim.Optimizer, ok: Tensor) -> None:
        """`optimizer.step()` where `ok` (a 0-dim bool tensor) is True; where it is False no
        parameter and no optimizer state changes."""
        if self._skips_on_device(optimizer):
            # Fused kernels take GradScaler's two attributes: with found_inf = 1 they return
            # before touching anything, and fused Adam(W) takes its step count back. No
            # grad_scale: the gradients are already unscaled.
            optimizer.found_inf = (~ok).to(torch.float32)  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
        elif bool(ok):  # an optimizer that cannot skip on the device: one host read
            optimizer.step()

    def _skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` can be handed a skip flag (a fused torch optimizer), making
        the state that a skipped first step would otherwise leave undefined (once)."""
        key = id(optimizer)
        if key not in self._device_skipping:
            ready = getattr(optimizer, "_step_supports_amp_scaling", False)
            if ready and isinstance(optimizer, torch.optim.SGD):
                ready = _zero_momentum_buffers(optimizer)
            self._device_skipping[key] = ready
        return self._device_skipping[key]

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients of the optimizer's parameters and of the prepared model."""
        optimizer.zero_grad(set_to_none=True)
        for param in self._model_params.values():
            param.grad = None

    # ---------------------------------------------------------------- checkpoints

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
            "masters": {
                key: mark_like(master, self._model_params[key])
                for key, master in self._masters.items()
            },
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
        if self.level != "O2":
            return
        saved = state.get("masters", {})
        if not saved:
            raise ValueError(
                f"Precision.load_state_dict: state saved at level {state.get('level')} holds no "
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
        self._masters_to_model()

    def fp32_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """`module.state_dict()` in fp32, with the O2 masters' values in place of half weights.

        Gives a checkpoint or an export that does not depend on the precision level (a half
        weight cast back to fp32 would have lost its low bits; the master has them). Works on
        a prepared module or any module holding prepared ones.
        """
        master_of = {id(param): master for _, param, master in self.masters()}
        state = module.state_dict()
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in master_of:
                state[name] = master_of[id(param)].detach().clone()
        return {
            name: value.float() if value.is_floating_point() else value
            for name, value in state.items()
        }

    def load_fp32_state_dict(self, module: nn.Module, state: dict[str, Tensor]) -> None:
        """Load an fp32 state dict (as `fp32_state_dict` writes) into `module` and its masters.

        The module's half weights get the rounded values and the O2 masters the exact ones.
        Keys must match `module.state_dict()` exactly.
        """
        module.load_state_dict(state, strict=True)
        master_of = {id(param): master for _, param, master in self.masters()}
        with torch.no_grad():
            for name, param in module.named_parameters(remove_duplicate=False):
                master = master_of.get(id(param))
                if master is not None and master is not param:
                    master.copy_(state[name])

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer steps for the prepared `param`: its O2 master, or itself."""
        for key, model_param in self._model_params.items():
            if model_param is param:
                return self._masters.get(key, param)
        raise ValueError("Precision.optimizer_param: the parameter was not prepared")

    def masters(self) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
        """(key, model parameter, fp32 master) for each prepared parameter under O2.

        Keys are "<module index>.<parameter name>", the index counting the modules in the
        order prepare() received them. An fp32 parameter (BatchNorm) is its own master.
        """
        for key, master in self._masters.items():
            yield key, self._model_params[key], master

    # ---------------------------------------------------------------- internals

    def _model_grads_to_masters(self) -> None:
        for _, param, master in self.masters():
            if master is param:
                continue
            if param.grad is None:
                master.grad = None  # unused this step: the optimizer skips it
            elif master.grad is None:
                master.grad = param.grad.detach().to(torch.float32)
            else:
                master.grad.copy_(param.grad)

    def _masters_to_model(self) -> None:
        with torch.no_grad():
            for _, param, master in self.masters():
                if master is not param:
                    param.copy_(master)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Once per optimizer: under O2 an optimizer built on the half model parameters would
        # step them directly and the masters would silently overwrite the result.
        if self.level != "O2" or id(optimizer) in self._checked_optimizers:
            return
        model_ids = {id(p) for _, p, m in self.masters() if m is not p}
        for group in optimizer.param_groups:
            if any(id(p) in model_ids for p in group["params"]):
                raise ValueError(
                    "Precision.step: the optimizer owns half model parameters; under O2 build it "
                    "from precision.param_groups(groups)"
                )
        self._checked_optimizers.add(id(optimizer))


def _cast_floating(module: nn.Module, dtype: torch.dtype, keep_batchnorm: bool) -> None:
    """Cast the floating parameters and buffers of `module` to `dtype`, in place.

    `param.data` is replaced rather than the Parameter, so references held elsewhere (tied
    weights, hooks) stay valid. With `keep_batchnorm`, BatchNorm layers keep fp32. Buffers a
    module names in `keep_dtype_buffers` keep their dtype.
    """
    for submodule in module.modules():
        if keep_batchnorm and isinstance(submodule, _BatchNorm):
            continue
        kept = set(getattr(submodule, "keep_dtype_buffers", ()))
        tensors: Iterable[Tensor] = list(submodule.parameters(recurse=False)) + [
            buffer for name, buffer in submodule.named_buffers(recurse=False) if name not in kept
        ]
        for tensor in tensors:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)


def _make_master(param: nn.Parameter) -> nn.Parameter:
    """The fp32 parameter the optimizer steps in place of `param` (itself if already fp32)."""
    if param.dtype == torch.float32:
        return param
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


@torch.no_grad()
def _zero_momentum_buffers(optimizer: torch.optim.SGD) -> bool:
    """Give every parameter of a fused SGD a zero momentum buffer where it has none yet.

    Fused SGD makes its buffers on its first step with `torch.empty_like` and fills them in
    the kernel, which `found_inf` skips: a skipped first step would leave uninitialised
    memory as momentum. A zero buffer is what the first step's buffer amounts to (the next
    step sets it to 0 * momentum + grad = grad, bit for bit) when dampening is 0; with
    dampening it is not, and False says the optimizer must be stepped from the host.
    (`recognition.optim.init_state` makes every optimizer's state this way for checkpoints,
    by a step at lr 0 on zero gradients; this needs no gradient-sized tensors.)
    """
    groups = [g for g in optimizer.param_groups if g["momentum"] != 0]
    if any(g["dampening"] != 0 for g in groups):
        return False
    for group in groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param)
    return True


_WIDE = (torch.float32, torch.float64)


def _total_grad_norm(params: list[Tensor], device: torch.device) -> Tensor:
    """L2 norm over all `.grad`s, accumulated in at least fp32 so half grads cannot overflow
    it: a 0-dim tensor (zero on `device` when no parameter has a gradient)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if all(g.dtype == grads[0].dtype for g in grads) and grads[0].dtype in _WIDE:
        return torch.nn.utils.get_total_norm(grads)
    # fp64 stays fp64 (a float64 reference run); anything narrower is widened to fp32.
    norms = [
        torch.linalg.vector_norm(g, dtype=g.dtype if g.dtype in _WIDE else torch.float32)
        for g in grads
    ]
    norms = [n.double() for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))
