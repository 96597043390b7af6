"""The torch releases this project runs on, checked once at start-up.

`requirements.txt` pins one matched torch / torchvision pair, the tested default. A GPU
cluster or a container image often comes with its own torch; any release from
`MIN_TORCH` on is supported. 2.11 is the lowest because it is the oldest release the whole
suite has been run on (CPU, and the CUDA machine's 2.11.0), and the APIs the project needs
are all there by then: `torch.distributed.pipelining` with the batched send/recv fixes of
2.8, `torch.distributed.checkpoint`'s planner interface for row shards, `torch.amp`'s
bf16 / fp16 autocast and `GradScaler` under one name, and the single-tensor collectives
(`all_gather_into_tensor`, renamed `all_gather_single` in 2.14; see
`recognition.distributed`).

Also here: `interpreter_scalars_as_indices`, which lets Triton 3.6's interpreter (the Triton
of torch 2.11) run the head's kernels on a CPU under NumPy 2.4 and later.
"""

from __future__ import annotations

import re
from importlib import metadata

MIN_TORCH = (2, 11)


def release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) from '2.11.0+cu130', '2.12.0a0+git...', '2.11'."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"unrecognised torch version {version!r}")
    return tuple(int(part) for part in match.groups(default="0"))


def torch_version_error(version: str | None = None) -> str | None:
    """A one-line message when the installed torch is older than MIN_TORCH, else None."""
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return "torch is not installed: pip install -r requirements.txt"
    if release(version)[:2] >= MIN_TORCH:
        return None
    minimum = ".".join(str(part) for part in MIN_TORCH)
    return (
        f"torch {version} is installed, but this project needs torch >= {minimum} "
        f"(pip install -r requirements.txt installs the tested release)"
    )


def interpreter_scalars_as_indices() -> None:
    """Triton 3.6's interpreter (TRITON_INTERPRET=1) turns a scalar kernel argument into an
    index with `int(array)` on a one-element 1-d array, which NumPy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars": a `for t in range(n)` over a
    runtime `n` fails); Triton 3.8 squeezes the array first. Do the same on the older
    releases. Interpreter only: compiled kernels never take this path. Idempotent; called
    where the head's kernels are imported under the interpreter, so that every process
    that runs them interpreted (a spawned rank, a script) has it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch._squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch
