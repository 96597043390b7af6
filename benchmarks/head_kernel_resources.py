"""What the head's Triton kernels need on a GPU, from ptxas, without a GPU.

    python -m benchmarks.head_kernel_resources                  # D = 128 256 512 1024, sm_90
    python -m benchmarks.head_kernel_resources --dims 512 --matmul-dtypes bfloat16 --json r.json

Every kernel variant that the host wrappers of heads/kernels/ launch (the forward, keeping
its logits or not; the backward's gradient of the logits, recomputed or from the kept ones,
and its row epilogue, plain or with the fused SGD update - with and without momentum,
Nesterov, the gate, the rows' inverse norms and rounded copy kept current - with and without
the partial-FC row index) is compiled ahead of time for the target GPU by
Triton's own compiler and the ptxas it ships, at the default tiles (`gpu_tiles`), with the
arguments the wrappers would pass: the wrappers are run on meta tensors with the kernel
launches recorded instead of made. For each variant it prints the dynamic shared memory
(what Triton checks at launch against the block's limit: 232,448 bytes on an H100), the
registers per thread and the spill stores / loads that ptxas reports.

Arguments are specialised as Triton's launcher does: pointers 16-byte aligned, integers
divisible by 16 marked so (the embedding size and strides, with --rows a multiple of 16),
an integer equal to 1 made a constant. The kernels are compiled with TRITON_INTERPRET
unset, in this process: run it as a script, not from a process that runs them interpreted.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import table

H100_SHARED_BYTES = 232_448  # opt-in shared memory per block on sm_90
DTYPES = {"float32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments, constexprs and options."""

    kernel: object
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        name = self.kernel.__name__.strip("_").removesuffix("_kernel")
        flags = [k.lower() for k in ("HAS_INDEX", "KEEP", "FIXED", "FUSED", "HAS_MOMENTUM",
                                     "NESTEROV", "HAS_EXTRA", "HAS_GATE", "LR_IN_MEMORY",
                                     "KEEP_NORMS", "KEEP_ROWS")
                 if self.constexprs.get(k)]  # fmt: skip
        if name == "forward":  # on a chunk's rows, rounded to the matmul dtype
            flags.append(f"{str(self.args[0].dtype).removeprefix('torch.')} rows")
        return " ".join([name, *flags])


@dataclass
class Resources:
    """What ptxas reports for one kernel variant of one configuration."""

    dim: int
    weight_dtype: str
    matmul: str
    variant: str
    tiles: str
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    compile_s: float

    @property
    def ok(self) -> bool:
        spills = self.spill_stores + self.spill_loads
        return self.shared_bytes <= H100_SHARED_BYTES and spills == 0


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records a Launch."""

    def __init__(self, kernel, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def record(*args, num_warps: int, num_stages: int, **constexprs):
            self.launches.append(Launch(self.kernel, args, constexprs, num_warps, num_stages))

        return record


@contextlib.contextmanager
def recorded_launches():
    """Within the block, the head's kernel launches are recorded into the list yielded."""
    from recognition.heads.kernels import forward, gemm_backward

    names = [(forward, "_forward_kernel"), (gemm_backward, "_grad_logits_kernel"),
             (gemm_backward, "_scale_kept_kernel"), (gemm_backward, "_finish_kernel")]  # fmt: skip
    originals = {(module, name): getattr(module, name) for module, name in names}
    launches: list[Launch] = []
    for (module, name), kernel in originals.items():
        setattr(module, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)


def launches_for(
    dim: int, weight_dtype, matmul: str, num_rows: int, num_sms: int, capability: int = 90
) -> list[Launch]:
    """Every distinct launch of the host wrappers for this configuration (meta tensors);
    `matmul` one of DTYPES (tf32: float32 operands with TF32 allowed); the tiles those of a
    GPU of compute `capability` (90: sm_90)."""
    import torch

    from recognition.heads.kernels import margin_softmax_triton as kernels

    matmul_dtype = getattr(torch, "float32" if matmul == "tf32" else matmul)
    operands = {"float32": "fp32", "tf32": "tf32"}.get(matmul, "half")
    tiles = kernels.gpu_tiles(dim, num_sms, operands, tma=capability >= 90)
    num_classes = 100_003  # not a multiple of any tile
    meta = {"device": "meta"}
    weight = torch.empty(num_classes, dim, dtype=weight_dtype, **meta)
    embeddings = torch.empty(num_rows, dim, **meta)
    target_pos = torch.empty(num_rows, dtype=torch.int64, **meta)
    row_max = torch.empty(num_rows, **meta)
    index = torch.empty(num_classes // 3, dtype=torch.int64, **meta)
    target_grad = torch.empty(num_rows, dim, **meta)
    buffer = torch.empty(num_classes, dim, **meta)
    gate = torch.empty((), dtype=torch.bool, **meta)
    norms = torch.empty(num_classes, **meta)
    rounded = torch.empty(num_classes, dim, dtype=matmul_dtype, **meta)

    def sgd(momentum: float, nesterov: bool, step_ok=gate, lr=0.1):
        buf = buffer if momentum else None
        return kernels.SGDUpdate(lr, momentum, 5e-4, nesterov, buf, step_ok)

    # (update, what it keeps of the rows): the plain gradient; the fused update as the
    # training step makes it (gated, keeping the inverse norms, and the rounded rows with
    # the logits kept), as a captured step makes it (the rate read from the device), and
    # ungated (a backward called without train_step).
    rate = torch.empty((), **meta)
    updates = [(None, None), (sgd(0.0, False), (None, norms)),
               (sgd(0.9, False), (rounded, norms)), (sgd(0.9, True), (rounded, norms)),
               (sgd(0.9, False, lr=rate), (rounded, norms)),
               (sgd(0.9, False, None), (None, norms))]  # fmt: skip
    with recorded_launches() as launches:
        for row_index in (None, index):
            num_taking_part = num_classes if row_index is None else row_index.numel()
            inv_norm = torch.empty(num_taking_part, **meta)
            common = (embeddings, weight, row_index, inv_norm, target_pos)
            for keep in (False, True):  # the logits recomputed in the backward, or kept
                _, _, kept = kernels.class_stats(*common, 64.0, matmul_dtype, tiles, keep=keep)
                for update, kept_rows in updates:
                    kernels.class_stats_backward(
                        *common, row_max, row_max, 64.0, matmul_dtype, tiles,
                        target_grad=target_grad if update else None, sgd=update, kept=kept,
                        kept_rows=kept_rows,
                    )  # fmt: skip
    distinct: dict[str, Launch] = {}
    for launch in launches:
        if matmul == "tf32" and "INPUT_PRECISION" in launch.constexprs:  # as on a GPU
            # with TF32 allowed
            launch.constexprs["INPUT_PRECISION"] = "tf32"
        distinct.setdefault(launch.name, launch)
    return list(distinct.values())


def _specialise(launch: Launch):
    """Signature, constexprs and attributes as Triton's launcher would make them."""
    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    pointer_types = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                     torch.int64: "*i64", torch.int32: "*i32"}  # fmt: skip
    fn = launch.kernel
    params = [p for p in fn.params if not p.is_constexpr]
    signature, constexprs, attrs = {}, {}, {}
    for position, (param, value) in enumerate(zip(params, launch.args, strict=True)):
        index = fn.arg_names.index(param.name)
        if isinstance(value, torch.Tensor):
            signature[param.name] = pointer_types[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, TensorDescriptor):  # a host-side descriptor, by its block
            element = pointer_types[value.base.dtype].removeprefix("*")
            signature[param.name] = f"tensordesc<{element}{list(value.block_shape)}>"
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1:  # the launcher turns it into a constant
                signature[param.name] = "constexpr"
                constexprs[(index,)] = 1
                continue
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {position} of type {type(value).__name__}")
    for name, value in launch.constexprs.items():
        signature[name] = "constexpr"
        constexprs[(fn.arg_names.index(name),)] = value
    assert all(isinstance(v, (bool, int, str, tl.dtype)) for v in constexprs.values())
    return signature, constexprs, attrs


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_launch(launch: Launch, capability: int) -> dict:
    """Compile one launch for sm_<capability>: shared bytes, registers, spill stores/loads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = _specialise(launch)
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v's report
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
        )
    elapsed = time.perf_counter() - start
    text = log.getvalue()
    used, spills = _PTXAS_USED.search(text), _PTXAS_SPILLS.search(text)
    if used is None or spills is None:
        raise RuntimeError(f"{launch.name}: no ptxas report in the compiler's output:\n{text}")
    return {
        "shared_bytes": int(compiled.metadata.shared),
        "registers": int(used.group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
        "compile_s": elapsed,
    }


def measure(
    dims: list[int],
    weight_dtypes: list[str],
    matmul_dtypes: list[str],
    *,
    capability: int = 90,
    num_rows: int = 1024,
    num_sms: int = 132,
    variants: list[str] | None = None,
    finish_candidates: bool = False,
) -> list[Resources]:
    """Resources of every kernel variant (or those named in `variants`) per configuration;
    `finish_candidates`: also the row epilogue's variants that hold the most (the fused
    update with Nesterov momentum, keeping the rows' copy) at every tile the tuner tries."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("triton was imported to interpret kernels: run this in a new process")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    # A cache of its own, so that ptxas runs and reports (a cache hit skips it).
    with tempfile.TemporaryDirectory(prefix="head-kernel-resources-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        return _measure(dims, weight_dtypes, matmul_dtypes, capability, num_rows, num_sms,
                        variants, finish_candidates)  # fmt: skip


def epilogue_candidates(launches: list[Launch], dim: int) -> list[Launch]:
    """The row epilogue's launches that hold the most (fused Nesterov momentum, the rows'
    copy kept), one per tile the tuner tries besides the table's (heads/tuning/tiles.py:
    FINISH_CANDIDATES; `launches` has the table's)."""
    import dataclasses

    from recognition.heads.kernels import margin_softmax_triton as kernels
    from recognition.heads.tuning.tiles import finish_candidates

    heaviest = [x for x in launches if x.name.startswith("finish") and "nesterov" in x.name
                and "keep_rows" in x.name]  # fmt: skip
    d_pad = kernels.padded_dim(dim)
    return [
        dataclasses.replace(
            x,
            constexprs={**x.constexprs, "BLOCK_C": tiles.block_c(d_pad)},
            num_warps=tiles.num_warps,
        )  # fmt: skip
        for x in heaviest
        for tiles in finish_candidates(kernels.FINISH_TILES)[1:]
    ]


def _measure(
    dims, weight_dtypes, matmul_dtypes, capability, num_rows, num_sms, variants, finish_candidates
):
    import torch

    results = []
    # A launch compiled already (the same kernel, signature and constexprs under another
    # operand type: the row epilogue does not depend on it) is a hit in Triton's cache,
    # where ptxas does not run: its first report stands.
    compiled: dict[str, dict] = {}
    for dim in dims:
        for weight_name in weight_dtypes:
            for matmul_name in matmul_dtypes:
                weight_dtype = getattr(torch, weight_name)
                launches = launches_for(
                    dim, weight_dtype, matmul_name, num_rows, num_sms, capability
                )
                if finish_candidates:
                    launches = launches + epilogue_candidates(launches, dim)
                for launch in launches:
                    if variants is not None and launch.name not in variants:
                        continue
                    c = launch.constexprs
                    # The row epilogue of the GEMM backward holds (rows, D) tiles, no K-loop.
                    shape = [c["BLOCK_C"], c.get("BLOCK_N", c.get("D_PAD")), c.get("BLOCK_D")]
                    tiles = (
                        f"{'x'.join(str(v) for v in shape if v is not None)} "
                        f"w{launch.num_warps} s{launch.num_stages}"
                    )
                    key = f"{launch.kernel.__name__} {_specialise(launch)} {launch.num_warps} "
                    key += str(launch.num_stages)
                    if key not in compiled:
                        compiled[key] = compile_launch(launch, capability)
                    results.append(
                        Resources(
                            dim, DTYPES[weight_name], DTYPES[matmul_name], launch.name, tiles,
                            **compiled[key],
                        )
                    )  # fmt: skip
    return results


def print_table(results: list[Resources]) -> None:
    columns = [
        ("D", 5), ("weight", 6), ("matmul", 6), ("kernel variant", -44), ("tiles CxNxD", -21),
        ("shared B", 9), ("regs", 4), ("spill st/ld", -11), ("", -20),
    ]  # fmt: skip
    rows = [
        [
            r.dim,
            r.weight_dtype,
            r.matmul,
            r.variant,
            r.tiles,
            f"{r.shared_bytes:,}",
            r.registers,
            f"{r.spill_stores:>5}/{r.spill_loads}",
            "" if r.ok else "<-- over the limit" if r.spill_stores == 0 else "<-- spills",
        ]  # fmt: skip
        for r in results
    ]
    table.print_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument(
        "--weight-dtypes", nargs="+", default=["float32"],
        choices=["float32", "bfloat16", "float16"],
    )  # fmt: skip
    parser.add_argument(
        "--matmul-dtypes", nargs="+", default=["bfloat16", "float16", "tf32", "float32"],
        choices=list(DTYPES),
    )  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=None, help="only these kernel variants")
    parser.add_argument("--capability", type=int, default=90, help="compute capability (90: H100)")
    parser.add_argument("--rows", type=int, default=1024, help="global batch N")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU (grid sizes)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--finish-candidates", action="store_true",
                        help="also the row epilogue at every tile the tuner tries")  # fmt: skip
    args = parser.parse_args(argv)
    results = measure(
        args.dims, args.weight_dtypes, args.matmul_dtypes, capability=args.capability,
        num_rows=args.rows, num_sms=args.sms, variants=args.variants,
        finish_candidates=args.finish_candidates,
    )  # fmt: skip
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
