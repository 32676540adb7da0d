"""The decode roofline: a decode step reads every weight once and each row's whole KV context, so
no engine can run it faster than (weight bytes + KV bytes) / memory bandwidth."""

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


def weight_bytes_read_per_step(arch: ModelArch, dtype: str) -> int:
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h + 2 * h
    lm_head = arch.vocab_size * h
    return (arch.num_layers * per_layer + h + lm_head) * _DTYPE_BYTES[dtype]


def kv_bytes_per_token(arch: ModelArch, dtype: str) -> int:
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


def decode_roofline(arch: ModelArch, dtype: str, bandwidth: float) -> DecodeRoofline:
    return DecodeRoofline(weight_bytes_read_per_step(arch, dtype), kv_bytes_per_token(arch, dtype), bandwidth)
