"""bf16 x bf16 GEMM on AMX tiles, float32 accumulation, with `cpu_bf16_gemm`'s three epilogues.

On AMX machines the packed `vdpbf16ps` GEMM of `cpu_bf16_gemm` (o_proj / down_proj into the float32
residual stream, `wide_linear`) ran ~7x slower than oneDNN's AMX kernels at prefill sizes; this one
does the same math on the tiles. It reads the same packed weight as `cpu_bf16_gemm` (one copy per
layer, packed once at load): [N/16][K/2 padded to 16][16][2], so the 16 k-pairs x 16 columns of one
k-block of one 16-column vector are one contiguous 1 KiB B tile in the VNNI layout `tdpbf16ps`
wants. Activations are loaded as A tiles in place (16 rows x 32 bf16; a tail of fewer than 16 rows
is copied into a zeroed 16-row block first). K must be a multiple of 32: `gemm` pads x otherwise
(the weight's padding is zeros).

Blocking: each OpenMP thread takes panels of up to 128 rows x 128 columns (finer column panels
when there are few rows, so both threads get work at decode sizes), in an order that reads the
bigger operand from memory once (column panels outer where the weight is bigger; else row panels
outer over L2-sized groups of the weight's columns), runs K in chunks of up to 1024 (A and B
chunks stay in L2), 2 x 2 tiles of 16 x 16 float32 accumulators at a time, and keeps the panel's
sums in a float32 buffer between chunks. Where the weight streams from memory (column panels outer:
decode steps, the LM head) the first row tiles prefetch it into L2 two vector pairs ahead: tiles are
not renamed, so a tile load waiting on memory holds up the next ones. The epilogue (AVX-512 intrinsics) runs on the finished
panel:
OUT_F32 `bias + acc (+ add)`, OUT_BF16 `round(bias + acc)`, OUT_SILU_MUL `round(up *
round(silu(gate)))` (the gate and up vectors interleaved as in `cpu_bf16_gemm.gate_up_rows`), with
`cpu_bf16_gemm`'s roundings and exp polynomial, so results agree with it within float32 summation
order (the tiles sum products pair by pair in float32 as `vdpbf16ps` does, in another order).

The same source builds a second time with `-DTM_AMX_EMULATE`: the tile registers become arrays,
`tdpbf16ps` a C loop with the same pair-wise float32 math and the epilogue plain C with the same
roundings, so the kernel's blocking, tails and epilogues are tested on any CPU (`emulated_library`).
The real build (`library`) exists only on the `amx` kernel path, after Linux granted the process
the tile state (arch_prctl ARCH_REQ_XCOMP_PERM); refused, it is None and callers keep their other kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from tokenmill.layers import c_build, c_common, cpu_bf16_gemm, cpu_isa

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#define OUT_F32 0
#define OUT_BF16 1
#define OUT_SILU_MUL 2
/* Panel and chunk sizes (overridable with -D for experiments; the variants measured alike here). */
#ifndef RP
#define RP 128        /* rows of a panel */
#endif
#ifndef PV_MAX
#define PV_MAX 8      /* 16-column vectors of a panel */
#endif
#ifndef KCB_MAX
#define KCB_MAX 32    /* k-blocks (of 32) per chunk */
#endif
#ifndef B_L2
#define B_L2 (1 << 20) /* bytes of the weight that row panels walk before the next columns (L2: 2 MiB) */
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 2    /* weight prefetch distance, in 2-vector steps (0: none) */
#endif
#ifndef PF_LOC
#define PF_LOC 2      /* its __builtin_prefetch locality (2: prefetcht1, into L2) */
#endif

#ifdef TM_AMX_EMULATE
/* Portable tiles: 8 registers of 16 rows x 64 bytes per thread; tdpbf16ps as the ISA defines it
   (per output, per k-pair: acc += a0 * b0, then acc += a1 * b1, products exact in float32). */
static _Thread_local union { unsigned char b[16][64]; float f[16][16]; uint16_t h[16][32]; } TM_T[8];
static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static void tm_zero(int t) { memset(&TM_T[t], 0, sizeof TM_T[t]); }
static void tm_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(TM_T[t].b[r], (const char *)p + r * stride, 64);
}
static void tm_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy((char *)p + r * stride, TM_T[t].b[r], 64);
}
static void tm_dp(int c, int a, int b) {
    for (int m = 0; m < 16; ++m)
        for (int k = 0; k < 16; ++k)
            for (int n = 0; n < 16; ++n) {
                float v = TM_T[c].f[m][n];
                v += bf2f(TM_T[a].h[m][2 * k]) * bf2f(TM_T[b].h[k][2 * n]);
                v += bf2f(TM_T[a].h[m][2 * k + 1]) * bf2f(TM_T[b].h[k][2 * n + 1]);
                TM_T[c].f[m][n] = v;
            }
}
#define TZERO(t) tm_zero(t)
#define TLOAD(t, p, s) tm_load(t, p, s)
#define TSTORE(t, p, s) tm_store(t, p, s)
#define TDP(c, a, b) tm_dp(c, a, b)
static void tiles_on(void) {}
static void tiles_off(void) {}
int amx_init(void) { return 0; }
#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TZERO(t) _tile_zero(t)
#define TLOAD(t, p, s) _tile_loadd(t, p, s)
#define TSTORE(t, p, s) _tile_stored(t, p, s)
#define TDP(c, a, b) _tile_dpbf16ps(c, a, b)
/* Palette 1, all 8 tiles 16 rows x 64 bytes: 0-3 accumulators, 4-5 A, 6-7 B. */
static void tiles_on(void) {
    unsigned char cfg[64] = {0};
    cfg[0] = 1;
    for (int t = 0; t < 8; ++t) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
    _tile_loadconfig(cfg);
}
static void tiles_off(void) { _tile_release(); }
/* Linux hands out the tile state only on request (once per process, for all its threads). */
int amx_init(void) {
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return -1;
    if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &bits) || !(bits & (1ul << 18))) return -2;
    return 0;
}
#endif

static const float ZEROS[32];

#ifdef TM_AMX_EMULATE
/* The epilogue's math on 16 lanes in plain C (the emulated build): bf16 rounding (nearest even;
   NaN stays NaN) and cpu_bf16_gemm's exp polynomial. */
static inline void to_bf16_16(const float *f, uint16_t *out) {
    uint32_t u[16];
    memcpy(u, f, 64);
    for (int i = 0; i < 16; ++i) {
        const uint32_t r = (u[i] & 0x7fffffffu) > 0x7f800000u ? (u[i] | 0x400000u) : u[i] + 0x7fffu + ((u[i] >> 16) & 1u);
        out[i] = (uint16_t)(r >> 16);
    }
}
static inline void bf16_round16(float *f) {
    uint16_t h[16]; uint32_t u[16];
    to_bf16_16(f, h);
    for (int i = 0; i < 16; ++i) u[i] = (uint32_t)h[i] << 16;
    memcpy(f, u, 64);
}
static inline void silu16(const float *g, float *s) {  /* s = g / (1 + exp(-g)) */
    float e[16]; int32_t bits[16];
    for (int i = 0; i < 16; ++i) {
        float x = -g[i];
        x = x > 88.0f ? 88.0f : x;
        x = x < -87.0f ? -87.0f : x;
        const float n = __builtin_rintf(x * 1.44269504088896341f);
        float r = __builtin_fmaf(-n, 0.693359375f, x);
        r = __builtin_fmaf(-n, -2.12194440e-4f, r);
        float p = 1.9875691500e-4f;
        p = __builtin_fmaf(p, r, 1.3981999507e-3f);
        p = __builtin_fmaf(p, r, 8.3334519073e-3f);
        p = __builtin_fmaf(p, r, 4.1665795894e-2f);
        p = __builtin_fmaf(p, r, 1.6666665459e-1f);
        p = __builtin_fmaf(p, r, 5.0000001201e-1f);
        e[i] = __builtin_fmaf(p * r, r, r + 1.0f);
        bits[i] = ((int32_t)n + 127) << 23;  /* 2^n: n in [-126, 127] after the clamp */
    }
    float scale[16];
    memcpy(scale, bits, 64);
    for (int i = 0; i < 16; ++i) s[i] = g[i] / (1.0f + e[i] * scale[i]);
}
#endif

typedef struct {
    const uint16_t *x; int64_t xs;          /* activations [R, K], row stride (elements) */
    const uint16_t *tail;                   /* the last R % 16 rows, zero-padded to 16 (K stride) */
    const uint16_t *wp; int64_t vstride;    /* packed weight, elements per 16-column vector */
    const float *bias;
    int R, K, NV, mode, ncols;
    void *y; int64_t ys;
    const float *add; int64_t as;
} job_t;

/* The A tile of 16 rows from `row` at k-block 0, and the byte stride between its rows. */
static inline const uint16_t *a_tile(const job_t *j, int row, int64_t *stride) {
    if (row + 16 <= j->R) { *stride = j->xs * 2; return j->x + row * j->xs; }
    *stride = (int64_t)j->K * 2;
    return j->tail;
}

/* Prefetch k-block kb of the two weight vectors from `pf` on (NULL: none): where the weight streams
   from memory, the tile loads wait on it with nothing else to do (tiles are not renamed, so the
   next loads cannot run ahead of the dot products); asking for the vectors PF_AHEAD steps ahead
   keeps the memory busy meanwhile. */
static inline void prefetch_b(const uint16_t *pf, int64_t vstride, int kb) {
    if (!pf) return;
    const char *p = (const char *)(pf + (int64_t)kb * 512), *q = p + 2 * vstride;
    for (int l = 0; l < 1024; l += 64) { __builtin_prefetch(p + l, 0, PF_LOC); __builtin_prefetch(q + l, 0, PF_LOC); }
}

/* Accumulate k-blocks [kb0, kb1) of rows r (1 or 2 row tiles: mt) x vectors v (1 or 2: nt) into
   acc (row stride ldc floats), starting from zero (`first`) or acc's sums; `pf` as prefetch_b. */
static void tile_step(const job_t *j, int r, int mt, int v, int nt, int kb0, int kb1, float *acc, int ldc,
                      int first, const uint16_t *pf) {
    const int64_t cb = (int64_t)ldc * 4;
    int64_t ab, ab1 = 0;
    const uint16_t *a0 = a_tile(j, r, &ab), *a1 = mt > 1 ? a_tile(j, r + 16, &ab1) : 0;
    const uint16_t *b0 = j->wp + v * j->vstride, *b1 = b0 + j->vstride;
    if (first) { TZERO(0); TZERO(1); TZERO(2); TZERO(3); }
    else {
        TLOAD(0, acc, cb); if (nt > 1) TLOAD(1, acc + 16, cb);
        if (mt > 1) { TLOAD(2, acc + 16 * ldc, cb); if (nt > 1) TLOAD(3, acc + 16 * ldc + 16, cb); }
    }
    if (mt > 1 && nt > 1) {
        for (int kb = kb0; kb < kb1; ++kb) {
            prefetch_b(pf, j->vstride, kb);
            TLOAD(4, a0 + kb * 32, ab); TLOAD(6, b0 + kb * 512, 64);
            TLOAD(5, a1 + kb * 32, ab1); TLOAD(7, b1 + kb * 512, 64);
            TDP(0, 4, 6); TDP(1, 4, 7); TDP(2, 5, 6); TDP(3, 5, 7);
        }
    } else if (nt > 1) {
        for (int kb = kb0; kb < kb1; ++kb) {
            prefetch_b(pf, j->vstride, kb);
            TLOAD(4, a0 + kb * 32, ab); TLOAD(6, b0 + kb * 512, 64); TLOAD(7, b1 + kb * 512, 64);
            TDP(0, 4, 6); TDP(1, 4, 7);
        }
    } else if (mt > 1) {
        for (int kb = kb0; kb < kb1; ++kb) {
            prefetch_b(pf, j->vstride, kb);
            TLOAD(4, a0 + kb * 32, ab); TLOAD(5, a1 + kb * 32, ab1); TLOAD(6, b0 + kb * 512, 64);
            TDP(0, 4, 6); TDP(2, 5, 6);
        }
    } else {
        for (int kb = kb0; kb < kb1; ++kb) {
            prefetch_b(pf, j->vstride, kb);
            TLOAD(4, a0 + kb * 32, ab); TLOAD(6, b0 + kb * 512, 64);
            TDP(0, 4, 6);
        }
    }
    TSTORE(0, acc, cb); if (nt > 1) TSTORE(1, acc + 16, cb);
    if (mt > 1) { TSTORE(2, acc + 16 * ldc, cb); if (nt > 1) TSTORE(3, acc + 16 * ldc + 16, cb); }
}

#ifdef TM_AMX_EMULATE
/* The epilogue of rows [r0, r1) x vectors [v0, v1) from acc (row r0, vector v0; stride ldc). */
static void epilogue(const job_t *j, const float *acc, int ldc, int r0, int r1, int v0, int v1) {
    for (int r = r0; r < r1; ++r) {
        const float *c = acc + (int64_t)(r - r0) * ldc;
        if (j->mode == OUT_SILU_MUL) {
            uint16_t *y = (uint16_t *)j->y + r * j->ys;
            for (int v = v0; v + 1 < v1; v += 2) {
                const float *g = c + 16 * (v - v0), *u = g + 16, *b = j->bias ? j->bias + 16 * v : ZEROS;
                const int col = 8 * v, n = j->ncols - col < 16 ? j->ncols - col : 16;
                float gv[16], s[16];
                uint16_t out[16];
                for (int i = 0; i < 16; ++i) gv[i] = g[i] + b[i];
                silu16(gv, s);
                bf16_round16(s);
                for (int i = 0; i < 16; ++i) s[i] *= u[i] + b[16 + i];
                to_bf16_16(s, out);
                memcpy(y + col, out, 2 * (size_t)n);
            }
            continue;
        }
        for (int v = v0; v < v1; ++v) {
            const int col = 16 * v, n = j->ncols - col < 16 ? j->ncols - col : 16;
            const float *cv = c + 16 * (v - v0), *b = j->bias ? j->bias + col : ZEROS;
            float t[16];
            for (int i = 0; i < 16; ++i) t[i] = cv[i] + b[i];
            if (j->mode == OUT_BF16) {
                uint16_t out[16];
                to_bf16_16(t, out);
                memcpy((uint16_t *)j->y + r * j->ys + col, out, 2 * (size_t)n);
            } else {
                float *y = (float *)j->y + r * j->ys + col;
                if (j->add) {
                    const float *a = j->add + r * j->as + col;
                    if (n == 16) for (int i = 0; i < 16; ++i) y[i] = a[i] + t[i];
                    else for (int i = 0; i < n; ++i) y[i] = a[i] + t[i];
                } else memcpy(y, t, 4 * (size_t)n);
            }
        }
    }
}

#else
/* The same epilogue on AVX-512 registers (cpu_bf16_gemm's instructions: its exp polynomial, cvtneps
   rounding), with masked loads and stores at the N tail: the plain C one above compiled to scalar
   adds through the stack and a store-forwarding stall per vector, ~40% of a prefill call. */
""" + c_common.AVX512_EXP_BF16 + r"""
static void epilogue(const job_t *j, const float *acc, int ldc, int r0, int r1, int v0, int v1) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int r = r0; r < r1; ++r) {
        const float *c = acc + (int64_t)(r - r0) * ldc;
        if (j->mode == OUT_SILU_MUL) {
            uint16_t *y = (uint16_t *)j->y + r * j->ys;
            for (int v = v0; v + 1 < v1; v += 2) {
                const float *g = c + 16 * (v - v0), *b = j->bias ? j->bias + 16 * v : ZEROS;
                const int col = 8 * v, n = j->ncols - col < 16 ? j->ncols - col : 16;
                const __m512 gv = _mm512_add_ps(_mm512_loadu_ps(g), _mm512_loadu_ps(b));
                const __m512 uv = _mm512_add_ps(_mm512_loadu_ps(g + 16), _mm512_loadu_ps(b + 16));
                const __m512 sv = bf16_round(_mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, gv)))));
                _mm256_mask_storeu_epi16(y + col, (__mmask16)((1u << n) - 1),
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(uv, sv)));
            }
            continue;
        }
        for (int v = v0; v < v1; ++v) {
            const int col = 16 * v, n = j->ncols - col < 16 ? j->ncols - col : 16;
            const __mmask16 mask = (__mmask16)((1u << n) - 1);
            __m512 t = _mm512_loadu_ps(c + 16 * (v - v0));
            if (j->bias) t = _mm512_add_ps(t, _mm512_loadu_ps(j->bias + col));
            if (j->mode == OUT_BF16) {
                _mm256_mask_storeu_epi16((uint16_t *)j->y + r * j->ys + col, mask, (__m256i)_mm512_cvtneps_pbh(t));
            } else {
                if (j->add) t = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, j->add + r * j->as + col), t);
                _mm512_mask_storeu_ps((float *)j->y + r * j->ys + col, mask, t);
            }
        }
    }
}
#endif

/* One panel: rows [r0, r1) x vectors [v0, v1), all of K, into the panel buffer acc, then out.
   `stream`: the panel's weight comes from memory (column panels outer); its first row tiles then
   prefetch the weight PF_AHEAD vector pairs ahead (into the next panel, which is this thread's
   next with the static schedule). */
static void panel(const job_t *j, int r0, int r1, int v0, int v1, float *acc, int stream) {
    const int ldc = 16 * (v1 - v0), KB = j->K / 32;
    const int nchunks = (KB + KCB_MAX - 1) / KCB_MAX, per = nchunks ? (KB + nchunks - 1) / nchunks : 0;
    for (int kb0 = 0; kb0 < KB; kb0 += per) {
        const int kb1 = kb0 + per < KB ? kb0 + per : KB;
        for (int r = r0; r < r1; r += 32)
            for (int v = v0; v < v1; v += 2)
                tile_step(j, r, r + 16 < r1 ? 2 : 1, v, v + 1 < v1 ? 2 : 1, kb0, kb1,
                          acc + (int64_t)(r - r0) * ldc + 16 * (v - v0), ldc, kb0 == 0,
                          PF_AHEAD && stream && r == r0 && v + 2 * PF_AHEAD < j->NV
                              ? j->wp + (int64_t)(v + 2 * PF_AHEAD) * j->vstride : 0);
    }
    epilogue(j, acc, ldc, r0, r1, v0, v1);
}

/* This thread's panel buffer, kept between calls (OpenMP's threads persist): no allocation per call. */
static float *panel_buffer(size_t floats) {
    static _Thread_local float *buf;
    static _Thread_local size_t cap;
    if (floats > cap) {
        free(buf);
        buf = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        cap = buf ? floats : 0;
    }
    return buf;
}

/* x: [R, K] bf16 (K a multiple of 32), row stride xs; wp: packed [NV][KPs][16][2] (KPs >= K/2);
   bias: NULL or float32 [16 NV] in packed column order; y: [R, ncols] float32 (OUT_F32) or bf16,
   row stride ys; add: NULL or float32 [R, ncols] (stride as), OUT_F32 only. Returns 0, or -1 where
   memory for the work buffers was refused (y then incomplete). */
int amx_gemm(const uint16_t *x, int64_t xs, const uint16_t *wp, int KPs, const float *bias, int R, int K,
              int NV, int mode, void *y, int64_t ys, int ncols, const float *add, int64_t as, int nthreads) {
    job_t j = {x, xs, 0, wp, (int64_t)KPs * 32, bias, R, K, NV, mode, ncols, y, ys, add, as};
    uint16_t *tail = 0;
    if (R % 16) {
        const int t0 = R - R % 16;
        tail = calloc((size_t)16 * K, 2);
        if (!tail) return -1;
        for (int r = t0; r < R; ++r) memcpy(tail + (int64_t)(r - t0) * K, x + r * xs, 2 * (size_t)K);
        j.tail = tail;
    }
    /* Panels: RP rows x pv vectors; with few row panels, narrower column panels so that every
       thread has several (2 vectors at the least: a gate/up pair stays in one panel). */
    const int nrp = (R + RP - 1) / RP;
    int pv = PV_MAX;
    while (pv > 2 && nrp * ((NV + pv - 1) / pv) < 4 * nthreads) pv /= 2;
    const int ncp = (NV + pv - 1) / pv, items = nrp * ncp;
    const int nt = nthreads < items ? nthreads : items;
    /* Panel order: where the weight is the bigger operand, column panels outer (it is read once, the
       activations from L2); else row panels outer within groups of column panels whose weight fits
       in L2 (B_L2 bytes), so each group's weight is read from memory once, then from L2. */
    const int bmajor = NV * 16 > R;
    const int gcp_fit = (int)(B_L2 / ((int64_t)pv * 16 * K * 2)), gcp = gcp_fit < 1 ? 1 : gcp_fit;
    int failed = 0;
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *acc = panel_buffer((size_t)RP * 16 * pv);
        tiles_on();
        #pragma omp for schedule(static)
        for (int t = 0; t < items; ++t) {
            const int g = t / (nrp * gcp), u = t % (nrp * gcp), gsz = ncp - g * gcp < gcp ? ncp - g * gcp : gcp;
            const int cp = bmajor ? t / nrp : g * gcp + u % gsz, rp = bmajor ? t % nrp : u / gsz;
            const int r0 = rp * RP, r1 = r0 + RP < R ? r0 + RP : R;
            const int v0 = cp * pv, v1 = v0 + pv < NV ? v0 + pv : NV;
            if (acc) panel(&j, r0, r1, v0, v1, acc, bmajor && rp == 0);  /* (later row panels: the weight is in L2) */
        }
        if (!acc) {
            #pragma omp atomic write
            failed = 1;
        }
        tiles_off();
    }
    free(tail);
    return failed ? -1 : 0;
}
"""

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
OUT_F32, OUT_BF16, OUT_SILU_MUL = cpu_bf16_gemm.OUT_F32, cpu_bf16_gemm.OUT_BF16, cpu_bf16_gemm.OUT_SILU_MUL


def _load(name: str, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    lib = c_build.load_library(name, _SOURCE, (*c_build.BASE_FLAGS, *flags),
                               {"amx_gemm": _ARGTYPES, "amx_init": []})
    if lib is None:
        return None
    lib.amx_init.restype = ctypes.c_int
    lib.amx_gemm.restype = ctypes.c_int
    status = lib.amx_init()
    if status:
        logger.warning("AMX tiles refused by the kernel (arch_prctl: %d): the AMX GEMM is off", status)
        return None
    return lib


_NATIVE_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The AMX build on a CPU that has AMX-BF16 (whatever path this process takes; tests), else None."""
    if not cpu_isa.can_run(cpu_isa.PATHS[0]):
        return None
    return _load("cpu_amx_gemm", _NATIVE_FLAGS)


def library() -> ctypes.CDLL | None:
    """The AMX build, on the `amx` kernel path only (None elsewhere, or where it cannot be built or
    Linux refuses the tile state). Follows `cpu_isa.kernel_path()` (tests force paths)."""
    return native_library() if cpu_isa.kernel_path().name == "amx" else None


@functools.cache
def emulated_library() -> ctypes.CDLL | None:
    """The same source with the tiles emulated in C (any CPU; tests)."""
    return _load("cpu_amx_gemm_emulated", ("-DTM_AMX_EMULATE",))


@functools.cache
def variant_library(emulated: bool, defines: tuple[str, ...]) -> ctypes.CDLL | None:
    """A build with other blocking constants (`defines`: "NAME=VALUE"; tests of the panel orders)."""
    if not emulated and not cpu_isa.can_run(cpu_isa.PATHS[0]):
        return None
    flags = ("-DTM_AMX_EMULATE",) if emulated else _NATIVE_FLAGS
    return _load("cpu_amx_gemm_variant", (*flags, *(f"-D{d}" for d in defines)))


def available() -> bool:
    return library() is not None


# Where the tiles win, measured on a 2-core Emerald Rapids VM (SmolLM2 and Llama-1B shapes,
# `scripts/cpu_amx_gemm_bench.py`, docs/results/cpu-amx-gemm.md):
# float32 out: vs the vdpbf16ps GEMM, every row count since the weight prefetch (weights cold, one
# thread: the LM head 5.1 vs 5.5 ms at 1 row, 5.2 vs 6.0 at 3; 30 layers' o_proj + down_proj 9.4 vs
# 9.5 ms at 1 row, 9.7 vs 10.6 at 3; without the prefetch the tiles were 10-30% slower at 1-3 rows).
F32_MIN_ROWS = 1
# bf16 out, vs oneDNN's AMX kernels: ahead while the activations (rows x K bf16) stay within ~1 MiB
# (SmolLM2's qkv, K 576: 1.2-1.7x at 32-128 rows, even at 1024; oneDNN 15% ahead at 2048. Llama-1B's,
# K 2048: 1.1x at 16-64 rows, oneDNN 10% ahead from 256).
BF16_MAX_ELEMENTS = 1 << 19
# [gate | up] silu-mul: every row count (one pass against oneDNN's two matmuls: 1.0-1.2x at 32-2048 rows).


def takes_f32(rows: int) -> bool:
    """Whether a float32-out bf16 GEMM of `rows` rows takes this kernel (the amx path only)."""
    return rows >= F32_MIN_ROWS and library() is not None


def takes_bf16(rows: int, k: int, silu_mul: bool = False) -> bool:
    """Whether a bf16-out (or [gate | up] silu-mul) bf16 linear of `rows` rows of `k` inputs takes
    this kernel over oneDNN."""
    return rows > 0 and (silu_mul or rows * k < BF16_MAX_ELEMENTS) and library() is not None


def gemm(x: torch.Tensor, weight: torch.Tensor, cache: cpu_bf16_gemm.PackedBf16, *, bias: torch.Tensor | None = None,
         add: torch.Tensor | None = None, mode: int = OUT_F32, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`cpu_bf16_gemm.gemm` on AMX tiles (same arguments, packing cache and results within float32
    summation order); `lib` defaults to the AMX build (`available()` must be True)."""
    lib = lib or library()
    assert lib is not None
    # whole k-blocks of 32: zero columns (the packed weight has zero rows there)
    x2, out, a2, width, gate_up = cpu_bf16_gemm.gemm_operands(x, weight, mode, add, k_multiple=32)
    if x2.shape[0]:
        packed = cache.get(weight, bias, gate_up)
        b = cache.bias
        status = lib.amx_gemm(x2.data_ptr(), x2.stride(0), packed.data_ptr(), packed.shape[1],
                              None if b is None else b.data_ptr(), x2.shape[0], x2.shape[1], packed.shape[0],
                              mode, out.data_ptr(), out.stride(0), width, None if a2 is None else a2.data_ptr(),
                              0 if a2 is None else a2.stride(0), torch.get_num_threads())
        if status:
            raise MemoryError("cpu_amx_gemm: work buffers refused")
    return out
