"""Tensor parallelism with the all-reduces under the GEMMs: a large step's rows run in two halves.

At TP > 1 every decoder layer all-reduces twice (after o_proj and after down_proj), and the
layer's next GEMM needs the sum: run as one batch, the GPU computes nothing while a prefill
chunk's 64 MiB all-reduce crosses NVLink (15% of a TP=2 prefill step on two H200s). Everything
in a layer but attention treats rows independently, so a step's rows are cut in two halves A
and B, and each half's all-reduce is started (NCCL, on its own stream: `StartedAllReduce`) and
waited for only where that half needs the sum, with the other half's work queued in between:

    compute:  qkv(A) qkv(B) | attention(all) | o(A) o(B) | norm+MLP(A) | norm+MLP(B) | norm+qkv(A) ...
    network:                                    AR_o(A) AR_o(B) ........ AR_d(A) ...... AR_d(B) ...

AR_o(B) runs under A's MLP, AR_d(A) under B's MLP, AR_d(B) under the next layer's norm + qkv of A.
Attention runs once over all rows (its metadata is per sequence), on the halves' qkv joined.
A started all-reduce (`ParallelContext.start_all_reduce`) runs the symmetric buffer's kernel on
a side stream where the message fits it (so decode steps captured in CUDA graphs overlap too:
the fork and join are stream waits, which a graph records), NCCL on its own stream above.

Numerics: the same kernels on fewer rows; the all-reduce a plain sum, then the residual add and
the norm apart (the one-batch path fuses them for small messages, with one rounding fewer).
Only the plain Llama layers (Llama, Qwen2/3, Mistral, ...) without LoRA.

Off by default (`TOKENMILL_TP_OVERLAP=1` turns it on, for steps of at least
`TOKENMILL_TP_OVERLAP_MIN_TOKENS` tokens, default MIN_TOKENS). On two H100s (`bench all-reduce
--overlap-rows`, an 8-layer Llama-8B MLP chain at TP=2 in CUDA graphs) the halves took 1.20x /
1.08x / 0.997x the one-batch time at 512 / 1024 / 8192 rows: the all-reduce kernels beside the
GEMMs slow both (a 32 MiB two-shot 215 us there against ~150 alone), the halves' GEMMs run less
efficiently, and the copy into the symmetric buffer and the qkv join cost their own passes. It is
kept, checked (the GPU layout check's tp2 runs it), for a GEMM that leaves SMs to the all-reduce.
"""

from __future__ import annotations

import os

import torch

from tokenmill.distributed.parallel_state import reduced
from tokenmill.layers.lora.lora_layer import has_lora
from tokenmill.layers.norm import residual_stream

MIN_TOKENS = 512  # a step's tokens (decode rows) from which the halves run; below, the fused kernels win


def wanted() -> bool:
    """Off unless TOKENMILL_TP_OVERLAP=1 (on two H100s it measured a loss at decode sizes and a wash
    at prefill ones: see the module's docstring). On, it runs wherever the layers fit: CUDA or
    CPU (gloo), and on one rank too, where the halves only split the GEMMs (tests)."""
    return os.environ.get("TOKENMILL_TP_OVERLAP", "0").lower() in ("1", "true", "yes", "on")


def min_tokens() -> int:
    return int(os.environ.get("TOKENMILL_TP_OVERLAP_MIN_TOKENS", MIN_TOKENS))


def _layers_fit(model) -> bool:
    """Every layer of the stage is the plain Llama layer (its forward is what `run_layers` redoes),
    whole (no half layers at a stage boundary), with no LoRA on its linears. Decided once per model."""
    fits = getattr(model, "_tp_overlap_fits", None)
    if fits is None and model.layout.has_split_layers:
        fits = model._tp_overlap_fits = False
    if fits is None:
        from tokenmill.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
        layers = [model.layers[i] for i in range(model.layout.layer_start, model.layout.layer_end)]
        fits = bool(layers) and all(
            type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
            and type(layer.mlp) is LlamaMLP
            and not any(has_lora(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                               layer.mlp.gate_up_proj, layer.mlp.down_proj))
            for layer in layers)
        model._tp_overlap_fits = fits
    return fits


def applies(model, hidden: torch.Tensor) -> bool:
    """Whether this step of `model` (a `LlamaModel`) runs its layers in overlapped halves."""
    parallel = getattr(model, "parallel", None)
    if parallel is None or parallel.skip_all_reduce or hidden.dim() != 2 or not wanted():
        return False
    if hidden.shape[0] < max(min_tokens(), 2) or not _layers_fit(model):
        return False
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        # In a graph (decode steps) the halves' all-reduces must take the symmetric buffer on the
        # side stream (NCCL's own stream is not captured here): the larger half's message must fit.
        return parallel.side_all_reduce_fits(hidden[:split_point(hidden.shape[0])])
    return True


def split_point(num_tokens: int) -> int:
    """Half A's rows: half, rounded up to a multiple of 64 (GEMM tiles) from 256 tokens on."""
    half = (num_tokens + 1) // 2
    return -(-half // 64) * 64 if num_tokens >= 256 else half


def run_layers(model, hidden: torch.Tensor, residual: torch.Tensor | None, ropes: list, kv_caches: list[torch.Tensor],
               meta) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's decoder layers over all rows, as `LlamaDecoderLayer.forward` one after the other
    would compute them: returns (last MLP output, residual stream), the whole step's rows."""
    layout, parallel = model.layout, model.parallel
    act_dtype = hidden.dtype
    s = split_point(hidden.shape[0])
    spans = (slice(0, s), slice(s, hidden.shape[0]))
    outs: list = [hidden[sp] for sp in spans]  # each half's last output (a tensor or a started all-reduce)
    streams: list = [None if residual is None else residual[sp] for sp in spans]
    for i in range(layout.layer_start, layout.layer_end):
        layer = model.layers[i]
        attn = layer.self_attn
        qkv = []
        for h in range(2):
            x = reduced(outs[h])
            if streams[h] is None:
                streams[h], normed = residual_stream(x), layer.input_layernorm(x, out_dtype=act_dtype)
            else:
                normed, streams[h] = layer.input_layernorm.forward_with_residual(x, streams[h], act_dtype)
            qkv.append(attn.qkv_proj(normed))
        out = attn.attend(torch.cat(qkv), ropes[model._rope_of_layer[i]], kv_caches[i - layout.layer_start], meta)
        with parallel.starting_reduces():
            partials = [attn.o_proj(out[sp]) for sp in spans]
        for h in range(2):
            normed, streams[h] = layer.post_attention_layernorm.forward_with_residual(
                reduced(partials[h]), streams[h], act_dtype)
            with parallel.starting_reduces():
                outs[h] = layer.mlp(normed)
    return torch.cat([reduced(o) for o in outs]), torch.cat(streams)
