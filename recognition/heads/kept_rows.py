"""What the Triton path keeps of the class rows between steps when its backward steps them
itself (head.fused_update): `KeptRows`.

A forward of the Triton path reads the rows as the kernels take them: their inverse norms
(C_local,) fp32, and their copy in the matmul dtype (bf16 under O1). Without the fused
update the optimizer rewrites the rows after every step, so both are made anew at each
forward from the fp32 rows (a pass over them each). With it, the backward's update epilogue
writes both for the rows it steps (`gemm_backward._finish_kernel`), so the next forward finds
them current and reads no fp32 row: `KeptRows` holds them between steps.

They are derived state: never in a checkpoint (the fp32 rows are, as the master), made again
from the rows whenever those changed another way - the rows' version counter moved (an
optimizer step, `load_state_dict`, an initialisation, any in-place torch op on them) or they
were replaced (`.to()`, another dtype or storage). A write through `.data` does not move the
version counter: call `invalidate()` after one.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KeptRows:
    """The inverse norms of the head's rows (C_local,) fp32 and, when asked, their copy in the
    matmul dtype (C_local, D) - none when the weight is in that dtype already - kept between
    steps (see the module docstring). The fused update keeps them current."""

    def __init__(self) -> None:
        self.rounded: Tensor | None = None
        self.inv_norm: Tensor | None = None
        self._key: tuple | None = None

    def current(
        self, weight: Tensor, matmul_dtype: torch.dtype, with_rows: bool, eps: float
    ) -> tuple[Tensor | None, Tensor]:
        """(the rows in `matmul_dtype` or None, their inverse norms 1 / max(|w|, eps)) for
        `weight` as it is now: what is kept, or made from the rows when they changed since
        (or `with_rows` or the dtype did)."""
        key = (
            weight._version, weight.untyped_storage()._cdata, weight.shape, weight.dtype,
            weight.device, matmul_dtype, with_rows,
        )  # fmt: skip
        if key != self._key:
            self.invalidate()  # the old copy goes before the new one is made
            with torch.no_grad():
                norms = torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32)
                self.inv_norm = 1.0 / norms.clamp_min(eps)
                if with_rows and weight.dtype != matmul_dtype:
                    self.rounded = weight.detach().to(matmul_dtype)
            self._key = key
        assert self.inv_norm is not None
        return self.rounded, self.inv_norm

    def invalidate(self) -> None:
        """Forget what is kept: the next forward makes it from the rows."""
        self.rounded = self.inv_norm = None
        self._key = None
