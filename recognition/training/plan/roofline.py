"""A lower bound of a step's time on a GPU: per-op roofline over the ops a step runs.

`DEVICES` holds peak dense rates and memory bandwidth from the vendors' datasheets (NVIDIA
H100 Tensor Core GPU datasheet, SXM5 80GB; H200 Tensor Core GPU datasheet, SXM 141GB; A100
Tensor Core GPU datasheet, SXM4 80GB; Tesla V100 datasheet, SXM2 32GB). The datasheets
quote tensor-core rates with 2:4 sparsity; the figures here are the dense ones (half of
those). V100 has no bf16 and no tf32.

`StepCost` is a dispatch mode that sees every op of a step (on fake tensors: shapes only)
and adds, for each device, max(FLOPs / peak rate of the op's dtype, bytes / bandwidth):
no op can run faster than its own roofline, and eager ops run one after another. FLOPs
are torch's own formulas (`torch.utils.flop_counter`: matmuls and convolutions); bytes
are the op's tensor inputs and outputs, each read or written once (views move nothing).
Not counted: kernel launch gaps, communication (all-gathers, DDP's all-reduce), the data
loader. So the sum is a bound the step cannot beat, not a prediction of its time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from recognition.tensor_memory import upper_bound

TERA = 1e12


@dataclass(frozen=True)
class Device:
    """A GPU's peak dense rates (TFLOP/s; None where it has no such unit), bandwidth (TB/s)
    and memory (GB as sold)."""

    name: str
    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float
    bandwidth: float
    memory_gb: float

    def rate(self, dtype: torch.dtype, conv: bool) -> float:
        """FLOP/s of a matmul or convolution in `dtype` (fp32 convolutions take TF32, as
        cuDNN does by default; fp32 matmuls do not, torch's default)."""
        if dtype == torch.bfloat16 and self.bf16 is not None:
            return self.bf16 * TERA
        if dtype in (torch.float16, torch.bfloat16):
            return self.fp16 * TERA
        if conv and dtype == torch.float32 and self.tf32 is not None:
            return self.tf32 * TERA
        return self.fp32 * TERA


DEVICES = {
    "H100 SXM": Device("H100 SXM", 989.4, 989.4, 494.7, 66.9, 3.35, 80),
    "H200": Device("H200", 989.4, 989.4, 494.7, 66.9, 4.8, 141),
    "A100 80GB": Device("A100 80GB", 312.0, 312.0, 156.0, 19.5, 2.039, 80),
    "V100": Device("V100", None, 125.0, None, 15.7, 0.9, 32),
}

_CONVOLUTIONS = {"convolution", "convolution_backward", "_convolution", "conv2d"}
# Ops that move no tensor memory: metadata (prim.device) and communication (not the
# memory bound's).
_FREE_NAMESPACES = {"prim", "c10d", "_c10d_functional", "_c10d_functional_autograd"}


class StepCost(TorchDispatchMode):
    """FLOPs, bytes and the per-op roofline bound (seconds, per device) of what runs inside."""

    def __init__(self, devices: dict[str, Device] | None = None) -> None:
        super().__init__()
        self.devices = DEVICES if devices is None else devices
        self.flops = 0
        self.bytes = 0
        self.bound_s = dict.fromkeys(self.devices, 0.0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _FREE_NAMESPACES or func.is_view:
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        num_bytes = sum(upper_bound(t.numel()) * t.element_size() for t in tensors)
        packet = func._overloadpacket
        flops = 0
        dtype = torch.float32
        if packet in flop_registry:
            flops = upper_bound(flop_registry[packet](*args, **kwargs, out_val=out))
            dtype = next((t.dtype for t in tensors if t.is_floating_point()), dtype)
        conv = packet.__name__ in _CONVOLUTIONS
        self.flops += flops
        self.bytes += num_bytes
        for name, device in self.devices.items():
            self.bound_s[name] += max(
                flops / device.rate(dtype, conv), num_bytes / (device.bandwidth * TERA)
            )
        return out
