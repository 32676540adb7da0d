"""Reads GGUF tensors as HF-named float32 torch tensors (dequantized with the gguf package).

llama.cpp's converter permutes the rows of q/k projections of "llama"-architecture
models (to interleaved rope); that is undone here, as transformers' GGUF loader does,
so the tensors match the HF checkpoint layout our neox-style rope expects.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from tokenmill.config import ModelArch

# Per-block llama.cpp tensor names -> HF names under model.layers.N.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors with nothing for us: llama3 rope factors (transformers' GGUF config ignores them too).
_SKIPPED = frozenset({"rope_freqs.weight"})
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Architectures whose q/k rows the llama.cpp converter permuted.
_PERMUTED_ARCHS = frozenset({"llama"})
# Read without the quantization machinery.
_PLAIN_TYPES = {gguf.GGMLQuantizationType.F64: np.float64}


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF name; ValueError for a name it does not know."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _TOP_NAMES and suffix in ("weight", "bias"):
            return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF equivalent")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: rows (head, pair, half) -> (head, half, pair)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """float32 numpy array in HF (row-major, outermost-first) shape; ValueError if the type is unsupported."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return dequantize_rows(tensor, 0, shape[0])


def dequantize_rows(tensor: Any, start: int, length: int) -> np.ndarray:
    """Rows [start, start + length) of the HF-shaped tensor, dequantizing only those rows
    (quantized blocks run along a row, so rows are independent)."""
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = tensor.data[start:start + length]
    if qtype in _PLAIN_TYPES:
        arr = np.asarray(data).view(_PLAIN_TYPES[qtype]).astype(np.float32)
    else:
        try:
            arr = gguf.quants.dequantize(data, qtype)
        except NotImplementedError:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {qtype.name}; supported: F32, F16, BF16, "
                f"Q8_0, Q4_0, Q4_1 and the other types the gguf package can dequantize") from None
    arr = np.asarray(arr, dtype=np.float32).reshape((length, *shape[1:]))
    return arr if arr.flags.writeable else arr.copy()  # F32 comes back as a read-only memmap view


class GGUFTensor:
    """One GGUF tensor as a `LazyTensor`: a row slice dequantizes only its rows; q/k rows are
    un-permuted per head (a rank's slice holds whole heads)."""

    def __init__(self, tensor: Any, permuted_head_dim: int | None) -> None:
        self._tensor = tensor
        self._head_dim = permuted_head_dim
        self.shape = tuple(int(d) for d in reversed(tensor.shape))

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            arr = self._unpermute(dequantize_rows(self._tensor, start, length))
        else:
            arr = self._unpermute(dequantize_rows(self._tensor, 0, self.shape[0]))[:, start:start + length]
        return torch.from_numpy(np.ascontiguousarray(arr))

    def _unpermute(self, arr: np.ndarray) -> np.ndarray:
        return arr if self._head_dim is None else unpermute_rows(arr, arr.shape[0] // self._head_dim)


class GGUFWeights:
    """Iterable of (HF name, float32 tensor) over a GGUF file's tensors; len() is the tensor count.
    `lazy()` gives the same names with `GGUFTensor`s, for loading a shard."""

    def __init__(self, path: str, arch: ModelArch) -> None:
        self.reader = gguf.GGUFReader(path)
        field = self.reader.fields.get("general.architecture")
        self.architecture = str(field.contents()) if field is not None else ""
        self.head_dim = arch.head_dim

    def __len__(self) -> int:
        return len(self.reader.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.lazy():
            yield name, tensor.read(0, 0, tensor.shape[0])

    def lazy(self) -> Iterator[tuple[str, GGUFTensor]]:
        permuted = self.architecture in _PERMUTED_ARCHS
        for tensor in self.reader.tensors:
            if tensor.name in _SKIPPED:
                continue
            name = hf_tensor_name(tensor.name)
            qk = ".attn_q." in tensor.name or ".attn_k." in tensor.name
            yield name, GGUFTensor(tensor, self.head_dim if permuted and qk else None)
