"""A small C kernel for decode attention on CPU, straight over the paged KV cache.

The pure-torch decode path gathers every decode's blocks into a buffer and then runs SDPA over
it: three passes over the context's K/V, plus SDPA's per-head overhead at query length 1. This
kernel reads each K and V row once, where the block table says it is, accumulating in float32.

Work items are (sequence, KV head) pairs, all of that head's G query heads together (GQA without
copies); where there are fewer items than threads can share and contexts are long, each
sequence's context is split into parts whose partial softmaxes are merged at the end. An item
walks its keys in tiles of 16 (never across a block): the 16 x G scores of a tile come from one
read of its K rows (each K row's products summed in vector lanes, then the 16 sums reduced
together), an online softmax (running max and denominator per query head, the accumulator
rescaled when the max grows) turns them into weights, and one read of the tile's V rows adds them
to the G accumulators; the next tile's rows are prefetched meanwhile. No score buffer over
the context, no allocation per item.

A bf16 cache with head size 64 (1-4 query heads a KV head) or 128 (1, 2 or 4) takes the
AVX-512 bf16 path (`dp_range`, on the amx, avx512_bf16 and avx512 paths): where there are at
least 4 sequences a thread, an item is a whole sequence, all KV heads, so each tile reads one
contiguous stretch of a block (K and V of every head) and the tile after it is prefetched as one
stretch (from memory, as in a model, the kernel took 0.64x the time of the per-head walk at
SmolLM2's 64 x ~160 shape, `scripts/cpu_attention_bench.py --cold`); bf16 rows are widened in
registers (even elements by a shift, odd ones by a mask, no lane shuffles) and FMA'd, the value
accumulators kept in that even/odd order until the end of the range.

Instructions by `cpu_isa` path (chosen at build time from the path's flags):
- amx: bf16 q.k by FMAs on widened rows (a zmm `vdpbf16ps` there runs at a quarter of an FMA's
  rate: 2x the time per product); avx512_bf16: bf16 q.k with `vdpbf16ps` (each bf16 product is
  exact in float32, as in an FMA of widened values); weights x V by FMAs on widened rows on both.
- avx512: AVX-512F, bf16 widened by shifts.   - avx2: the same on 256-bit vectors.
- generic: portable C (GCC vector extensions of 4 lanes: SSE2, NEON).
exp is a degree-7 polynomial after range reduction (~1 ulp); the soft-cap's tanh is libm's.

Plain C (no torch headers; the source: `cpu_decode_source.py`), built once per machine and path
with the system C compiler (`c_build.py`) and called through ctypes. Where no compiler is found,
the build fails, or TOKENMILL_NO_C_KERNELS=1 is set, `available()` is False and the torch path
runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from tokenmill.layers import c_build, cpu_isa
from tokenmill.layers.attention.cpu_decode_source import SOURCE as _SOURCE

# -ffp-contract=fast: a * b + c as one FMA in the portable path too (c_build.py says why never -ffast-math).
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
             ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]


# Paths whose CPUs run a zmm vdpbf16ps at a quarter of an FMA's rate (measured on an Emerald Rapids
# Xeon: 0.75 ns against 0.19 ns): their bf16 scores are FMAs on widened rows instead.
_QK_BY_FMA = ("amx",)


def build_flags(path: cpu_isa.KernelPath) -> tuple[str, ...]:
    """The path's flags pin x86 instruction sets; elsewhere (ARM...) -march=native alone decides."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    qk = ("-DQK_DP=0",) if x86 and path.name in _QK_BY_FMA else ()
    return (*c_build.BASE_FLAGS, *(path.build_flags if x86 else ()), *qk, "-ffp-contract=fast")


@functools.cache
def library(path: cpu_isa.KernelPath | None = None) -> ctypes.CDLL | None:
    """The kernel built for `path` (default: this machine's), or None where it cannot be."""
    path = path or cpu_isa.kernel_path()
    return c_build.load_library(f"cpu_decode_{path.name}", _SOURCE, build_flags(path),
                                {"decode_attention": _ARGTYPES})


def available() -> bool:
    return library() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype == q.dtype and kv_cache.is_contiguous() and q.stride(-1) == 1 and available())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q: [S, H, D] (last dim contiguous); kv_cache: [2, blocks, bs, Hkv, D]; block_table: int32 [S, W]
    contiguous; seq_lens: int32 [S] (0: a padding row, zeros). Returns [S, H, D] attention of each q
    over its context (its last `sliding_window` keys when set; the table's entries before them are
    never read); `sinks` [H]: each head's sink logit joins its softmax's denominator. `lib`: a
    kernel built for another path (tests)."""
    lib = lib or library()
    assert lib is not None
    s, h, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    out = torch.empty((s, h, d), dtype=q.dtype)
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    k_ptr = kv_cache.data_ptr()  # the K and V planes by address (contiguous cache: no two select ops per layer)
    lib.decode_attention(q.data_ptr(), q.stride(0), q.stride(1), k_ptr, k_ptr + kv_cache.stride(0) * kv_cache.element_size(),
                         block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
                         s, h, hkv, d, bs, scale, sliding_window or 0, logit_softcap or 0.0,
                         None if sinks is None else sinks.data_ptr(), int(q.dtype == torch.bfloat16),
                         torch.get_num_threads())
    return out
