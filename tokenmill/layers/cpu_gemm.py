"""A small C kernel for float32 linears of 1 to 8 rows on CPU: decode and speculative verification.

At a few rows a linear is bound by reading its weight. MKL's GEMV reads it at memory speed for
one row, but its GEMM for 2-8 rows, and oneDNN's, cost 1.5-3x that on the AVX2 CPUs measured
(docs/results/spec-decode.md), so a step verifying k drafts cost far more than a decode step.
This kernel reads each weight row once and dots it with all the rows of x at once (held in
cache): 5 rows cost about what 1 row costs.

Invariant: row r of the output does not depend on the other rows, nor on how many there are
(same operations in the same order: explicit FMAs, no reassociation, no contraction elsewhere),
so a verification step's logits are bit for bit those of plain decoding, token by token.

Built like `cpu_decode.py` (`c_build.py`); `available()` False means use torch.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.layers import c_build

MAX_ROWS = 8  # rows per pass over the weight; more rows would read it again

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }  /* -ffp-contract=off: never fused */
#endif
static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* y[r, n..n+C) = x[r, :] . w[n + c, :] (+ bias) for R rows: C weight rows at once, each output its own
   accumulator chain (C chains hide the FMA latency that bounds one row's single chain), so every
   output's operations and their order are those of C = 1. R and C are compile-time constants. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t xs, const float *w,
        const float *bias, int K, int n, float *y, int64_t ys, const int R, const int C) {
    v8 acc[4][8];
    for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) acc[c][r] = (v8){0};
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int c = 0; c < C; ++c) {
            const v8 wv = ld8(w + (int64_t)(n + c) * K + k);
            for (int r = 0; r < R; ++r) acc[c][r] = fma8(wv, ld8(x + r * xs + k), acc[c][r]);
        }
    for (int c = 0; c < C; ++c) {
        const float *wn = w + (int64_t)(n + c) * K;
        for (int r = 0; r < R; ++r) {
            float s = hsum8(acc[c][r]);
            for (int j = k; j < K; ++j) s += wn[j] * x[r * xs + j];
            y[r * ys + n + c] = bias ? s + bias[n + c] : s;
        }
    }
}

/* y[r, n] = x[r, :] . w[n, :] (+ bias[n]) for R rows and n in [n0, n1), C outputs per pass. */
#define ROWS(R, C)                                                                                 \
static void rows##R(const float *x, int64_t xs, const float *w, const float *bias, int K,         \
                    int n0, int n1, float *y, int64_t ys) {                                        \
    int n = n0;                                                                                    \
    for (; n + C <= n1; n += C) block(x, xs, w, bias, K, n, y, ys, R, C);                          \
    for (; n < n1; ++n) block(x, xs, w, bias, K, n, y, ys, R, 1);                                  \
}
ROWS(1, 4) ROWS(2, 2) ROWS(3, 1) ROWS(4, 1) ROWS(5, 1) ROWS(6, 1) ROWS(7, 1) ROWS(8, 1)
typedef void (*rows_fn)(const float *, int64_t, const float *, const float *, int, int, int, float *, int64_t);
static const rows_fn ROWS_FN[9] = {0, rows1, rows2, rows3, rows4, rows5, rows6, rows7, rows8};

/* x: [R, K] (row stride xs, unit column stride); w: [N, K] contiguous; bias: [N] or NULL;
   y: [R, N] (row stride ys). Output rows are split over threads in chunks of 64. */
void few_rows_linear_f32(const float *x, int64_t xs, const float *w, const float *bias, int R, int K, int N,
                         float *y, int64_t ys, int nthreads) {
    const int chunk = 64, nchunks = (N + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int c = 0; c < nchunks; ++c) {
        const int n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int r0 = 0; r0 < R; r0 += 8) {
            const int rows = R - r0 < 8 ? R - r0 : 8;
            ROWS_FN[rows](x + r0 * xs, xs, w, bias, K, n0, n1, y + r0 * ys, ys);
        }
    }
}
"""

# No -fassociative-math and no FMA contraction: each output's sum keeps one fixed order.
_FLAGS = (*c_build.BASE_FLAGS, "-ffp-contract=off")
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Built (or loaded from the cache directory) once per process; None where it cannot be."""
    return c_build.load_library("cpu_gemm", _SOURCE, _FLAGS, {"few_rows_linear_f32": _ARGTYPES})


def available() -> bool:
    return _library() is not None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """float32 CPU tensors, 1..MAX_ROWS rows of x, a contiguous weight (and bias), no autograd."""
    if not (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and x.dim() >= 1 and weight.dim() == 2 and weight.is_contiguous()):
        return False
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 1 <= rows <= MAX_ROWS and available()


def takes_weight(weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """`supports`' checks on the weight and bias alone, made once where a layer binds its forward
    (`linear.cpu_f32_run`): what is left per call is the input's (float32, CPU, rows, autograd)."""
    return (weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.is_contiguous()))
            and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for inputs `supports` accepts."""
    lib = _library()
    assert lib is not None
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    lib.few_rows_linear_f32(x2.data_ptr(), x2.stride(0), weight.data_ptr(),
                            None if bias is None else bias.data_ptr(), x2.shape[0], k, n, out.data_ptr(),
                            out.stride(0), torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
