"""A small C kernel for decode attention on CPU, straight over the paged KV cache.

The pure-torch decode path gathers every decode's blocks into a buffer and then
runs SDPA over it: three passes over the context's K/V, plus SDPA's per-head
overhead at query length 1. This kernel reads each K and V row once, where the
block table says it is, accumulating in float32: one work item per (sequence,
KV head), all of that head's query heads together (GQA without copies).

It is plain C (no torch headers), built once per machine with the system C
compiler (~1 s, `c_build.py`) and called through ctypes. Where no compiler is
found, the build fails, or TOKENMILL_NO_C_KERNELS=1 is set, `available()` is
False and the torch path runs instead.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.layers import c_build

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float ld_f32(const float *p) { return *p; }
static inline void st_f32(float *p, float v) { *p = v; }
static inline float ld_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline void st_bf16(uint16_t *p, float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *p = (uint16_t)((u >> 16) | 64); return; }
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    *p = (uint16_t)(u >> 16);
}

/* One (sequence, KV head) work item: its G query heads over the sequence's last N cached tokens
   (N = L, or the window W when 0 < W < L: keys L-W..L-1; blocks before them are never read).
   cap > 0: scores become cap * tanh(score / cap) (logit soft-capping).
   sinks (NULL: none): float32 [H], a per-head logit in the softmax's denominator, with no value.
   HD is the head dim: a constant for the common sizes (fully unrolled), else the runtime D. */
#define DECODE_ITEM(NAME, T, LD, ST, HD)                                                       \
static void NAME(const T *q, int64_t q_s, int64_t q_h, const T *k, const T *v,                 \
                 const int32_t *bt, int L, T *out, int s, int kh, int H, int Hkv, int D,       \
                 int bs, float scale, int W, float cap, const float *sinks, float *qf) {       \
    const int G = H / Hkv;                                                                     \
    float *acc = qf + (size_t)G * HD, *sc = acc + (size_t)G * HD;                              \
    for (int g = 0; g < G; ++g) {                                                              \
        const T *qp = q + (int64_t)s * q_s + (int64_t)(kh * G + g) * q_h;                      \
        for (int d = 0; d < HD; ++d) { qf[g * HD + d] = LD(qp + d) * scale; acc[g * HD + d] = 0.f; } \
    }                                                                                          \
    if (L <= 0) { /* a padding row (no keys): zeros, and no read past the scratch */           \
        for (int i = 0; i < G * HD; ++i) ST(out + ((int64_t)s * H + kh * G) * HD + i, 0.f);    \
        return;                                                                                \
    }                                                                                          \
    const int start = (W > 0 && L > W) ? L - W : 0, N = L - start;                             \
    const int64_t row = (int64_t)Hkv * HD;                                                     \
    for (int l = start; l < L;) {                                                              \
        const int o0 = l % bs, n = bs - o0 < L - l ? bs - o0 : L - l;                          \
        const T *kr = k + ((int64_t)bt[l / bs] * bs + o0) * row + (int64_t)kh * HD;            \
        for (int o = 0; o < n; ++o, kr += row)                                                 \
            for (int g = 0; g < G; ++g) {                                                      \
                const float *qg = qf + g * HD; float dot = 0.f;                                \
                for (int d = 0; d < HD; ++d) dot += qg[d] * LD(kr + d);                        \
                sc[(size_t)g * N + l - start + o] = dot;                                       \
            }                                                                                  \
        l += n;                                                                                \
    }                                                                                          \
    /* the soft-cap in its own pass: the dot loop above stays branch-free for every other model */ \
    if (cap > 0.f)                                                                             \
        for (int i = 0; i < G * N; ++i) sc[i] = cap * tanhf(sc[i] / cap);                      \
    for (int g = 0; g < G; ++g) {                                                              \
        float *sg = sc + (size_t)g * N, m = sg[0], sum = 0.f;                                  \
        for (int l = 1; l < N; ++l) m = sg[l] > m ? sg[l] : m;                                 \
        if (sinks) { const float sk = sinks[kh * G + g]; m = sk > m ? sk : m; sum = expf(sk - m); } \
        for (int l = 0; l < N; ++l) { sg[l] = expf(sg[l] - m); sum += sg[l]; }                 \
        const float inv = 1.f / sum;                                                           \
        for (int l = 0; l < N; ++l) sg[l] *= inv;                                              \
    }                                                                                          \
    for (int l = start; l < L;) {                                                              \
        const int o0 = l % bs, n = bs - o0 < L - l ? bs - o0 : L - l;                          \
        const T *vr = v + ((int64_t)bt[l / bs] * bs + o0) * row + (int64_t)kh * HD;            \
        for (int o = 0; o < n; ++o, vr += row)                                                 \
            for (int g = 0; g < G; ++g) {                                                      \
                const float p = sc[(size_t)g * N + l - start + o]; float *ag = acc + g * HD;   \
                for (int d = 0; d < HD; ++d) ag[d] += p * LD(vr + d);                          \
            }                                                                                  \
        l += n;                                                                                \
    }                                                                                          \
    for (int g = 0; g < G; ++g) {                                                              \
        T *op = out + ((int64_t)s * H + kh * G + g) * HD;                                      \
        for (int d = 0; d < HD; ++d) ST(op + d, acc[g * HD + d]);                              \
    }                                                                                          \
}

/* q: [S, H, D] with strides (q_s, q_h, 1); cache planes k, v: [slots, Hkv, D] contiguous;
   block_table: [S, bt_s] int32; seq_lens: [S] int32 (0: a padding row, zeros); out: [S, H, D] contiguous;
   W: sliding window (0: none); cap: logit soft-cap (0: none); sinks: float32 [H] or NULL. */
#define DECODE_KERNEL(NAME, T, LD, ST)                                                        \
DECODE_ITEM(NAME##_d64, T, LD, ST, 64)                                                         \
DECODE_ITEM(NAME##_d128, T, LD, ST, 128)                                                       \
DECODE_ITEM(NAME##_dany, T, LD, ST, D)                                                         \
void NAME(const T *q, int64_t q_s, int64_t q_h, const T *k, const T *v,                      \
          const int32_t *block_table, int64_t bt_s, const int32_t *seq_lens, T *out,           \
          int S, int H, int Hkv, int D, int bs, float scale, int W, float cap,                 \
          const float *sinks, int nthreads) {                                                  \
    const int G = H / Hkv;                                                                     \
    _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                     \
    for (int w = 0; w < S * Hkv; ++w) {                                                        \
        const int s = w / Hkv, kh = w % Hkv, L = seq_lens[s];                                  \
        float *qf = (float *)malloc(sizeof(float) * (size_t)G * (2 * D + (L > 0 ? L : 0)));    \
        const int32_t *bt = block_table + (int64_t)s * bt_s;                                   \
        if (D == 64) NAME##_d64(q, q_s, q_h, k, v, bt, L, out, s, kh, H, Hkv, D, bs, scale, W, cap, sinks, qf); \
        else if (D == 128) NAME##_d128(q, q_s, q_h, k, v, bt, L, out, s, kh, H, Hkv, D, bs, scale, W, cap,  \
                                       sinks, qf);                                             \
        else NAME##_dany(q, q_s, q_h, k, v, bt, L, out, s, kh, H, Hkv, D, bs, scale, W, cap, sinks, qf); \
        free(qf);                                                                              \
    }                                                                                          \
}

DECODE_KERNEL(decode_attention_f32, float, ld_f32, st_f32)
DECODE_KERNEL(decode_attention_bf16, uint16_t, ld_bf16, st_bf16)
"""

# Reordered float32 sums so loops vectorize (c_build.py says why never -ffast-math).
_FLAGS = (*c_build.BASE_FLAGS, "-fassociative-math", "-fno-signed-zeros")
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
             ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Built (or loaded from the cache directory) once per process; None where it cannot be."""
    return c_build.load_library("cpu_decode", _SOURCE, _FLAGS,
                                {"decode_attention_f32": _ARGTYPES, "decode_attention_bf16": _ARGTYPES})


def available() -> bool:
    return _library() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype == q.dtype and kv_cache.is_contiguous() and q.stride(-1) == 1 and available())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [S, H, D] (last dim contiguous); kv_cache: [2, blocks, bs, Hkv, D]; block_table: int32 [S, W]
    contiguous; seq_lens: int32 [S] (each >= 1). Returns [S, H, D] attention of each q over its context
    (its last `sliding_window` keys when set; the table's entries before them are never read);
    `sinks` [H]: each head's sink logit joins its softmax's denominator."""
    lib = _library()
    assert lib is not None
    s, h, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    out = torch.empty((s, h, d), dtype=q.dtype)
    fn = lib.decode_attention_bf16 if q.dtype == torch.bfloat16 else lib.decode_attention_f32
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    fn(q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
       block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
       s, h, hkv, d, bs, scale, sliding_window or 0, logit_softcap or 0.0,
       None if sinks is None else sinks.data_ptr(), torch.get_num_threads())
    return out
