"""Which backbones a CPU can train in channels-last, and how Inductor must compile on a CPU.

oneDNN's 1x1 convolution computes its weight gradient on a strided, channels-last (nhwc)
input through a "reduce to unit stride" workspace, and writes past that workspace when the
input has fewer channels than the kernel's channel block: 16 on AVX-512, 8 on AVX2
(uxlfoundation/oneDNN issue 6035, open). What follows depends on the CPU and the thread
count: a segmentation fault or `free(): invalid next size` (seen on AVX-512 AMD EPYC), a
hang with every thread spinning, or silently wrong weight gradients (relative error
0.5-0.6, seen on the AVX2 path). NCHW inputs take oneDNN's blocked path, which is correct.

The narrow default backbone reaches it: IResNet-18 at width 1/8 has 8 channels entering
`layer1.0.downsample.0`, a 1x1 convolution of stride 2. So on a CPU:

- eager channels-last (`data.channels_last=true`) is refused for a backbone holding such a
  convolution (`channels_last_hazards` names them), with one line that says why;
- Inductor compiles without its layout optimisation (`cpu_compile_options`), which would
  otherwise turn every convolution channels-last by itself, even with NCHW inputs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# The widest channel block of oneDNN's 1x1 backward-weights kernels on x86 (AVX-512, f32 and
# bf16); AVX2's is 8, so 16 covers both.
ONEDNN_1X1_CHANNEL_BLOCK = 16


def channels_last_hazards(backbone: nn.Module) -> list[str]:
    """Names of the convolutions whose weight gradient oneDNN gets wrong in channels-last.

    Those are the 1x1, strided convolutions with fewer than ONEDNN_1X1_CHANNEL_BLOCK input
    channels (see the module docstring). Works on a backbone built on the meta device.
    """
    return [
        name
        for name, module in backbone.named_modules()
        if isinstance(module, nn.Conv2d)
        and tuple(module.kernel_size) == (1, 1)
        and any(step > 1 for step in module.stride)
        and module.in_channels < ONEDNN_1X1_CHANNEL_BLOCK
    ]


def channels_last_refusal(backbone: nn.Module, what: str) -> str | None:
    """Why `backbone` cannot train channels-last on a CPU (a one-line message naming
    data.channels_last), or None when it can. `what` names the backbone in the message."""
    hazards = channels_last_hazards(backbone)
    if not hazards:
        return None
    first = next(m for n, m in backbone.named_modules() if n == hazards[0])
    more = f" and {len(hazards) - 1} more" if len(hazards) > 1 else ""
    return (
        f"data.channels_last: on a CPU, oneDNN computes the weight gradient of a strided 1x1 "
        f"convolution with fewer than {ONEDNN_1X1_CHANNEL_BLOCK} input channels wrongly in "
        f"channels-last (memory corruption, a hang or wrong gradients; oneDNN issue 6035), "
        f"and {what} has one: {hazards[0]} ({first.in_channels} channels){more}. Train on "
        "the CPU with data.channels_last=false (NCHW), or widen the model (model.width)"
    )


def cpu_compile_options(mode: str) -> dict[str, Any]:
    """Inductor options for compiling a training model on a CPU in `mode`.

    `mode`'s own options (torch.compile accepts a mode or options, not both) with layout
    optimisation off: Inductor keeps the inputs' memory format instead of converting the
    convolutions to channels-last, which on a CPU would reach oneDNN issue 6035 with NCHW
    inputs too.
    """
    from torch._inductor import list_mode_options

    return {**list_mode_options(mode), "layout_optimization": False}
