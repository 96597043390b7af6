"""Fused GPU kernels of the margin-softmax head (Triton).

`margin_softmax_triton` is imported lazily, by the head, when a forward first uses it:
`triton.jit` decides at import time whether the kernels run compiled (CUDA tensors) or in
Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), so importing it here would fix that
choice before a caller could make it.
"""
