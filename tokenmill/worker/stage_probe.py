"""Time one decoder layer, the embedding and the LM head on this device, before the model is built.

What `distributed.stage_balance` needs to split the layers over pipeline stages by time: random
tensors of this rank's shapes (its TP shard), a decode micro-batch of `rows` tokens each reading
`context` cached positions. A layer is timed as its attention half (norm, q/k/v, attention over
the cache with torch SDPA, o) and its MLP half (norm, gate/up, SiLU-and-mul, down); the head as the final norm, the float32
logits of the rank's vocab rows and the argmax. Medians of a few repeats, CUDA events on GPU.
The figures are relative costs for the split, not a benchmark.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.config import EngineConfig, ModelArch
from tokenmill.distributed.stage_balance import StageCosts

logger = logging.getLogger(__name__)

_MAX_KV_ELEMENTS = 1 << 28  # attention is timed on at most this many cached K (and V) elements, scaled up
_REPEATS = 5


def probe_shape(config: EngineConfig) -> tuple[int, int]:
    """(rows, context): a decode micro-batch and half the model length (at most 1024 positions),
    the cache a typical row reads. The rows split over the micro-batches in flight: one per stage
    (or `pp_microbatches`), plus the async slot's where sampled tokens come back through the host
    (the trace: 330-row steps at max_num_seqs 1000 on two stages; ~500 with device tokens)."""
    sched = config.scheduler
    pp = config.parallel.pipeline_parallel_size
    batches = max(pp, sched.pp_microbatches) + (1 if sched.async_scheduling and not sched.pp_device_tokens else 0)
    rows = max(1, sched.max_num_seqs // batches)
    return rows, max(1, min(config.max_model_len, 2048) // 2)


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        fn()  # warm (kernel selection, allocator)
        samples = []
        for _ in range(_REPEATS):
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    return run


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def _logits(h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float32 logits as the engine's LM head makes them on CUDA (float32 straight from the matmul)."""
    if h.is_cuda:
        try:
            return torch.mm(h, table.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch: no mixed-dtype mm
            pass
    return F.linear(h, table).float()


@torch.inference_mode()
def measure(arch: ModelArch, dtype: torch.dtype, device: torch.device, rows: int, context: int,
            tp: int = 1) -> StageCosts:
    """ms per decode micro-batch of this rank's layer, embedding and head (TP shard `tp`)."""
    timed = _timer(device)
    h, d = arch.hidden_size, arch.head_dim
    hq, hkv = arch.num_heads // tp, max(1, arch.num_kv_heads // tp)
    inter = arch.intermediate_size // tp
    vocab = -(-arch.vocab_size // tp)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * 0.02

    x, norm_w = rand(rows, h), torch.ones(h, device=device, dtype=dtype)
    w_qkv, w_o = rand((hq + 2 * hkv) * d, h), rand(h, hq * d)
    w_gate_up, w_down = rand(2 * inter, h), rand(h, inter)
    ctx = max(1, min(context, _MAX_KV_ELEMENTS // max(1, rows * hkv * d)))
    k, v = rand(rows, hkv, ctx, d), rand(rows, hkv, ctx, d)

    def attention(q: torch.Tensor) -> torch.Tensor:
        q = q.view(rows, hq, 1, d)
        if hq != hkv:  # GQA: each KV head serves hq // hkv query heads
            q = q.view(rows, hkv, hq // hkv, d)
        return F.scaled_dot_product_attention(q, k, v).reshape(rows, hq * d)

    def attention_matmuls() -> None:  # the attention half's norm and projections
        qkv = F.linear(_rms(x, norm_w), w_qkv)
        F.linear(qkv[:, :hq * d].contiguous(), w_o)

    def mlp() -> None:  # the MLP half: its norm, gate/up, SiLU-and-mul, down
        gate, up = F.linear(_rms(x, norm_w), w_gate_up).chunk(2, dim=-1)
        F.linear(F.silu(gate) * up, w_down)

    q = rand(rows, hq * d)
    attention_half = timed(attention_matmuls) + timed(lambda: attention(q)) * (context / ctx)
    layer = attention_half + timed(mlp)
    del k, v, w_qkv, w_o, w_gate_up, w_down
    table = rand(vocab, h)
    ids = torch.randint(0, vocab, (rows,), device=device)
    embedding = timed(lambda: F.embedding(ids, table))
    head = timed(lambda: _logits(_rms(x, norm_w), table).argmax(-1))
    del table
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # Every layer costs the same here (sliding-window layers are timed as full ones: an upper bound).
    return StageCosts(layers=(layer,) * arch.num_layers, embedding=embedding, head=head,
                      attention=(attention_half,) * arch.num_layers)


def measure_for(config: EngineConfig, device: torch.device) -> StageCosts:
    """`measure` at this engine's decode micro-batch (`probe_shape`), logged."""
    from tokenmill.model.llama import splits_at_attention
    from tokenmill.model.registry import get_model_class

    rows, context = probe_shape(config)
    arch = config.model.arch
    costs = measure(arch, config.model.torch_dtype, device, rows, context, config.parallel.tensor_parallel_size)
    logger.info("stage probe (%d rows x %d cached positions): a layer %.3f ms (attention half %.3f), embedding "
                "%.3f ms, norm + LM head + sampling %.3f ms", rows, context, costs.layers[0], costs.attention[0],
                costs.embedding, costs.head)
    if not splits_at_attention(get_model_class(arch.architecture)) or config.lora is not None:
        costs = dataclasses.replace(costs, attention=())  # whole layers only
    return costs
