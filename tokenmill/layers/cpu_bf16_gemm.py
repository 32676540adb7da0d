"""bf16 x bf16 -> float32 GEMM on CPUs with AVX512-BF16, with the residual add in its epilogue.

For the sublayer outputs that join the float32 residual stream on CPU in bf16 (`wide_linear`):
oneDNN (through torch) only writes bf16 results there, and the dot-product kernel of `cpu_logits`
reduces every output across a vector, so at prefill sizes it ran ~1.5-3x oneDNN's time. This one
is a register-blocked GEMM: the weight is packed once into pairs of k for 16 outputs
([N/16][K/2][16][2], zero-padded), so one `vdpbf16ps` multiplies a broadcast pair of x by 16
columns and accumulates in float32 lanes with no horizontal sums. Each bf16 x bf16 product is
exact in float32; sums are float32 (in k-pair order), so the result differs from float32 matmul
of the widened inputs only by float32 summation order.

`y = add + x @ W^T` with `add` optional (the residual stream, read once in the epilogue).
Only the avx512_bf16 / amx kernel paths build it (`cpu_isa`); elsewhere `available()` is False.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.layers import c_build, cpu_isa

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>

#define MR_MAX 6
#define NB 4            /* 16-column vectors per tile: 64 outputs */
#define RBLK 48         /* rows of x per work block */

/* y[m0..m0+MR, 16*nv0 .. +16*nvs) = add + x w^T over all K (pairs kp in [0, KP)). */
#define KERNEL(MR)                                                                                 \
static void kern_##MR(const uint16_t *x, int64_t xs, const uint16_t *wp, int KP, int nvs,          \
                      float *y, int64_t ys, const float *a, int64_t as, int ncols) {               \
    __m512 acc[MR][NB];                                                                            \
    for (int m = 0; m < MR; ++m) for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();    \
    const int64_t vstride = (int64_t)KP * 32; /* one 16-column block of the packed weight */       \
    for (int kp = 0; kp < KP; ++kp) {                                                              \
        __m512bh b[NB];                                                                            \
        for (int j = 0; j < NB; ++j)                                                               \
            if (j < nvs) b[j] = (__m512bh)_mm512_loadu_si512(wp + j * vstride + (int64_t)kp * 32); \
        for (int m = 0; m < MR; ++m) {                                                             \
            int32_t pair; __builtin_memcpy(&pair, x + m * xs + 2 * kp, 4);                         \
            const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);                                 \
            for (int j = 0; j < NB; ++j)                                                           \
                if (j < nvs) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, b[j]);                    \
        }                                                                                          \
    }                                                                                              \
    for (int m = 0; m < MR; ++m)                                                                   \
        for (int j = 0; j < nvs; ++j) {                                                            \
            const int left = ncols - 16 * j;                                                       \
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); \
            __m512 v = acc[m][j];                                                                  \
            if (a) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, a + m * as + 16 * j), v);         \
            _mm512_mask_storeu_ps(y + m * ys + 16 * j, mask, v);                                   \
        }                                                                                          \
}
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
typedef void (*kern_fn)(const uint16_t *, int64_t, const uint16_t *, int, int, float *, int64_t,
                        const float *, int64_t, int);
static const kern_fn KERN[MR_MAX + 1] = {0, kern_1, kern_2, kern_3, kern_4, kern_5, kern_6};

/* x: [R, K] bf16, row stride xs (K even: the packing pads odd K, the caller pads x);
   wp: packed weight [ceil(N/16)][K/2][16][2]; y: [R, N] float32 (stride ys);
   a: NULL or [R, N] float32 (stride as). */
void bf16_gemm_f32(const uint16_t *x, int64_t xs, const uint16_t *wp, int R, int K, int N,
                   float *y, int64_t ys, const float *a, int64_t as, int nthreads) {
    const int KP = K / 2, nvec = (N + 15) / 16, ntiles = (nvec + NB - 1) / NB;
    /* Row blocks of equal size (64 rows: two of 32, not 48 + 16, which left one of two threads
       a quarter of the work). Work items in the order that reads the larger operand once: with
       more weight rows than x rows (decode, the LM head) a thread takes whole column tiles, each
       tile's weight panel reused over every row block while in cache, so the threads split the
       weight between them; with more x rows (prefill) a thread takes row blocks, each block of x
       reused over every tile while the (smaller) weight comes from cache. */
    const int rblocks = (R + RBLK - 1) / RBLK, rows = rblocks ? (R + rblocks - 1) / rblocks : 0;
    const int tiles_outer = N > R;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int t = 0; t < ntiles * rblocks; ++t) {
        const int tile = tiles_outer ? t / rblocks : t % ntiles;
        const int r0 = (tiles_outer ? t % rblocks : t / ntiles) * rows;
        const int r1 = r0 + rows < R ? r0 + rows : R;
        const int v0 = tile * NB, nvs = nvec - v0 < NB ? nvec - v0 : NB;
        const int c0 = 16 * v0, ncols = N - c0;
        const uint16_t *wt = wp + (int64_t)v0 * KP * 32;
        for (int m = r0; m < r1; m += MR_MAX) {
            const int mr = r1 - m < MR_MAX ? r1 - m : MR_MAX;
            KERN[mr](x + m * xs, xs, wt, KP, nvs, y + m * ys + c0, ys, a ? a + m * as + c0 : 0, as, ncols);
        }
    }
}
"""

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


@functools.cache
def library(path: cpu_isa.KernelPath | None = None) -> ctypes.CDLL | None:
    """The kernel built for `path` (default: this machine's); None on a path without vdpbf16ps
    or where it cannot be built."""
    path = path or cpu_isa.kernel_path()
    if not path.has_dpbf16:
        return None
    flags = (*c_build.BASE_FLAGS, *path.build_flags)
    return c_build.load_library(f"cpu_bf16_gemm_{path.name}", _SOURCE, flags, {"bf16_gemm_f32": _ARGTYPES})


def available() -> bool:
    return library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] -> [ceil(N/16), ceil(K/2), 16, 2] (zero padding)."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, k % 2, 0, -n % 16))
    return padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


class PackedBf16:
    """The packed form of one weight, rebuilt whenever the weight changes (storage or version)."""

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self.key:
            self.packed, self.key = pack(weight), key
        return self.packed


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, cache: PackedBf16,
             add: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """float32 `add + x @ weight.T` of bf16 x [M, K] and weight [N, K] (`available()` must be True)."""
    lib = lib or library()
    assert lib is not None
    n, k = weight.shape
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    if k % 2:  # the packing pads K with a zero column; x gets one too
        x2 = torch.nn.functional.pad(x2, (0, 1))
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    a2 = None
    if add is not None:
        assert add.dtype == torch.float32 and add.shape == out.shape
        a2 = add if add.stride(-1) == 1 else add.contiguous()
    if x2.shape[0]:
        lib.bf16_gemm_f32(x2.data_ptr(), x2.stride(0), cache.get(weight).data_ptr(), x2.shape[0], x2.shape[1], n,
                          out.data_ptr(), out.stride(0), None if a2 is None else a2.data_ptr(),
                          0 if a2 is None else a2.stride(0), torch.get_num_threads())
    return out
