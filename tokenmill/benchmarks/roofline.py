"""The decode roofline: a decode step reads every weight once (a MoE layer: the experts its rows
activate) and each row's whole KV context, so no engine can run it faster than (weight bytes +
KV bytes) / memory bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ModelArch

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DecodeRoofline:
    weight_bytes: int  # read once per step (the embedding table only where it is the LM head too)
    kv_bytes_per_token: int  # K and V of every layer
    bandwidth_bytes_per_s: float

    def step_time_s(self, batch: int, mean_context: float) -> float:
        return (self.weight_bytes + batch * mean_context * self.kv_bytes_per_token) / self.bandwidth_bytes_per_s


def weight_bytes_read_per_step(arch: ModelArch, dtype: str, rows: float = 1) -> int:
    """Every weight once, except a MoE layer's experts: only those the step's `rows` activate
    (`active_experts`). MLA models read their own attention projections."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    attn = h * (q + 2 * kv) + q * h
    if arch.mla is not None:
        m = arch.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_proj = (h * m.q_lora_rank + m.q_lora_rank * arch.num_heads * qk) if m.q_lora_rank else h * arch.num_heads * qk
        attn = q_proj + h * m.latent_dim + m.kv_lora_rank * arch.num_heads * (m.qk_nope_head_dim + m.v_head_dim) \
            + arch.num_heads * m.v_head_dim * h
    total = 0.0
    for layer in range(arch.num_layers):
        moe = arch.moe
        if moe is None or layer in moe.dense_layers:
            mlp = h * 2 * i + i * h
        else:
            mlp = h * moe.num_experts + 3 * h * (active_experts(moe.num_experts, moe.top_k, rows) * moe.intermediate_size
                                                 + moe.shared_intermediate_size)
        total += attn + mlp + 2 * h
    lm_head = arch.vocab_size * h
    return int((total + h + lm_head) * _DTYPE_BYTES[dtype])


def active_experts(num_experts: int, top_k: int, rows: float) -> float:
    """Experts that `rows` tokens activate, expected under uniform routing: E (1 - (1 - k/E)^rows)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def kv_bytes_per_token(arch: ModelArch, dtype: str) -> int:
    """K and V of every layer; MLA: the latent and the rope key."""
    if arch.mla is not None:
        return arch.num_layers * arch.mla.latent_dim * _DTYPE_BYTES[dtype]
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * _DTYPE_BYTES[dtype]


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, repeats: int = 10, trials: int = 5) -> float:
    """Bytes read plus written per second by a device-to-device copy (the memory-bound ceiling):
    the best of `trials` timings of `repeats` copies, so noise never lowers the ceiling."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best = max(best, 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3))
    return best


def decode_roofline(arch: ModelArch, dtype: str, bandwidth: float, rows: float = 1) -> DecodeRoofline:
    """`rows`: the step's batch (decides how many experts a MoE model's step reads)."""
    return DecodeRoofline(weight_bytes_read_per_step(arch, dtype, rows), kv_bytes_per_token(arch, dtype), bandwidth)
