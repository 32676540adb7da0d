"""Phi-3 / Phi-4 (Phi3ForCausalLM), over the Llama module.

The layers are Llama's; what differs is the checkpoint, which stores q/k/v as one `qkv_proj`
and gate/up as one `gate_up_proj`, and the rotary embedding, LongRoPE for the long-context
models (`layers/rotary.py`), with a sliding window where the config sets one. Each fused tensor
is read as its parts (q, k, v; gate, up), each part a lazy view of the checkpoint's rows, so the
Llama loader gives every tensor-parallel rank its own q, k, v and gate, up slices (a rank never
reads the whole fused tensor) and dummy weights (split names) load the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.weight_source import LazyTensor, read_slice, tensor_shape


class RowRange:
    """Rows [start, start + length) of a checkpoint tensor, read lazily (a `LazyTensor`)."""

    def __init__(self, source: torch.Tensor | LazyTensor, start: int, length: int) -> None:
        self.source, self.start = source, start
        self.shape = (length, *tensor_shape(source)[1:])

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return read_slice(self.source, 0, self.start + start, length)
        return read_slice(self.source, 0, self.start, self.shape[0]).narrow(dim, start, length)


class Phi3ForCausalLM(LlamaForCausalLM):
    def _parts(self, fused: str) -> list[tuple[str, int]]:
        """HF per-projection names of a fused checkpoint tensor, with their full row counts."""
        d = self.dims
        if fused == "qkv_proj":
            return [("q_proj", d.num_heads * d.head_dim), ("k_proj", d.num_kv_heads * d.head_dim),
                    ("v_proj", d.num_kv_heads * d.head_dim)]
        return [("gate_proj", d.intermediate_size), ("up_proj", d.intermediate_size)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        def split():
            for name, tensor in weights:
                parts = name.split(".")
                if len(parts) < 2 or parts[-2] not in ("qkv_proj", "gate_up_proj"):
                    yield name, tensor
                    continue
                layout = self._parts(parts[-2])
                rows = tensor_shape(tensor)[0]
                if rows != sum(n for _, n in layout):
                    raise ValueError(f"weight {name!r} has {rows} rows, expected {sum(n for _, n in layout)}")
                start = 0
                for proj, length in layout:
                    yield ".".join(parts[:-2] + [proj, parts[-1]]), RowRange(tensor, start, length)
                    start += length
        super().load_weights(split())
