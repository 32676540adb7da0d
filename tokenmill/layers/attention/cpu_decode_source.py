"""The C source of `cpu_decode`'s kernel (what it computes and how: `cpu_decode`'s docstring).

One text for every `cpu_isa` path, the instruction set picked by the build's flags (`#if`): a vector
layer of VL float lanes per instruction set (AVX-512F, AVX2 + FMA, portable GCC vectors), the
per-head kernel written over it, and, where AVX-512F is, the bf16 path (`dp_*`). Knobs set by -D at
build time: QK_DP (bf16 q.k by vdpbf16ps; `cpu_decode.build_flags`), DP_PF_HINT and DP_PF_TILES (the
bf16 path's prefetch locality and distance).
"""

from __future__ import annotations

from tokenmill.layers import c_common

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16  /* keys per tile */
#define MIN_PARALLEL_PAIRS 16384

""" + c_common.BF16_SCALAR + r"""
/* ---- the vector layer: VL float lanes per vector ---- */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693145751953125f      /* ln 2 in two parts (Cody-Waite range reduction) */
#define LN2_LO 1.42860682030941723e-06f
/* e^r on |r| <= ln2/2: Taylor to degree 7 (truncation < 1e-8 relative), Horner with FMAs */
#define EXP_POLY(FMA, SET1, r) \
    FMA(FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.f / 5040), r, SET1(1.f / 720)), r, SET1(1.f / 120)), r, \
        SET1(1.f / 24)), r, SET1(1.f / 6)), r, SET1(0.5f)), r, SET1(1.f)), r, SET1(1.f))

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vf;
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_set1 _mm512_set1_ps
#define v_zero _mm512_setzero_ps
#define v_fma _mm512_fmadd_ps
#define v_sub _mm512_sub_ps
#define v_add _mm512_add_ps
static inline vf v_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf v_exp(vf x) {  /* below -104 (e^x under the smallest subnormal), -inf included: 0 */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));
    const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    return _mm512_scalef_ps(EXP_POLY(_mm512_fmadd_ps, _mm512_set1_ps, r), n);
}
/* Lane i of the result: the sum of v[i]'s lanes (16 vectors reduced together, ~3 ops each). */
/* Every lane: the max (sum) of v's lanes, in registers (GCC's _mm512_reduce_*_ps goes through memory). */
static inline vf v_allmax(vf v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_max_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}
static inline vf v_alladd(vf v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}
static inline float v_hmax(vf v) { return _mm512_cvtss_f32(v_allmax(v)); }
static inline float v_hadd(vf v) { return _mm512_cvtss_f32(v_alladd(v)); }
/* v_hsum's stages for the bf16 path too: dp_hsum8 reduces 8 rows' partial-sum vectors by the first
   three; dp_hsum_join, the last, joins two such results (lane j: row j's sum, rows 0-7 in c0, 8-15 in c1). */
static inline vf dp_hsum_join(vf c0, vf c1) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline vf dp_hsum8(const vf *v) {
    vf a[4], b[2];
    for (int i = 0; i < 4; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return dp_hsum_join(b[0], b[1]);
}
static inline vf v_hsum(const vf *v) { return dp_hsum_join(dp_hsum8(v), dp_hsum8(v + 8)); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef __m256 vf;
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_set1 _mm256_set1_ps
#define v_zero _mm256_setzero_ps
#define v_fma _mm256_fmadd_ps
#define v_sub _mm256_sub_ps
#define v_add _mm256_add_ps
static inline vf v_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf v_exp(vf x) {  /* below -87.3 (2^n would leave the normal range), -inf included: 0 */
    const vf tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
    const vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(EXP_POLY(_mm256_fmadd_ps, _mm256_set1_ps, r), _mm256_castsi256_ps(e)));
}
static inline float v_hmax(vf v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline float v_hadd(vf v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
static inline vf v_hsum(const vf *v) {
    vf a[4], b[2];
    for (int i = 0; i < 4; ++i)
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#else  /* portable: GCC vector extensions, 4 lanes (SSE2, NEON: every 64-bit target has them) */
#define VL 4
typedef float vf __attribute__((vector_size(16)));
static inline vf v_load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void v_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf v_set1(float x) { return (vf){0} + x; }
static inline vf v_zero(void) { return (vf){0}; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }  /* contracted to FMAs where the target has them */
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_add(vf a, vf b) { return a + b; }
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(8)));
static inline vf v_load_bf16(const uint16_t *p) {
    vh h; memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline vf v_select(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }  /* m ? a : b */
static inline vf v_exp(vf x) {  /* below -87.3 (2^n would leave the normal range), -inf included: 0 */
    const vi tiny = x < -87.3f;
    x = v_select(x < -87.3f, v_set1(-87.3f), x);
    x = v_select(x > 88.f, v_set1(88.f), x);
    const vf big = v_set1(12582912.f);  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const vf n = (x * LOG2E + big) - big;
    vf r = x - n * LN2_HI;
    r = r - n * LN2_LO;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return v_select(tiny, v_zero(), EXP_POLY(v_fma, v_set1, r) * (vf)e);
}
static inline vf v_hsum(const vf *v) {
    vf r;
    for (int i = 0; i < VL; ++i) r[i] = (v[i][0] + v[i][2]) + (v[i][1] + v[i][3]);
    return r;
}
static inline float v_hmax(vf v) { float m = v[0]; for (int i = 1; i < VL; ++i) m = v[i] > m ? v[i] : m; return m; }
static inline float v_hadd(vf v) { return (v[0] + v[2]) + (v[1] + v[3]); }
#endif

typedef struct {
    const void *q; int64_t q_s, q_h;
    const void *k, *v;
    const int32_t *bt; int64_t bt_s;
    const int32_t *lens;
    void *out;
    int S, H, Hkv, D, Dp, bs, W, bf16, dp;  /* Dp: D rounded up to VL; dp: bf16 q.k by vdpbf16ps */
    float scale, cap;
    const float *sinks;
} args_t;

/* A tile is always TILE rows: off[j] is row j's offset from the tile's first row, and rows past
   the n in the block repeat the last one (their scores are masked, their weights are 0), so every
   loop below has a constant trip count and the 16 partial sums stay in registers. */

/* The tile's rows (bf16 or float32) as float32 rows of Dp, zero padded past D. */
static void widen_tile(const void *src, int bf16, const int64_t *off, int n, int D, int Dp, float *dst) {
    for (int j = 0; j < n; ++j) {
        float *d = dst + (size_t)j * Dp;
        int x = 0;
        if (bf16) {
            const uint16_t *s = (const uint16_t *)src + off[j];
            for (; x + VL <= D; x += VL) v_store(d + x, v_load_bf16(s + x));
            for (; x < D; ++x) d[x] = ld_bf16(s[x]);
        } else {
            memcpy(d, (const float *)src + off[j], sizeof(float) * (size_t)D);
            x = D;
        }
        for (; x < Dp; ++x) d[x] = 0.f;
    }
}

/* Scores of G float32 query rows qf [G, Dp] against the tile's key rows: sc [G, TILE]. */
static void tile_scores(const float *qf, int G, int Dp, const float *kp, const int64_t *off, float *sc) {
    const int C = Dp / VL;
    for (int g = 0; g < G; ++g) {
        const float *qg = qf + (size_t)g * Dp;
        vf part[TILE];
        for (int j = 0; j < TILE; ++j) part[j] = v_zero();
        for (int c = 0; c < C; ++c) {
            const vf qc = v_load(qg + c * VL);
            for (int j = 0; j < TILE; ++j) part[j] = v_fma(qc, v_load(kp + off[j] + c * VL), part[j]);
        }
        for (int j = 0; j < TILE; j += VL) v_store(sc + g * TILE + j, v_hsum(part + j));
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DP 1
/* As tile_scores, for bf16 q rows (q_h apart) and bf16 key rows, D a multiple of 32, times scale. */
static void tile_scores_dp(const uint16_t *q, int64_t q_h, int G, int D, float scale, const uint16_t *kp,
                           const int64_t *off, float *sc) {
    const int C = D / 32;
    for (int g = 0; g < G; ++g) {
        const uint16_t *qg = q + g * q_h;
        vf part[TILE];
        for (int j = 0; j < TILE; ++j) part[j] = v_zero();
        for (int c = 0; c < C; ++c) {
            const __m512bh qc = (__m512bh)_mm512_loadu_si512(qg + c * 32);
            for (int j = 0; j < TILE; ++j)
                part[j] = _mm512_dpbf16_ps(part[j], qc, (__m512bh)_mm512_loadu_si512(kp + off[j] + c * 32));
        }
        _mm512_storeu_ps(sc + g * TILE, _mm512_mul_ps(v_hsum(part), _mm512_set1_ps(scale)));
    }
}
#else
#define HAVE_DP 0
#endif

/* acc [G, Dp] += p [G, TILE] x the tile's float32 value rows: 4 vectors of acc at a time, as 8
   FMA chains (even and odd rows) so that the FMAs' latency hides. */
static void tile_values(const float *p, int G, int Dp, const float *vp, const int64_t *off, float *acc) {
    const int C = Dp / VL;
    for (int g = 0; g < G; ++g) {
        const float *pg = p + g * TILE;
        float *ag = acc + (size_t)g * Dp;
        int c = 0;
        for (; c + 4 <= C; c += 4) {
            vf a0 = v_load(ag + c * VL), a1 = v_load(ag + (c + 1) * VL), a2 = v_load(ag + (c + 2) * VL),
               a3 = v_load(ag + (c + 3) * VL), b0 = v_zero(), b1 = v_zero(), b2 = v_zero(), b3 = v_zero();
            for (int j = 0; j < TILE; j += 2) {
                const vf pj = v_set1(pg[j]), pk = v_set1(pg[j + 1]);
                const float *vr = vp + off[j] + c * VL, *vs = vp + off[j + 1] + c * VL;
                a0 = v_fma(pj, v_load(vr), a0); a1 = v_fma(pj, v_load(vr + VL), a1);
                a2 = v_fma(pj, v_load(vr + 2 * VL), a2); a3 = v_fma(pj, v_load(vr + 3 * VL), a3);
                b0 = v_fma(pk, v_load(vs), b0); b1 = v_fma(pk, v_load(vs + VL), b1);
                b2 = v_fma(pk, v_load(vs + 2 * VL), b2); b3 = v_fma(pk, v_load(vs + 3 * VL), b3);
            }
            v_store(ag + c * VL, v_add(a0, b0)); v_store(ag + (c + 1) * VL, v_add(a1, b1));
            v_store(ag + (c + 2) * VL, v_add(a2, b2)); v_store(ag + (c + 3) * VL, v_add(a3, b3));
        }
        for (; c < C; ++c) {
            vf a = v_load(ag + c * VL), b = v_zero();
            for (int j = 0; j < TILE; j += 2) {
                a = v_fma(v_set1(pg[j]), v_load(vp + off[j] + c * VL), a);
                b = v_fma(v_set1(pg[j + 1]), v_load(vp + off[j + 1] + c * VL), b);
            }
            v_store(ag + c * VL, v_add(a, b));
        }
    }
}

/* The same for value rows read in place (bf16 widened in registers, or float32), G query heads
   at once (G known when compiled): each row is loaded once for all G, 4 vectors of acc per head
   in registers. D must be a multiple of 4 vectors. */
#define TILE_VALUES_G(GG, SUFFIX, T, LOADV)                                                         \
static void tile_values_##SUFFIX##GG(const float *p, int D, const T *vp, const int64_t *off, float *acc) { \
    for (int c = 0; c < D; c += 4 * VL) {                                                        \
        vf a[GG][4];                                                                              \
        for (int g = 0; g < GG; ++g)                                                              \
            for (int i = 0; i < 4; ++i) a[g][i] = v_load(acc + g * D + c + i * VL);               \
        for (int j = 0; j < TILE; ++j) {                                                          \
            const T *r = vp + off[j] + c;                                                         \
            const vf v0 = LOADV(r), v1 = LOADV(r + VL), v2 = LOADV(r + 2 * VL), v3 = LOADV(r + 3 * VL); \
            for (int g = 0; g < GG; ++g) {                                                        \
                const vf pg = v_set1(p[g * TILE + j]);                                            \
                a[g][0] = v_fma(pg, v0, a[g][0]); a[g][1] = v_fma(pg, v1, a[g][1]);               \
                a[g][2] = v_fma(pg, v2, a[g][2]); a[g][3] = v_fma(pg, v3, a[g][3]);               \
            }                                                                                     \
        }                                                                                         \
        for (int g = 0; g < GG; ++g)                                                              \
            for (int i = 0; i < 4; ++i) v_store(acc + g * D + c + i * VL, a[g][i]);               \
    }                                                                                             \
}
#define TILE_VALUES_ALL(GG) TILE_VALUES_G(GG, f32_, float, v_load) TILE_VALUES_G(GG, bf16_, uint16_t, v_load_bf16)
TILE_VALUES_ALL(1) TILE_VALUES_ALL(2) TILE_VALUES_ALL(3) TILE_VALUES_ALL(4) TILE_VALUES_ALL(5) TILE_VALUES_ALL(6)

/* tile_values straight from the cache rows where a specialization fits; 0 where none does. */
static int tile_values_direct(const float *p, int G, int D, const void *vp, int bf16, const int64_t *off, float *acc) {
    if (D % (4 * VL) != 0) return 0;
#define CASE(GG) case GG: if (bf16) tile_values_bf16_##GG(p, D, (const uint16_t *)vp, off, acc); \
                          else tile_values_f32_##GG(p, D, (const float *)vp, off, acc); return 1;
    switch (G) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) default: return 0; }
#undef CASE
}

/* Asks for the K and V rows of the tile starting at key t while this one is computed: in a model
   the cache comes from memory (the layers' weights pass through the caches between two calls), and
   the next tile is often in another block, which no hardware prefetcher guesses. */
static inline void prefetch_tile(const args_t *a, const int32_t *bt, int kh, int t, int l1, int64_t row, size_t esz) {
    const int bs = a->bs, o = t % bs, left = l1 - t;
    int n = bs - o < left ? bs - o : left;
    n = n < TILE ? n : TILE;
    const int64_t base = (((int64_t)bt[t / bs] * bs + o) * row + (int64_t)kh * a->D) * (int64_t)esz;
    const char *k = (const char *)a->k + base, *v = (const char *)a->v + base;
    for (int j = 0; j < n; ++j)
        for (size_t b = 0; b < (size_t)a->D * esz; b += 64) {
            __builtin_prefetch(k + j * row * (int64_t)esz + b);
            __builtin_prefetch(v + j * row * (int64_t)esz + b);
        }
}

/* Keys [l0, l1) of sequence s for KV head kh, as an unnormalized softmax: per query head g the
   running max m[g], denominator l[g] and weighted sum of values acc[g * Dp ...] (float32). */
static void attend_range(const args_t *a, int s, int kh, int l0, int l1, float *m, float *l, float *acc) {
    const int G = a->H / a->Hkv, D = a->D, Dp = a->Dp, bs = a->bs;
    const int64_t row = (int64_t)a->Hkv * D, qoff = (int64_t)s * a->q_s + (int64_t)kh * G * a->q_h;
    const int32_t *bt = a->bt + (int64_t)s * a->bt_s;
    float qf[G * Dp], sc[G * TILE], kt[TILE * Dp], vt[TILE * Dp];
    const int dp = a->dp && HAVE_DP;
    const int raw_f32 = !a->bf16 && Dp == D;  /* float32 rows read in place */
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY; l[g] = 0.f;
        for (int x = 0; x < Dp; ++x) acc[g * Dp + x] = 0.f;
        if (dp) continue;
        for (int x = 0; x < Dp; ++x) {
            const int64_t i = qoff + g * a->q_h + x;
            const float qv = x >= D ? 0.f : a->bf16 ? ld_bf16(((const uint16_t *)a->q)[i]) : ((const float *)a->q)[i];
            qf[g * Dp + x] = qv * a->scale;
        }
    }
    const size_t esz = a->bf16 ? 2 : 4;
    int64_t off[TILE], woff[TILE];  /* rows in the cache; rows in the widened scratch */
    for (int j = 0; j < TILE; ++j) woff[j] = (int64_t)j * Dp;
    for (int t = l0; t < l1;) {
        const int o0 = t % bs, left = l1 - t;
        int n = bs - o0 < left ? bs - o0 : left;
        n = n < TILE ? n : TILE;
        for (int j = 0; j < TILE; ++j) off[j] = (int64_t)(j < n ? j : n - 1) * row;
        if (n < TILE) for (int j = n; j < TILE; ++j) woff[j] = (int64_t)(n - 1) * Dp;
        const int64_t base = ((int64_t)bt[t / bs] * bs + o0) * row + (int64_t)kh * D;
        const void *kr = (const char *)a->k + base * esz, *vr = (const char *)a->v + base * esz;
        if (t + n < l1) prefetch_tile(a, bt, kh, t + n, l1, row, esz);
#if HAVE_DP
        if (dp) {
            tile_scores_dp((const uint16_t *)a->q + qoff, a->q_h, G, D, a->scale, (const uint16_t *)kr, off, sc);
        } else
#endif
        if (raw_f32) {
            tile_scores(qf, G, Dp, (const float *)kr, off, sc);
        } else {
            widen_tile(kr, a->bf16, off, n, D, Dp, kt);
            tile_scores(qf, G, Dp, kt, woff, sc);
        }
        if (a->cap > 0.f)
            for (int i = 0; i < G * TILE; ++i) sc[i] = a->cap * tanhf(sc[i] / a->cap);
        for (int g = 0; g < G; ++g) {
            float *sg = sc + g * TILE, tm = -INFINITY;
            for (int j = n; j < TILE; ++j) sg[j] = -INFINITY;
            for (int j = 0; j < TILE; j += VL) { const float x = v_hmax(v_load(sg + j)); tm = x > tm ? x : tm; }
            const float mn = m[g] > tm ? m[g] : tm;
            float sum = 0.f;
            for (int j = 0; j < TILE; j += VL) {
                const vf e = v_exp(v_sub(v_load(sg + j), v_set1(mn)));
                v_store(sg + j, e);
                sum += v_hadd(e);
            }
            if (mn != m[g]) {  /* a new max: rescale what came before */
                const float alpha = expf(m[g] - mn);
                l[g] *= alpha;
                for (int x = 0; x < Dp; ++x) acc[g * Dp + x] *= alpha;
                m[g] = mn;
            }
            l[g] += sum;
        }
        if (Dp == D && tile_values_direct(sc, G, D, vr, a->bf16, off, acc)) {
        } else if (raw_f32) {
            tile_values(sc, G, Dp, (const float *)vr, off, acc);
        } else {
            widen_tile(vr, a->bf16, off, n, D, Dp, vt);
            tile_values(sc, G, Dp, vt, woff, acc);
        }
        if (n < TILE) for (int j = n; j < TILE; ++j) woff[j] = (int64_t)j * Dp;
        t += n;
    }
}

#if defined(__AVX512F__)
/* ---- The fast bf16 path (AVX-512, bf16 cache, D = 64 or 128, the GQA ratios dp_attend lists). ----
   A work item takes nkh KV heads of one sequence (all of them when there are enough sequences),
   so each tile is one pass over a stretch of one block's rows, contiguous in the cache, for all of
   them. bf16 rows are widened in registers without reordering lanes: the even elements of 32 by a
   shift, the odd ones by a mask, each FMA'd against q's (or the weights') matching half; the value
   accumulators hold the even dims, then the odd ones, of each 32 (dp_range restores the order at
   the end). Scores: the 16 K rows' partial sums per query head reduced together (v_hsum), in two
   halves of 8 rows so that 3 heads' partial sums stay in registers; by vdpbf16ps where that is
   the faster instruction (QK_DP: the avx512_bf16 path; on AMX CPUs a zmm vdpbf16ps costs 4 FMAs'
   time, so FMAs on widened rows, exact alike: a bf16 x bf16 product is exact in float32).
   Softmax in float32 as everywhere: per-lane denominators, summed at the end. */
#define DP_MAXG 4
#ifndef QK_DP
#define QK_DP HAVE_DP
#endif
#ifndef DP_PF_HINT
#define DP_PF_HINT 3
#endif
#ifndef DP_PF_TILES
#define DP_PF_TILES 1  /* tiles (of all the item's heads) prefetched ahead */
#endif

static inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf16_odd(__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u))); }

/* Keys [x0, x1) of sequence s, heads [kh0, kh0 + nkh): K and V rows asked for ahead. */
static void dp_prefetch(const args_t *a, const int32_t *bt, int kh0, int nkh, int x0, int x1) {
    const int bs = a->bs, D = a->D;
    const int64_t row = (int64_t)a->Hkv * D;
    for (int x = x0; x < x1;) {
        const int o = x % bs, n = bs - o < x1 - x ? bs - o : x1 - x;
        const int64_t first = ((int64_t)bt[x / bs] * bs + o) * row + (int64_t)kh0 * D;
        const char *k = (const char *)((const uint16_t *)a->k + first), *v = (const char *)((const uint16_t *)a->v + first);
        const int64_t rb = row * 2, span = (int64_t)nkh * D * 2;
        for (int j = 0; j < n; ++j)
            for (int64_t b = 0; b < span; b += 64) {
                __builtin_prefetch(k + j * rb + b, 0, DP_PF_HINT);
                __builtin_prefetch(v + j * rb + b, 0, DP_PF_HINT);
            }
        x += n;
    }
}

/* v_hsum's first two stages over 4 rows, then its third over two such results. */
static inline __m512 dp_hsum4(const __m512 *v) {
    const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* One tile (n <= TILE rows, off[j]: row j's offset, rows past n repeating the last) for one KV
   head: qe/qo [G, 16 C] q's even and odd elements as float32 (FMA flavour), the G query heads'
   running max m, per-lane denominators ls [G, 16] and accumulators acc [G, 32 C] (even dims then
   odd dims of each 32). */
static inline __attribute__((always_inline)) void dp_tile(
        const int G, const int C, const uint16_t *q, int64_t q_h, const float *qe, const float *qo, float scale,
        float cap, const uint16_t *kr, const uint16_t *vr, const int64_t *off, int n, float *m, float *ls, float *acc) {
    __m512 s[DP_MAXG];
#if QK_DP
    (void)qe; (void)qo;
    __m512 half[DP_MAXG];
    for (int h = 0; h < 2; ++h)
        for (int g = 0; g < G; ++g) {
            const uint16_t *qg = q + g * q_h;
            __m512 part[TILE / 2];
            for (int j = 0; j < TILE / 2; ++j) part[j] = _mm512_setzero_ps();
            for (int c = 0; c < C; ++c) {
                const __m512bh qc = (__m512bh)_mm512_loadu_si512(qg + c * 32);
                for (int j = 0; j < TILE / 2; ++j)
                    part[j] = _mm512_dpbf16_ps(part[j], qc, (__m512bh)_mm512_loadu_si512(kr + off[8 * h + j] + c * 32));
            }
            const __m512 r = dp_hsum8(part);
            if (h == 0) half[g] = r; else s[g] = dp_hsum_join(half[g], r);
        }
#else
    (void)q; (void)q_h;
    /* 4 rows at a time, q's halves in registers: 3 heads' 4 partial sums, 12 q vectors at D = 64 */
    __m512 qv[DP_MAXG][8], b[DP_MAXG], c0[DP_MAXG];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) {
            qv[g][2 * c] = _mm512_loadu_ps(qe + (g * C + c) * 16);
            qv[g][2 * c + 1] = _mm512_loadu_ps(qo + (g * C + c) * 16);
        }
    #pragma GCC unroll 1  /* (the rows' loops stay loops: build time) */
    for (int r = 0; r < TILE / 4; ++r) {
        __m512 part[DP_MAXG][4];
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < 4; ++j) part[g][j] = _mm512_setzero_ps();
        for (int j = 0; j < 4; ++j)
            for (int c = 0; c < C; ++c) {
                const __m512i kx = _mm512_loadu_si512(kr + off[4 * r + j] + c * 32);
                const __m512 ke = bf16_even(kx), ko = bf16_odd(kx);
                for (int g = 0; g < G; ++g)
                    part[g][j] = _mm512_fmadd_ps(ko, qv[g][2 * c + 1], _mm512_fmadd_ps(ke, qv[g][2 * c], part[g][j]));
            }
        for (int g = 0; g < G; ++g) {
            const __m512 x = dp_hsum4(part[g]);
            if (r % 2 == 0) b[g] = x;
            else if (r == 1) c0[g] = dp_hsum_join(b[g], x);
            else s[g] = dp_hsum_join(c0[g], dp_hsum_join(b[g], x));
        }
    }
#endif
    for (int g = 0; g < G; ++g) s[g] = _mm512_mul_ps(s[g], _mm512_set1_ps(scale));
    if (cap > 0.f)
        for (int g = 0; g < G; ++g) {
            float t[TILE];
            _mm512_storeu_ps(t, s[g]);
            for (int j = 0; j < TILE; ++j) t[j] = cap * tanhf(t[j] / cap);
            s[g] = _mm512_loadu_ps(t);
        }
    const __mmask16 valid = (__mmask16)(n >= TILE ? 0xffff : (1u << n) - 1);
    float w[DP_MAXG][TILE];  /* the tile's softmax weights */
    for (int g = 0; g < G; ++g) {
        const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s[g]);
        const float tm = v_hmax(x), mn = m[g] > tm ? m[g] : tm;
        const __m512 e = v_exp(_mm512_sub_ps(x, _mm512_set1_ps(mn)));
        __m512 l = _mm512_loadu_ps(ls + g * TILE);
        if (mn != m[g]) {  /* a new max: rescale what came before */
            const __m512 alpha = _mm512_set1_ps(expf(m[g] - mn));
            l = _mm512_mul_ps(l, alpha);
            for (int i = 0; i < 2 * C; ++i)
                _mm512_storeu_ps(acc + g * 32 * C + i * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + g * 32 * C + i * 16), alpha));
            m[g] = mn;
        }
        _mm512_storeu_ps(ls + g * TILE, _mm512_add_ps(l, e));
        _mm512_storeu_ps(w[g], e);
    }
    /* weights x V: each row widened once for the G heads, 2 C accumulators a head in registers */
    __m512 x[DP_MAXG][8];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2 * C; ++i) x[g][i] = _mm512_loadu_ps(acc + g * 32 * C + i * 16);
    #pragma GCC unroll 2
    for (int j = 0; j < TILE; ++j) {
        __m512 vw[8];
        for (int c = 0; c < C; ++c) {
            const __m512i vx = _mm512_loadu_si512(vr + off[j] + c * 32);
            vw[2 * c] = bf16_even(vx);
            vw[2 * c + 1] = bf16_odd(vx);
        }
        for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(w[g][j]);
            for (int i = 0; i < 2 * C; ++i) x[g][i] = _mm512_fmadd_ps(p, vw[i], x[g][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2 * C; ++i) _mm512_storeu_ps(acc + g * 32 * C + i * 16, x[g][i]);
}

/* Keys [l0, l1) of sequence s for KV heads [kh0, kh0 + nkh): per head k, the state of its G query
   heads at st + k * G * (2 + D): running max [G], denominator [G], weighted sum of values [G, D]. */
static inline __attribute__((always_inline)) void dp_range(const int G, const int C, const args_t *a, int s,
                                                            int kh0, int nkh, int l0, int l1, float *st) {
    const int D = 32 * C, bs = a->bs;
    const int64_t row = (int64_t)a->Hkv * D, seg = (int64_t)G * (2 + D);
    const int32_t *bt = a->bt + (int64_t)s * a->bt_s;
    const uint16_t *q = (const uint16_t *)a->q + (int64_t)s * a->q_s;
    float ls[nkh * G * TILE], qe[nkh * G * 16 * C], qo[nkh * G * 16 * C];
    for (int k = 0; k < nkh; ++k) {
        float *sk = st + k * seg;
        for (int g = 0; g < G; ++g) sk[g] = -INFINITY;
        memset(sk + 2 * G, 0, sizeof(float) * (size_t)G * D);
#if !QK_DP
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) {
                const __m512i qx = _mm512_loadu_si512(q + (int64_t)((kh0 + k) * G + g) * a->q_h + c * 32);
                _mm512_storeu_ps(qe + ((k * G + g) * C + c) * 16, bf16_even(qx));
                _mm512_storeu_ps(qo + ((k * G + g) * C + c) * 16, bf16_odd(qx));
            }
#endif
    }
    memset(ls, 0, sizeof ls);
    int64_t off[TILE];
    const int pf = DP_PF_TILES * TILE;
    dp_prefetch(a, bt, kh0, nkh, l0, l0 + pf < l1 ? l0 + pf : l1);
    for (int t = l0; t < l1;) {
        const int o0 = t % bs, left = l1 - t;
        int n = bs - o0 < left ? bs - o0 : left;
        n = n < TILE ? n : TILE;
        const int p0 = t + pf < l1 ? t + pf : l1, p1 = t + n + pf < l1 ? t + n + pf : l1;
        if (p0 < p1) dp_prefetch(a, bt, kh0, nkh, p0, p1);
        for (int j = 0; j < TILE; ++j) off[j] = (int64_t)(j < n ? j : n - 1) * row;
        const int64_t base = ((int64_t)bt[t / bs] * bs + o0) * row;
        for (int k = 0; k < nkh; ++k) {
            const int kh = kh0 + k;
            float *sk = st + k * seg;
            const int64_t hb = base + (int64_t)kh * D;
            dp_tile(G, C, q + (int64_t)kh * G * a->q_h, a->q_h, qe + k * G * 16 * C, qo + k * G * 16 * C, a->scale,
                    a->cap, (const uint16_t *)a->k + hb, (const uint16_t *)a->v + hb, off, n, sk, ls + k * G * TILE,
                    sk + 2 * G);
        }
        t += n;
    }
    for (int k = 0; k < nkh; ++k) {  /* denominators summed, accumulators back in dim order */
        float *sk = st + k * seg;
        for (int g = 0; g < G; ++g) {
            sk[G + g] = v_hadd(_mm512_loadu_ps(ls + (k * G + g) * TILE));
            float *x = sk + 2 * G + g * D, tmp[32];
            for (int c = 0; c < C; ++c) {
                memcpy(tmp, x + c * 32, sizeof tmp);
                for (int i = 0; i < 16; ++i) { x[c * 32 + 2 * i] = tmp[i]; x[c * 32 + 2 * i + 1] = tmp[16 + i]; }
            }
        }
    }
}

/* dp_range specialized for G and C known when compiled (each costs ~0.6 s of build: the common
   GQA ratios only); 0 where the shape has none (attend_range takes it). */
static int dp_attend(const args_t *a, int s, int kh0, int nkh, int l0, int l1, float *st) {
    const int G = a->H / a->Hkv, C = a->D / 32;
#define DP_G(GG, CC) case GG: dp_range(GG, CC, a, s, kh0, nkh, l0, l1, st); return 1;
    switch (C) {
    case 2: switch (G) { DP_G(1, 2) DP_G(2, 2) DP_G(3, 2) DP_G(4, 2) default: return 0; }
    case 4: switch (G) { DP_G(1, 4) DP_G(2, 4) DP_G(4, 4) default: return 0; }
    default: return 0;
    }
#undef DP_G
}
static int dp_fits(const args_t *a) {
    const int G = a->H / a->Hkv;
    return a->bf16 && ((a->D == 64 && G <= 4) || (a->D == 128 && (G <= 2 || G == 4)));
}
#else
static int dp_attend(const args_t *a, int s, int kh0, int nkh, int l0, int l1, float *st) {
    (void)a; (void)s; (void)kh0; (void)nkh; (void)l0; (void)l1; (void)st; return 0;
}
static int dp_fits(const args_t *a) { (void)a; return 0; }
#endif

/* Merge P partial softmaxes (m, l, acc per part, `stride` floats apart) and the sinks into out. */
static void finish(const args_t *a, int s, int kh, int P, const float *parts, size_t stride) {
    const int G = a->H / a->Hkv, D = a->D, Dp = a->Dp;
    for (int g = 0; g < G; ++g) {
        const int h = kh * G + g;
        float M = a->sinks ? a->sinks[h] : -INFINITY;
        for (int p = 0; p < P; ++p) { const float mp = parts[p * stride + g]; M = mp > M ? mp : M; }
        float den = a->sinks ? expf(a->sinks[h] - M) : 0.f, o[Dp];
        for (int x = 0; x < Dp; ++x) o[x] = 0.f;
        for (int p = 0; p < P; ++p) {
            const float *pp = parts + p * stride, w = expf(pp[g] - M);
            if (w == 0.f) continue;  /* a part without keys (m = -inf) */
            den += pp[G + g] * w;
            for (int x = 0; x < Dp; ++x) o[x] += pp[2 * G + g * Dp + x] * w;
        }
        const float inv = 1.f / den;
        const int64_t oi = ((int64_t)s * a->H + h) * D;
        if (a->bf16) for (int x = 0; x < D; ++x) ((uint16_t *)a->out)[oi + x] = to_bf16(o[x] * inv);
        else for (int x = 0; x < D; ++x) ((float *)a->out)[oi + x] = o[x] * inv;
    }
}

static void zero_out(const args_t *a, int s, int kh) {  /* a padding row (no keys) */
    const int G = a->H / a->Hkv;
    const int64_t oi = ((int64_t)s * a->H + kh * G) * a->D;
    memset((char *)a->out + oi * (a->bf16 ? 2 : 4), 0, (size_t)G * a->D * (a->bf16 ? 2 : 4));
}

/* q: [S, H, D] with strides (q_s, q_h, 1), float32 or bf16 (bf16 != 0); cache planes k, v:
   [slots, Hkv, D] contiguous, q's dtype; block_table: [S, bt_s] int32; seq_lens: [S] int32 (0: a
   padding row, zeros); out: [S, H, D] contiguous; W: sliding window (0: none); cap: logit
   soft-cap (0: none); sinks: float32 [H] or NULL. */
void decode_attention(const void *q, int64_t q_s, int64_t q_h, const void *k, const void *v,
                      const int32_t *block_table, int64_t bt_s, const int32_t *seq_lens, void *out,
                      int S, int H, int Hkv, int D, int bs, float scale, int W, float cap,
                      const float *sinks, int bf16, int nthreads) {
    args_t a = {q, q_s, q_h, k, v, block_table, bt_s, seq_lens, out, S, H, Hkv, D, (D + VL - 1) / VL * VL, bs, W,
                bf16, bf16 && D % 32 == 0, scale, cap, sinks};
    const int G = H / Hkv, dpf = dp_fits(&a);
    int maxn = 0;
    int64_t pairs = 0;  /* (key, query head) pairs: the work, ~5 ns each */
    for (int s = 0; s < S; ++s) {
        const int L = seq_lens[s], n = W > 0 && L > W ? W : L;
        maxn = n > maxn ? n : maxn;
        pairs += (int64_t)(n > 0 ? n : 0) * H;
    }
    /* Below ~100 us of work a parallel region costs more than it saves (waking threads; on a
       shared machine, a barrier waiting for a descheduled thread). */
    if (pairs < MIN_PARALLEL_PAIRS) nthreads = 1;
    /* An item: nkh KV heads of a sequence (on the dp path all of them, where the sequences alone
       give every thread several items: one pass over each block). */
    const int nkh = dpf && S >= 4 * nthreads ? Hkv : 1, items = S * (Hkv / nkh);
    /* Fewer items than the threads can share: split long contexts (>= 128 keys a part). */
    int P = 1;
    if (nthreads > 1 && items < 4 * nthreads) {
        P = (4 * nthreads + items - 1) / items;
        P = P < maxn / 128 ? P : maxn / 128;
        P = P < 1 ? 1 : P;
    }
    const size_t stride = (size_t)G * (2 + a.Dp), istride = stride * (size_t)nkh;
    float *parts = P > 1 ? (float *)malloc(sizeof(float) * istride * (size_t)items * P) : NULL;
    if (P > 1 && !parts) P = 1;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float one[istride];  /* a single part's state, when the context is not split */
        #pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < items * P; ++w) {
            const int it = w / P, p = w % P, s = it * nkh / Hkv, kh0 = it * nkh % Hkv, L = seq_lens[s];
            if (L <= 0) { if (p == 0) for (int k = 0; k < nkh; ++k) zero_out(&a, s, kh0 + k); continue; }
            const int start = W > 0 && L > W ? L - W : 0, N = L - start;
            const int l0 = start + (int)((int64_t)N * p / P), l1 = start + (int)((int64_t)N * (p + 1) / P);
            float *st = P > 1 ? parts + (size_t)w * istride : one;
            if (!(dpf && dp_attend(&a, s, kh0, nkh, l0, l1, st)))
                for (int k = 0; k < nkh; ++k) {
                    float *sk = st + k * stride;
                    attend_range(&a, s, kh0 + k, l0, l1, sk, sk + G, sk + 2 * G);
                }
            if (P == 1) for (int k = 0; k < nkh; ++k) finish(&a, s, kh0 + k, 1, st + k * stride, stride);
        }
        if (P > 1) {  /* (nkh is 1 here: P > 1 needs fewer items than 4 a thread) */
            #pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < items; ++it)
                if (seq_lens[it / Hkv] > 0) finish(&a, it / Hkv, it % Hkv, P, parts + (size_t)it * P * stride, stride);
        }
    }
    free(parts);
}
"""
