"""INT4 (issue 22): the kernels that write an INT4 linear's input write it in the swapped GEMM's K
order, so that the GEMM reads it as it is instead of permuting it first.

Why: the swapped Gluon GEMM (`gluon_int4_swap_gemm`, routed at 64..256 rows by
`triton_int4_dot_gemm.TABLE`) reads x with each 64-input step's columns in the weight fragment's
order (`permute_x`): one extra Triton pass per call (`triton_x_permute`), 96 calls and ~0.48 ms of
a 13.35 ms decode step at 256 rows on an H100 (Llama-8B). The RMSNorms before qkv_proj and
gate_up_proj and the SiLU-and-mul before down_proj can store their output in that order for free
(the same bytes, each 64-column step's 4-byte pairs in another order: `triton_x_permute.kperm_src`).

The contract, as fp8's fused activation codes (`fp8.mark_fused_producers`):
- `mark_producers` links a decoder layer's producer to its INT4 linear only where the layer / MLP
  declares that linear the output's one reader (`norms_feed_only_linears`, `act_feeds_only_down`);
- a producer writes the permuted order for a call only where `wanted` says that linear takes this
  call with the swapped GEMM reading x permuted (the same routing function the linear runs), on
  CUDA in bf16 without LoRA, and marks exactly the tensor it returns (`mark`; a view or a copy is
  not marked, so nothing else ever reads permuted values as natural ones);
- the linear takes a marked x as it is on that route and un-permutes it anywhere else
  (`unpermute`: never expected, but always correct).
TOKENMILL_INT4_KPERM=0 turns it off (the GEMM permutes x itself, as before; for A/B runs).
The Triton attention's output (o_proj's x) likewise with TOKENMILL_INT4_KPERM_ATTN=1 (`ATTENTION`).
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles
    from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles

ENABLED = os.environ.get("TOKENMILL_INT4_KPERM", "1") != "0"
# The attention's output for o_proj too (`LlamaAttention.attend`): off until measured on a GPU
# (its kernels compile a KPERM variant per launch shape). TOKENMILL_INT4_KPERM_ATTN=1: on.
ATTENTION = os.environ.get("TOKENMILL_INT4_KPERM_ATTN", "0") == "1"
_ATTR = "_int4_kperm"
_READER = "_int4_kperm_reader"


def mark(out: torch.Tensor, permuted: bool) -> torch.Tensor:
    """`out` (just written by a producer), marked as holding its columns in the fragment K order."""
    if permuted:
        setattr(out, _ATTR, True)
    return out


def marked(x: torch.Tensor) -> bool:
    """Whether exactly this tensor object holds its columns in the fragment K order."""
    return getattr(x, _ATTR, False)


def unpermute(x: torch.Tensor) -> torch.Tensor:
    """The natural column order of a permuted x [..., K] (the inverse of `gluon_int4_swap_gemm.permute_x`:
    stored column 16 m + 8 a + 2 j + b holds input 16 j + 4 m + 2 a + b); a new contiguous tensor."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    v = x.reshape(-1, k // 64, 4, 2, 4, 2)  # [rows, step, m, a, j, b]
    return v.permute(0, 1, 4, 2, 3, 5).reshape(*lead, k)


def swap_launch(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> WsaTiles | SwapTiles | None:
    """The launch with which `triton_int4_mma.mma_matmul` takes [m, k] x [k, n] reading x permuted: the wsa
    GEMM's (`int4_wsa_route.WsaTiles`) or the swapped GEMM's (`triton_int4_dot_gemm.SwapTiles`, not xnat),
    or None (the GEMV, another GEMM, dequantize + cuBLAS, or the gathered-x launch: x natural)."""
    from tokenmill.layers.quantization import int4_wsa_route
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization.triton_int4_mma import ROWS

    if m <= ROWS:
        return None
    t = int4_wsa_route.wsa_tiles(m, n, k, group, dtype)
    if t is not None:
        return t
    t = dot.dot_tiles(m, n, k, group, dtype)
    return t if isinstance(t, dot.SwapTiles) and not t.xnat else None


def swap_route(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """Whether `triton_int4_mma.mma_matmul` takes [m, k] x [k, n] with a swapped GEMM reading x permuted
    (`swap_launch`): what the producers ask before writing x in that order."""
    return swap_launch(m, n, k, group, dtype) is not None


def _int4_mma_linear(layer: nn.Module | None) -> bool:
    from tokenmill.layers.quantization.int4 import Int4LinearMethod

    method = getattr(layer, "quant_method", None)
    q = getattr(layer, "qweight", None)
    return isinstance(method, Int4LinearMethod) and q is not None and q.dim() == 4 and q.is_cuda


def _attention_writes_kperm(module: nn.Module) -> bool:
    """An attention module that says its kernels' output goes to its o_proj alone and can be
    stored permuted (`o_proj_reads_attend_output()`: `model.llama.LlamaAttention` over the Triton
    backend). Asked, not looked up: layers never import the models above them."""
    says = getattr(module, "o_proj_reads_attend_output", None)
    return callable(says) and bool(says())


def mark_producers(model: nn.Module) -> int:
    """Link each decoder layer's input_layernorm (-> qkv_proj), post_attention_layernorm
    (-> gate_up_proj) and MLP SiLU-and-mul (-> down_proj) to its INT4 linear on the mma layout,
    where the layer (`norms_feed_only_linears`) or MLP (`act_feeds_only_down`) says the linear is
    the output's one reader, and a Llama attention (its Triton kernels' output -> o_proj,
    `LlamaAttention.attend`). Returns how many were linked."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm

    linked = 0
    for module in model.modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        pairs = []
        if getattr(module, "norms_feed_only_linears", False):
            pairs += [(getattr(module, "input_layernorm", None), getattr(attn, "qkv_proj", None), RMSNorm),
                      (getattr(module, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None), RMSNorm)]
        if getattr(mlp, "act_feeds_only_down", False):
            pairs.append((getattr(mlp, "act", None), getattr(mlp, "down_proj", None), SiluAndMul))
        if ATTENTION and _attention_writes_kperm(module):
            pairs.append((module, module.o_proj, type(module)))
        for producer, consumer, kind in pairs:
            if type(producer) is kind and _int4_mma_linear(consumer):
                producer.__dict__[_READER] = weakref.ref(consumer)
                linked += 1
    return linked


def wanted(producer: nn.Module, x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether `producer` writes this call's output ([rows, cols] in `dtype`, 2-D, from `x`) in the
    fragment K order: linked to an INT4 linear without LoRA that takes `rows` rows with the swapped
    GEMM reading x permuted."""
    ref = producer.__dict__.get(_READER)
    consumer = ref() if ref is not None else None
    if not ENABLED or consumer is None or consumer.__dict__.get("lora") is not None:
        return False
    if not x.is_cuda or dtype != torch.bfloat16 or cols % 64 or rows == 0:
        return False
    q = consumer.qweight
    n, k = q.shape[0] * 16, q.shape[1] * 64
    if k != cols:
        return False
    group = consumer.quant_method.config.group_size
    return swap_route(rows, n, k, k if group == -1 else group, dtype)
