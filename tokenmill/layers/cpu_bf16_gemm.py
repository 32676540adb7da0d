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

from tokenmill.layers import c_build, c_common, cpu_isa

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#define MR_MAX 6
#define NB 4            /* 16-column vectors per tile: 64 outputs */
#define RBLK 48         /* rows of x per work block */

/* Epilogues (`mode`): */
#define OUT_F32 0       /* y float32 = bias + acc (+ add) */
#define OUT_BF16 1      /* y bf16 = round(bias + acc) */
#define OUT_SILU_MUL 2  /* packed vectors alternate gate, up (16 columns each): y bf16 =
                           round(up * round(silu(gate))), one output column per gate column */

/* exp16 (exp of float32 lanes) and bf16_round: c_common.AVX512_EXP_BF16 */
""" + c_common.AVX512_EXP_BF16 + r"""
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  /* nearest even */
static inline void store_bf16(uint16_t *y, __m512 v, int left) {
    const __m256i h = to_bf16(v);
    if (left >= 16) { _mm256_storeu_si256((__m256i *)y, h); return; }
    uint16_t tmp[16]; _mm256_storeu_si256((__m256i *)tmp, h); memcpy(y, tmp, 2 * (size_t)left);
}

/* Rows m0..m0+MR of y over 16-column vectors [v0, v0 + nvs) of the packed weight `wt` (already at
   vector v0), all of K (pairs kp in [0, KP)). `y` and `a` point at row m0; `col` is v0's first
   output column (OUT_SILU_MUL: half of v0's packed column), `ncols` the output width. */
#define KERNEL(MR)                                                                                 \
static void kern_##MR(const uint16_t *x, int64_t xs, const uint16_t *wt, const float *bias, int KP, \
                      int64_t vstride, int nvs, int mode, void *y, int64_t ys, const float *a, int64_t as,           \
                      int col, int ncols) {                                                         \
    __m512 acc[MR][NB];                                                                            \
    for (int m = 0; m < MR; ++m) for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();    \
    for (int kp = 0; kp < KP; ++kp) {                                                              \
        __m512bh b[NB];                                                                            \
        for (int j = 0; j < NB; ++j)                                                               \
            if (j < nvs) b[j] = (__m512bh)_mm512_loadu_si512(wt + j * vstride + (int64_t)kp * 32); \
        for (int m = 0; m < MR; ++m) {                                                             \
            int32_t pair; __builtin_memcpy(&pair, x + m * xs + 2 * kp, 4);                         \
            const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);                                 \
            for (int j = 0; j < NB; ++j)                                                           \
                if (j < nvs) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, b[j]);                    \
        }                                                                                          \
    }                                                                                              \
    for (int m = 0; m < MR; ++m) {                                                                 \
        if (bias)                                                                                  \
            for (int j = 0; j < nvs; ++j) acc[m][j] = _mm512_add_ps(acc[m][j], _mm512_loadu_ps(bias + 16 * j)); \
        if (mode == OUT_SILU_MUL) {                                                                \
            for (int j = 0; j + 1 < nvs; j += 2) {                                                 \
                const __m512 g = acc[m][j];                                                        \
                const __m512 s = bf16_round(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),   \
                                                          exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))))); \
                const int c = col + 8 * j;                                                         \
                store_bf16((uint16_t *)y + m * ys + c, _mm512_mul_ps(acc[m][j + 1], s), ncols - c); \
            }                                                                                      \
            continue;                                                                              \
        }                                                                                          \
        for (int j = 0; j < nvs; ++j) {                                                            \
            const int c = col + 16 * j, left = ncols - c;                                          \
            if (mode == OUT_BF16) { store_bf16((uint16_t *)y + m * ys + c, acc[m][j], left); continue; } \
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); \
            __m512 v = acc[m][j];                                                                  \
            if (a) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, a + m * as + c), v);              \
            _mm512_mask_storeu_ps((float *)y + m * ys + c, mask, v);                               \
        }                                                                                          \
    }                                                                                              \
}
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
typedef void (*kern_fn)(const uint16_t *, int64_t, const uint16_t *, const float *, int, int64_t, int, int, void *,
                        int64_t, const float *, int64_t, int, int);
static const kern_fn KERN[MR_MAX + 1] = {0, kern_1, kern_2, kern_3, kern_4, kern_5, kern_6};

/* Rows [r0, r1) over vectors [v0, v1), tile by tile. */
static void run_block(const uint16_t *x, int64_t xs, const uint16_t *wp, const float *bias, int KP, int64_t vstride,
                      int v0, int v1, int r0, int r1, int mode, void *y, int64_t ys, int esize,
                      const float *a, int64_t as, int ncols) {
    for (int v = v0; v < v1; v += NB) {
        const int nvs = v1 - v < NB ? v1 - v : NB;
        const int col = mode == OUT_SILU_MUL ? 8 * v : 16 * v;
        const uint16_t *wt = wp + v * vstride;
        for (int m = r0; m < r1; m += MR_MAX) {
            const int mr = r1 - m < MR_MAX ? r1 - m : MR_MAX;
            KERN[mr](x + m * xs, xs, wt, bias ? bias + 16 * v : 0, KP, vstride, nvs, mode,
                     (char *)y + (int64_t)m * ys * esize, ys, a ? a + m * as : 0, as, col, ncols);
        }
    }
}

/* x: [R, K] bf16, row stride xs (K even: the packing pads odd K, the caller pads x);
   wp: packed weight [NV][KPs][16][2] (KPs >= K/2: zero pairs up to `cpu_amx_gemm`'s 16-pair k-blocks,
   so both kernels share one packing); bias: NULL or float32 [16 NV] in packed column order;
   y: [R, ncols] float32 (OUT_F32) or bf16, row stride ys (elements); a: NULL or [R, ncols]
   float32 (stride as), OUT_F32 only. */
void bf16_gemm(const uint16_t *x, int64_t xs, const uint16_t *wp, int KPs, const float *bias, int R, int K, int NV,
               int mode, void *y, int64_t ys, int ncols, const float *a, int64_t as, int nthreads) {
    const int KP = K / 2;
    const int64_t vstride = (int64_t)KPs * 32;  /* one 16-column block of the packed weight */
    const int esize = mode == OUT_F32 ? 4 : 2;
    /* Row blocks of equal size (64 rows: two of 32, not 48 + 16, which left one of two threads
       a quarter of the work). */
    const int rblocks = (R + RBLK - 1) / RBLK, rows = rblocks ? (R + rblocks - 1) / rblocks : 0;
    if (rblocks <= 1) {
        /* Decode sizes: one row block, the weight split in equal runs of vectors (a pair per unit
           in OUT_SILU_MUL), one per thread: each streams its part once. */
        const int unit = mode == OUT_SILU_MUL ? 2 : 1, units = NV / unit;
        const int nt = nthreads < units ? nthreads : (units ? units : 1);
        #pragma omp parallel num_threads(nt) if (nt > 1)
        {
            const int t = omp_get_thread_num(), n = omp_get_num_threads();
            const int u0 = (int)((int64_t)units * t / n), u1 = (int)((int64_t)units * (t + 1) / n);
            run_block(x, xs, wp, bias, KP, vstride, u0 * unit, u1 * unit, 0, R, mode, y, ys, esize, a, as, ncols);
        }
        return;
    }
    /* Work items in the order that reads the larger operand once: with more weight rows than x
       rows a thread takes whole column tiles, each tile's weight panel reused over every row
       block while in cache, so the threads split the weight between them; with more x rows
       (prefill) a thread takes row blocks, each block of x reused over every tile while the
       (smaller) weight comes from cache. */
    const int ntiles = (NV + NB - 1) / NB, tiles_outer = 16 * NV > R;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int t = 0; t < ntiles * rblocks; ++t) {
        const int tile = tiles_outer ? t / rblocks : t % ntiles;
        const int r0 = (tiles_outer ? t % rblocks : t / ntiles) * rows;
        const int r1 = r0 + rows < R ? r0 + rows : R;
        const int v0 = tile * NB, v1 = v0 + NB < NV ? v0 + NB : NV;
        run_block(x, xs, wp, bias, KP, vstride, v0, v1, r0, r1, mode, y, ys, esize, a, as, ncols);
    }
}
"""

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
OUT_F32, OUT_BF16, OUT_SILU_MUL = 0, 1, 2  # the kernel's epilogues (`mode`)


@functools.cache
def library(path: cpu_isa.KernelPath | None = None) -> ctypes.CDLL | None:
    """The kernel built for `path` (default: this machine's); None on a path without vdpbf16ps
    or where it cannot be built."""
    path = path or cpu_isa.kernel_path()
    if not path.has_dpbf16:
        return None
    flags = (*c_build.BASE_FLAGS, *path.build_flags)
    return c_build.load_library(f"cpu_bf16_gemm_{path.name}", _SOURCE, flags, {"bf16_gemm": _ARGTYPES})


def available() -> bool:
    return library() is not None


def replaces_onednn() -> bool:
    """Whether bf16 linears take this GEMM rather than oneDNN (`linear.linear`, `silu_mul_linear`):
    on the avx512_bf16 path, where it was measured faster at every row count; AMX machines keep
    oneDNN's AMX kernels (not measured against this one). Not cached on its own: follows
    `cpu_isa.kernel_path()` (tests force paths and clear that cache)."""
    return cpu_isa.kernel_path().name == "avx512_bf16" and available()


def gate_up_rows(n: int) -> torch.Tensor:
    """Row order of a [gate | up] weight of 2I rows for OUT_SILU_MUL: 16 gate rows, then the 16 up
    rows of the same columns, and so on (each half zero-padded to a multiple of 16: index 2I)."""
    half = n // 2
    padded = -(-half // 16) * 16
    idx = torch.full((2, padded), n, dtype=torch.long)
    idx[0, :half] = torch.arange(half)
    idx[1, :half] = torch.arange(half, n)
    return idx.view(2, padded // 16, 16).transpose(0, 1).reshape(-1)


def pack(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """bf16 weight [N, K] -> [ceil(N/16), ceil(K/32) * 16, 16, 2] (zero padding; K to whole
    32-column k-blocks, which `cpu_amx_gemm` loads as 16 x 32 tiles, so that both GEMMs read the
    one copy); `gate_up`: rows in `gate_up_rows` order first."""
    n, k = weight.shape
    w = weight.detach()
    if gate_up:
        w = torch.cat([w, w.new_zeros(1, k)])[gate_up_rows(n)]
    padded = torch.nn.functional.pad(w, (0, -k % 32, 0, -w.shape[0] % 16))
    return padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_bias(bias: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """float32 bias in the packed column order (zero-padded to whole 16-column vectors)."""
    b = bias.detach().float()
    if gate_up:
        b = torch.cat([b, b.new_zeros(1)])[gate_up_rows(b.shape[0])]
    return torch.nn.functional.pad(b, (0, -b.shape[0] % 16)).contiguous()


def _key(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    # (inference tensors keep no version counter; they never change in place either)
    return (t.data_ptr(), 0 if t.is_inference() else t._version, tuple(t.shape))


class PackedBf16:
    """The packed form of one weight (and bias), rebuilt whenever either changes (storage or
    version) or another layout is asked for."""

    __slots__ = ("bias", "key", "packed")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gate_up: bool = False) -> torch.Tensor:
        key = (_key(weight), _key(bias), gate_up)
        if key != self.key:
            self.packed = pack(weight, gate_up)
            self.bias = None if bias is None else pack_bias(bias, gate_up)
            self.key = key
        return self.packed


def gemm_operands(x: torch.Tensor, weight: torch.Tensor, mode: int, add: torch.Tensor | None, k_multiple: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, bool]:
    """What a packed-GEMM call passes its C kernel: x with unit column stride, zero-padded to a multiple
    of `k_multiple` columns (the packing pads K with zero rows), the empty result, `add` with unit
    column stride (float32 results only), the result's width and whether it is the [gate | up] form."""
    n, k = weight.shape
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    if k % k_multiple:
        x2 = torch.nn.functional.pad(x2, (0, -k % k_multiple))
    gate_up = mode == OUT_SILU_MUL
    width = n // 2 if gate_up else n
    out = torch.empty((x2.shape[0], width), dtype=torch.float32 if mode == OUT_F32 else torch.bfloat16)
    a2 = None
    if add is not None:
        assert mode == OUT_F32 and add.dtype == torch.float32 and add.shape == out.shape
        a2 = add if add.stride(-1) == 1 else add.contiguous()
    return x2, out, a2, width, gate_up


def gemm(x: torch.Tensor, weight: torch.Tensor, cache: PackedBf16, *, bias: torch.Tensor | None = None,
         add: torch.Tensor | None = None, mode: int = OUT_F32, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """bf16 x [M, K] times weight [N, K]^T (`available()` must be True), float32 accumulation, then
    the epilogue `mode`: OUT_F32 float32 `bias + x @ weight.T (+ add)`; OUT_BF16 that rounded to
    bf16 (as oneDNN's bf16 linear); OUT_SILU_MUL: weight is [gate | up] (2I rows), the result bf16
    [M, I] `round(up * round(silu(gate)))` (as oneDNN's swish then mul post-ops)."""
    lib = lib or library()
    assert lib is not None
    x2, out, a2, width, gate_up = gemm_operands(x, weight, mode, add, k_multiple=2)
    if x2.shape[0]:
        packed = cache.get(weight, bias, gate_up)
        b = cache.bias
        lib.bf16_gemm(x2.data_ptr(), x2.stride(0), packed.data_ptr(), packed.shape[1], None if b is None else b.data_ptr(),
                      x2.shape[0], x2.shape[1], packed.shape[0], mode, out.data_ptr(), out.stride(0), width,
                      None if a2 is None else a2.data_ptr(), 0 if a2 is None else a2.stride(0),
                      torch.get_num_threads())
    return out


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, cache: PackedBf16,
             add: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """float32 `add + x @ weight.T` of bf16 x [M, K] and weight [N, K] (`available()` must be True)."""
    return gemm(x, weight, cache, add=add, lib=lib)
