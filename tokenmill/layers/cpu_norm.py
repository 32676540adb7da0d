"""RMSNorm of the float32 residual stream into bf16 on CPU, in one C pass (the residual add too).

A CPU bf16 model's stream is float32 (`norm.residual_stream`) and each norm's output is bf16:
in torch that is ~9 small ops per norm (the add, the sum of squares, four on the [rows, 1]
reciprocal, the product, the cast, the weight), each costing more in dispatch than its work at
decode sizes (61 norms a step on SmolLM2). This kernel does it in one call with HF's roundings,
those of `norm.rms_norm_reference`:

    stream = residual + x                        (float32, x float32 or bf16; optional)
    rstd   = 1 / sqrt(mean(stream^2) + eps)      (float32)
    out    = bf16(weight * bf16(stream * rstd))  (weight bf16)

so it equals the torch path up to float32 summation order in the mean. Built like `cpu_decode.py`
(`c_build.py`); `available()` False means use torch.
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
#define LANES 16
/* One row: s (float32 [H], already the stream) -> out (bf16 [H]). */
static void norm_row(const float *s, const uint16_t *w, float eps, uint16_t *out, int H) {
    float part[LANES] = {0};
    int i = 0;
    for (; i + LANES <= H; i += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += s[i + l] * s[i + l];
    float ss = 0.f;
    for (int l = 0; l < LANES; ++l) ss += part[l];
    for (; i < H; ++i) ss += s[i] * s[i];
    const float rstd = 1.0f / sqrtf(ss * (1.0f / (float)H) + eps);
    for (i = 0; i < H; ++i) out[i] = to_bf16(ld_bf16(w[i]) * ld_bf16(to_bf16(s[i] * rstd)));
}

/* res: float32 [R, H] (stride rs); x: NULL, or [R, H] float32 (x_bf16 0) or bf16 (x_bf16 1),
   stride xs, added to res into new_res (float32, stride ns; may be res) first; w: bf16 [H];
   out: bf16 [R, H] (stride os). Without x the norm reads res directly. */
void add_rms_norm_bf16(const float *res, int64_t rs, const void *x, int x_bf16, int64_t xs, float *new_res,
                       int64_t ns, const uint16_t *w, float eps, uint16_t *out, int64_t os, int R, int H,
                       int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && R >= 64)
    for (int r = 0; r < R; ++r) {
        const float *s = res + r * rs;
        if (x) {
            float *d = new_res + r * ns;
            if (x_bf16) { const uint16_t *xr = (const uint16_t *)x + r * xs; for (int i = 0; i < H; ++i) d[i] = s[i] + ld_bf16(xr[i]); }
            else { const float *xr = (const float *)x + r * xs; for (int i = 0; i < H; ++i) d[i] = s[i] + xr[i]; }
            s = d;
        }
        norm_row(s, w, eps, out + r * os, H);
    }
}
"""

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
             ctypes.c_int, ctypes.c_int]


@functools.cache
def library() -> ctypes.CDLL | None:
    return c_build.load_library("cpu_norm", _SOURCE, c_build.BASE_FLAGS, {"add_rms_norm_bf16": _ARGTYPES})


def available() -> bool:
    return library() is not None


def supports(stream: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
             x: torch.Tensor | None = None) -> bool:
    """A float32 CPU stream [..., H] normalized into bf16 by a bf16 weight (plus an x of float32
    or bf16 of the same shape, to add first)."""
    return (out_dtype == torch.bfloat16 and stream.dtype == torch.float32 and stream.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and weight.dim() == 1 and weight.shape[0] == stream.shape[-1]
            and (x is None or (x.dtype in (torch.float32, torch.bfloat16) and x.shape == stream.shape
                               and x.device.type == "cpu"))
            and not (torch.is_grad_enabled() and weight.requires_grad) and available())


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2:  # (a decoder's stream is [tokens, H] already: no reshape op per norm)
        t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rms_norm(stream: torch.Tensor, weight: torch.Tensor, eps: float,
                 x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 RMSNorm of `stream + x`, that float32 stream) for inputs `supports` accepts; without
    `x` the stream returned is `stream` itself."""
    lib = library()
    assert lib is not None
    h = stream.shape[-1]
    s2 = _rows(stream)
    out = torch.empty(s2.shape, dtype=torch.bfloat16)
    new = s2
    x2 = None
    if x is not None:
        x2 = _rows(x)
        new = torch.empty(s2.shape, dtype=torch.float32)
    w = weight if weight.is_contiguous() else weight.contiguous()
    if s2.shape[0]:
        lib.add_rms_norm_bf16(s2.data_ptr(), s2.stride(0), None if x2 is None else x2.data_ptr(),
                              int(x2 is not None and x2.dtype == torch.bfloat16), 0 if x2 is None else x2.stride(0),
                              new.data_ptr(), new.stride(0), w.data_ptr(), eps, out.data_ptr(), out.stride(0),
                              s2.shape[0], h, torch.get_num_threads())
    if stream.dim() == 2:
        return out, (stream if x is None else new)
    shape = stream.shape
    return out.view(shape), (stream if x is None else new.view(shape))
