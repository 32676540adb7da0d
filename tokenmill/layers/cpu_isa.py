"""Which CPU kernel path this machine takes: decided once at start from the CPU's flags, and logged.

Paths, best first:
- amx:         AMX-BF16 tiles. bf16 linears: the AMX tile C GEMM (`cpu_amx_gemm`) while the
               activations stay within ~1 MiB (the fused [gate | up] silu-mul always), oneDNN's
               AMX kernels (weights packed once, `linear.PackedWeight`) above; o_proj / down_proj (float32 into the residual stream)
               and the LM head: the AMX tile GEMM at every row count (`cpu_amx_gemm.F32_MIN_ROWS`;
               the packed `vdpbf16ps` GEMM of `cpu_bf16_gemm` below it, the same packed weight).
- avx512_bf16: AVX512-BF16 dot products. Every bf16 linear, the LM head and o_proj / down_proj:
               the packed `vdpbf16ps` GEMM of `cpu_bf16_gemm` (bf16, silu-mul or float32
               epilogues; ~2x less CPU than oneDNN's avx512_core_bf16 GEMV at one row). bf16 is
               the fast dtype here.
- avx512:      AVX-512F without bf16 arithmetic: oneDNN emulates bf16, `cpu_logits` widens bf16 to
               float32 and uses FMAs.
- avx2:        AVX2 + FMA: as avx512, on 256-bit vectors.
- generic:     whatever the compiler makes of the portable C.
float32 linears are the same everywhere (`cpu_gemm` for decode rows, MKL/oneDNN otherwise).

TOKENMILL_CPU_PATH=<name> picks a lower path than the machine's (for A/B runs and tests); a path the
CPU cannot run is refused with an error naming the missing flags.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

logger = logging.getLogger(__name__)

ENV_VAR = "TOKENMILL_CPU_PATH"


@dataclasses.dataclass(frozen=True)
class KernelPath:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags the path needs
    has_dpbf16: bool  # bf16 dot products in hardware (vdpbf16ps)
    native_bf16: bool  # bf16 matmuls faster than float32 (AMX or AVX512-BF16)
    build_flags: tuple[str, ...]  # extra compiler flags that pin the C kernels to this path


PATHS: tuple[KernelPath, ...] = (
    KernelPath("amx", ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f"), True, True,
               ("-mavx512f", "-mavx512bf16")),
    KernelPath("avx512_bf16", ("avx512_bf16", "avx512f"), True, True, ("-mavx512f", "-mavx512bf16")),
    KernelPath("avx512", ("avx512f",), False, False, ()),
    KernelPath("avx2", ("avx2", "fma"), False, False, ("-mno-avx512f",)),
    KernelPath("generic", (), False, False, ("-mno-avx",)),
)
_BY_NAME = {p.name: p for p in PATHS}


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def can_run(path: KernelPath, flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return all(f in flags for f in path.needs)


def best_path(flags: frozenset[str]) -> KernelPath:
    return next(p for p in PATHS if can_run(p, flags))


@functools.cache
def kernel_path() -> KernelPath:
    """This process's path: the best the CPU runs, or TOKENMILL_CPU_PATH's (which it must run)."""
    flags = cpu_flags()
    chosen = best_path(flags)
    forced = os.environ.get(ENV_VAR, "")
    if forced:
        if forced not in _BY_NAME:
            raise ValueError(f"{ENV_VAR}={forced!r} is not one of {', '.join(_BY_NAME)}")
        path = _BY_NAME[forced]
        missing = [f for f in path.needs if f not in flags]
        if missing:
            raise ValueError(f"{ENV_VAR}={forced!r} needs CPU flags {', '.join(missing)}, which this CPU lacks")
        chosen = path
    return chosen


def amx_how() -> str:
    """What runs on the amx path, as the kernels that loaded decide."""
    from tokenmill.layers import cpu_amx_gemm  # (imports this module)
    if cpu_amx_gemm.library() is None:
        return ("bf16 linears on AMX via oneDNN (packed weights), LM head and o_proj/down_proj (float32 "
                "out) via AVX512-BF16 C kernels (AMX tile GEMM unavailable)")
    return (f"bf16 linears via the AMX tile GEMM up to {cpu_amx_gemm.BF16_MAX_ELEMENTS} activation elements "
            "(gate/up with silu-mul: always), oneDNN's AMX above; "
            "LM head and o_proj/down_proj (float32 out) via the AMX tile GEMM"
            + (f" from {cpu_amx_gemm.F32_MIN_ROWS} rows, the AVX512-BF16 C GEMM below"
               if cpu_amx_gemm.F32_MIN_ROWS > 1 else " at every row count"))


def describe() -> str:
    """One line for the start-up log: the path and why."""
    path = kernel_path()
    flags = cpu_flags()
    shown = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "fma") if f in flags]
    how = {"amx": amx_how(),
           "avx512_bf16": "bf16 linears, LM head and o_proj/down_proj (float32 out) via the packed vdpbf16ps "
                          "C GEMM",
           "avx512": "bf16 emulated (float32 is faster here), C kernels on AVX-512F",
           "avx2": "bf16 emulated (float32 is faster here), C kernels on AVX2+FMA",
           "generic": "portable C kernels"}[path.name]
    forced = " (forced by TOKENMILL_CPU_PATH)" if os.environ.get(ENV_VAR) else ""
    return f"CPU kernel path: {path.name}{forced} (flags: {' '.join(shown) or 'none of note'}): {how}"
