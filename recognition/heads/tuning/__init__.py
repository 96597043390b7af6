"""What the head decides by timing on a GPU, and the cache that keeps it between runs.

Two choices are measured rather than fixed: `head.kernel=auto` times a few training steps of
both implementations of the local statistics at the run's shapes and takes the faster
(`kernel`: `KernelSelector`, `choose_kernel`, called by the head at its first forward on a
CUDA device), and the Triton kernels time their candidate tiles (`tiles`). Both keep what
they measured in the cache of `measure` (`TuningCache`, `head.tuning_cache`).
"""
