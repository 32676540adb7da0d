"""A small C kernel for the LM head on CPU in bfloat16: bf16 hidden x bf16 weight -> float32 logits.

oneDNN's bf16 linear rounds its output to bf16, which quantizes logits of magnitude 16-32 to steps
of 0.125: near ties become exact ties and the sampler, logprobs and greedy picks all see that noise
(HF's bf16 model has it too). This kernel keeps the float32 accumulation as the result, so the
logits carry only the error of their bf16 inputs.

Where the CPU has AVX512-BF16 it accumulates with `vdpbf16ps` (each bf16 x bf16 product is exact
in float32); elsewhere it widens bf16 to float32 and uses FMAs (`cpu_isa.KernelPath` names which
ran). A block of 4 weight rows x 4 input rows shares every load; output rows are split over
threads in chunks of 64.

Built like `cpu_gemm.py` (`c_build.py`); `available()` False means use torch (oneDNN in bf16, then
widen: the old, coarser logits).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.layers import c_build, cpu_isa

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(TM_DPBF16)
#include <immintrin.h>
#define STEP 32
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline acc_t acc_dot(acc_t acc, const uint16_t *a, const uint16_t *b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
}
static inline float acc_sum(acc_t v) { return _mm512_reduce_add_ps(v); }
/* The four sums of a, b, c, d at once (a quarter of the shuffles of four reductions). */
static inline void acc_sum4(acc_t a, acc_t b, acc_t c, acc_t d, float *out) {
    const __m256 a2 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)));
    const __m256 c2 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1)));
    const __m256 d2 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a2, b2), _mm256_hadd_ps(c2, d2));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#else
#define STEP 16
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float acc_t __attribute__((vector_size(64)));
static inline acc_t widen(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16; acc_t f; memcpy(&f, &w, sizeof f); return f;
}
static inline acc_t acc_zero(void) { return (acc_t){0}; }
static inline acc_t acc_dot(acc_t acc, const uint16_t *a, const uint16_t *b) { return acc + widen(a) * widen(b); }
static inline float acc_sum(acc_t v) {
    float s = 0.f; for (int i = 0; i < 16; ++i) s += v[i]; return s;
}
static inline void acc_sum4(acc_t a, acc_t b, acc_t c, acc_t d, float *out) {
    out[0] = acc_sum(a); out[1] = acc_sum(b); out[2] = acc_sum(c); out[3] = acc_sum(d);
}
#endif

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* y[r, n..n+NB) for RB rows of x: RB * NB dot products sharing their loads. */
#define TILE(RB, NB)                                                                                \
static void tile_##RB##_##NB(const uint16_t *x, int64_t xs, const uint16_t *w, int K, int n,       \
                             float *y, int64_t ys, const float *a, int64_t as) {                    \
    acc_t acc[RB][NB];                                                                              \
    for (int r = 0; r < RB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = acc_zero();              \
    int k = 0;                                                                                      \
    for (; k + STEP <= K; k += STEP)                                                                \
        for (int j = 0; j < NB; ++j)                                                                \
            for (int r = 0; r < RB; ++r)                                                            \
                acc[r][j] = acc_dot(acc[r][j], x + r * xs + k, w + (int64_t)(n + j) * K + k);       \
    for (int r = 0; r < RB; ++r) {                                                                  \
        if (NB == 4 && k == K) { /* no tail: four sums at once */                                   \
            float s4[4];                                                                            \
            acc_sum4(acc[r][0], acc[r][NB > 1], acc[r][2 * (NB > 2)], acc[r][3 * (NB > 3)], s4);    \
            for (int j = 0; j < 4; ++j) y[r * ys + n + j] = a ? a[r * as + n + j] + s4[j] : s4[j];  \
            continue;                                                                               \
        }                                                                                           \
        for (int j = 0; j < NB; ++j) {                                                              \
            float s = acc_sum(acc[r][j]);                                                           \
            const uint16_t *wn = w + (int64_t)(n + j) * K;                                          \
            for (int kk = k; kk < K; ++kk) s += bf16_to_f32(x[r * xs + kk]) * bf16_to_f32(wn[kk]);  \
            y[r * ys + n + j] = a ? a[r * as + n + j] + s : s;                                      \
        }                                                                                           \
    }                                                                                               \
}
TILE(1, 4) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)
typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int, int, float *, int64_t,
                        const float *, int64_t);
static const tile_fn TILE4[5] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4};
static const tile_fn TILE1[5] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};

/* x: [R, K] bf16 (row stride xs); w: [N, K] bf16 contiguous; y: [R, N] float32 (row stride ys);
   a: NULL, or [R, N] float32 (row stride as) added to the result (y = a + x w^T; y may be a).
   Work is split into blocks of RBLK rows x NCHUNK outputs: a block's x rows and weight rows stay
   in the core's cache while its tiles run (prefill-sized R), and both threads get blocks. */
#define RBLK 64
#define NCHUNK 64
void bf16_linear_f32(const uint16_t *x, int64_t xs, const uint16_t *w, int R, int K, int N,
                     float *y, int64_t ys, const float *a, int64_t as, int nthreads) {
    const int nchunks = (N + NCHUNK - 1) / NCHUNK, rblocks = (R + RBLK - 1) / RBLK;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int t = 0; t < nchunks * rblocks; ++t) {
        const int c = t % nchunks, rb0 = (t / nchunks) * RBLK;
        const int n0 = c * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;
        const int r1 = rb0 + RBLK < R ? rb0 + RBLK : R;
        for (int r0 = rb0; r0 < r1; r0 += 4) {
            const int rb = r1 - r0 < 4 ? r1 - r0 : 4;
            const float *ar = a ? a + r0 * as : 0;
            int n = n0;
            for (; n + 4 <= n1; n += 4) TILE4[rb](x + r0 * xs, xs, w, K, n, y + r0 * ys, ys, ar, as);
            for (; n < n1; ++n) TILE1[rb](x + r0 * xs, xs, w, K, n, y + r0 * ys, ys, ar, as);
        }
    }
}
"""

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


def build_flags(path: cpu_isa.KernelPath) -> tuple[str, ...]:
    """Compiler flags of the kernel for one path (the dot product's instructions)."""
    flags = (*c_build.BASE_FLAGS, *path.build_flags, "-ffp-contract=fast")
    return (*flags, "-DTM_DPBF16") if path.has_dpbf16 else flags


@functools.cache
def library(path: cpu_isa.KernelPath | None = None) -> ctypes.CDLL | None:
    """The kernel built for `path` (default: this machine's), or None where it cannot be."""
    path = path or cpu_isa.kernel_path()
    return c_build.load_library(f"cpu_logits_{path.name}", _SOURCE, build_flags(path),
                                {"bf16_linear_f32": _ARGTYPES})


def available() -> bool:
    return library() is not None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and x.shape[-1] == weight.shape[1] and not (torch.is_grad_enabled() and weight.requires_grad)
            and available())


def linear_f32(x: torch.Tensor, weight: torch.Tensor, lib: ctypes.CDLL | None = None,
               add: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `x @ weight.T` (`add + x @ weight.T` with `add`, a float32 [..., N] tensor, added
    inside the kernel) of bf16 x [..., K] and weight [N, K] (inputs `supports` accepts)."""
    lib = lib or library()
    assert lib is not None
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    a2 = None
    if add is not None:
        assert add.dtype == torch.float32 and add.shape[-1] == n and add.numel() == out.numel()
        a2 = add.reshape(-1, n)
        if a2.stride(1) != 1:
            a2 = a2.contiguous()
    if x2.shape[0]:
        lib.bf16_linear_f32(x2.data_ptr(), x2.stride(0), weight.data_ptr(), x2.shape[0], k, n, out.data_ptr(),
                            out.stride(0), None if a2 is None else a2.data_ptr(), 0 if a2 is None else a2.stride(0),
                            torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
