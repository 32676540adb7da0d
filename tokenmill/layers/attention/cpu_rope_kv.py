"""Rotary embedding of q and k and the KV-cache write of one layer, in one C pass on CPU.

The torch path is ~20 small ops per layer (the half-by-half `apply_rotary` of q and k: slices,
two products and two `addcmul_` each, plus `index_copy_` of k and v into the flat cache), each
costing more in dispatch than its work at decode sizes; at batch 1 they were ~5% of a SmolLM2
step. This kernel does it per token in one call:
- q's and k's heads are rotated in place (the attention reads them next: the fresh-prefill path
  reads k itself, not the cache);
- the rotated k and v are copied into the paged cache at the token's slot (slot -1, padding,
  and rows past `num_write` write nothing).

Numerics are `rotary.apply_rotary`'s bit for bit (as the Triton kernel's are): cos and sin rounded
to the activation dtype, then o1 = round(round(x1 * cos) - x2 * sin) and o2 = round(round(x2 * cos)
+ x1 * sin), the second product and the sum one fused multiply-add (torch's mul, then its
addcmul_, which runs as an FMA in float on CPU). bf16 and float32
activations, a cache of the same dtype. Built like `cpu_norm.py` (`c_build.py`); `available()`
False means use torch.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.layers import c_build, c_common

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
""" + c_common.BF16_SCALAR + r"""
#define MAX_HALF 512
/* Heads [0, H) at base (head stride hs elements), rotary dims [0, 2*half) rotated in place;
   one version per activation type so that each inner loop vectorizes. */
static void rotate_f32(float *base, int64_t hs, int H, int half, const float *c, const float *s) {
    for (int h = 0; h < H; ++h) {
        float *x = base + (int64_t)h * hs;
        for (int i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[half + i];
            x[i] = fmaf(-x2, s[i], x1 * c[i]);
            x[half + i] = fmaf(x1, s[i], x2 * c[i]);
        }
    }
}
static void rotate_bf16(uint16_t *base, int64_t hs, int H, int half, const float *c, const float *s) {
    for (int h = 0; h < H; ++h) {
        uint16_t *x = base + (int64_t)h * hs;
        for (int i = 0; i < half; ++i) {
            const float x1 = ld_bf16(x[i]), x2 = ld_bf16(x[half + i]);
            const float a = ld_bf16(to_bf16(x1 * c[i])), b = ld_bf16(to_bf16(x2 * c[i]));
            x[i] = to_bf16(fmaf(-x2, s[i], a));
            x[half + i] = to_bf16(fmaf(x1, s[i], b));
        }
    }
}

/* q: [T, Hq, D] (token stride qs, head stride qhs); k likewise [T, Hk, D] (ks, khs); v [T, Hk, D]
   (vs, vhs); positions int64 [T]; cos/sin float32 rows of stride cs (first `half` columns read);
   slots int64 [>= num_write]; k_cache / v_cache: [slots, Hk, D] contiguous. elem: 2 (bf16) or 4. */
void rope_kv_write(void *q, int64_t qs, int64_t qhs, void *k, int64_t ks, int64_t khs, const void *v,
                   int64_t vs, int64_t vhs, const int64_t *positions, const float *cos_c, const float *sin_c,
                   int64_t cs, const int64_t *slots, void *k_cache, void *v_cache, int T, int num_write,
                   int Hq, int Hk, int D, int rot, int bf16, int nthreads) {
    const int half = rot / 2;
    const int elem = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T >= 64)
    for (int t = 0; t < T; ++t) {
        float c[MAX_HALF], s[MAX_HALF];
        const int64_t pos = positions[t];
        char *qt = (char *)q + (int64_t)t * qs * elem, *kt = (char *)k + (int64_t)t * ks * elem;
        if (bf16) {
            for (int i = 0; i < half; ++i) {
                c[i] = ld_bf16(to_bf16(cos_c[pos * cs + i]));
                s[i] = ld_bf16(to_bf16(sin_c[pos * cs + i]));
            }
            rotate_bf16((uint16_t *)qt, qhs, Hq, half, c, s);
            rotate_bf16((uint16_t *)kt, khs, Hk, half, c, s);
        } else {
            for (int i = 0; i < half; ++i) { c[i] = cos_c[pos * cs + i]; s[i] = sin_c[pos * cs + i]; }
            rotate_f32((float *)qt, qhs, Hq, half, c, s);
            rotate_f32((float *)kt, khs, Hk, half, c, s);
        }
        if (t >= num_write || slots[t] < 0) continue;
        const int64_t slot = slots[t];
        const char *vt = (const char *)v + (int64_t)t * vs * elem;
        for (int h = 0; h < Hk; ++h) {
            memcpy((char *)k_cache + ((slot * Hk + h) * D) * elem, kt + (int64_t)h * khs * elem, (size_t)D * elem);
            memcpy((char *)v_cache + ((slot * Hk + h) * D) * elem, vt + (int64_t)h * vhs * elem, (size_t)D * elem);
        }
    }
}
"""

MAX_HALF = 512

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]

# No contraction but the kernel's own fmaf: x1 * cos must stay rounded on its own, as torch's mul makes it.
_FLAGS = (*c_build.BASE_FLAGS, "-ffp-contract=off")


@functools.cache
def library() -> ctypes.CDLL | None:
    return c_build.load_library("cpu_rope_kv", _SOURCE, _FLAGS, {"rope_kv_write": _ARGTYPES})


def available() -> bool:
    return library() is not None


def supports(kv_cache: torch.Tensor, rotary_dim: int) -> bool:
    """A contiguous bf16 / float32 CPU cache (not fp8), and a rotary width the kernel takes."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.bfloat16, torch.float32)
            and kv_cache.is_contiguous() and 0 < rotary_dim <= 2 * MAX_HALF and rotary_dim % 2 == 0
            and available())


def _heads_ok(x: torch.Tensor, dtype: torch.dtype) -> bool:
    return x.dim() == 3 and x.dtype == dtype and x.stride(-1) == 1 and x.device.type == "cpu"


def rotate_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int, kv_cache: torch.Tensor,
                     slots: torch.Tensor, num_write: int) -> bool:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (token t at `positions[t]`; float32 caches
    [rows, >= rotary_dim // 2]) and writes k and v [T, Hk, D] of the first `num_write` tokens into
    `kv_cache` [2, blocks, bs, Hk, D] at `slots` (int64; -1 skips). False (nothing done) where the
    inputs do not fit the kernel: the caller then runs the torch path."""
    dtype = kv_cache.dtype
    t = q.shape[0]
    if not (_heads_ok(q, dtype) and _heads_ok(k, dtype) and _heads_ok(v, dtype) and k.shape == v.shape
            and k.shape[0] == t and k.shape[1:] == kv_cache.shape[3:] and positions.shape[0] >= t
            and positions.dtype == torch.int64 and slots.dtype == torch.int64 and slots.shape[0] >= num_write
            and positions.is_contiguous() and slots.is_contiguous() and cos_cache.dtype == torch.float32
            and cos_cache.stride() == sin_cache.stride() and cos_cache.stride(-1) == 1
            and sin_cache.dtype == torch.float32 and supports(kv_cache, rotary_dim)
            and rotary_dim <= q.shape[-1] and num_write <= t):
        return False
    if t == 0:
        return True
    lib = library()
    hk, d = k.shape[1], k.shape[2]
    k_ptr = kv_cache.data_ptr()  # (contiguous: the V plane follows the K plane)
    lib.rope_kv_write(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                      v.stride(0), v.stride(1), positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
                      cos_cache.stride(0), slots.data_ptr(), k_ptr, k_ptr + kv_cache.stride(0) * kv_cache.element_size(), t,
                      num_write, q.shape[1], hk, d, rotary_dim, int(dtype == torch.bfloat16), torch.get_num_threads())
    return True
