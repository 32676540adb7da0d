"""Builds a model from its HF config and fills its weights (safetensors, GGUF or random)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from tokenmill.config import ModelArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.quantization.methods import (attach_linear_methods, ignored_checkpoint_suffixes,
                                                   process_weights_after_loading)
from tokenmill.model.gguf_loader import GGUFWeights
from tokenmill.model.paths import is_gguf_file
from tokenmill.model.registry import get_model_class
from tokenmill.model.kv_scales import apply_kv_scales, take_kv_scales
from tokenmill.model.weight_source import DummyTensor, SafetensorsTensor
from tokenmill.quant_config import QuantConfig

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DUMMY_STD = 0.02


class SafetensorsWeights:
    """Iterable of (name, tensor) over a HF directory's safetensors files, sharded or not."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"model {path!r} has no .safetensors files")
        self.files = [os.path.join(path, n) for n in names]
        self._count = 0
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                self._count += len(f.keys())

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def lazy(self) -> Iterator[tuple[str, SafetensorsTensor]]:
        """(name, tensor read on demand, in part if asked): a rank reads only its shard."""
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, SafetensorsTensor(f, name)


class DummyWeights:
    """The checkpoint a model of `arch` would have, as random `DummyTensor`s (norms at 1, everything
    else N(0, 0.02) so logits stay sane), identical for every parallel layout."""

    def __init__(self, model_cls, arch: ModelArch, attn_backend_cls, seed: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        with torch.device("meta"):
            full = model_cls(arch, attn_backend_cls)  # one rank: every tensor at its full shape
        self.tensors: list[tuple[str, tuple[int, ...]]] = []
        for name, param in full.named_parameters():
            fused = name.split(".")[-2]
            if fused in ("qkv_proj", "gate_up_proj"):
                for i, size in enumerate(full._shard_sizes(fused)):
                    self.tensors.append((full._hf_name(name, i), (size, *param.shape[1:])))
            else:
                self.tensors.append((name, tuple(param.shape)))
        self.seed, self.device, self.dtype = seed, device, dtype

    def __len__(self) -> int:
        return len(self.tensors)

    def lazy(self) -> Iterator[tuple[str, DummyTensor]]:
        for name, shape in self.tensors:
            yield name, DummyTensor(name, shape, self.seed, self.device, self.dtype,
                                    _fill_norm if "norm" in name.rsplit(".", 2)[-2] else _fill_normal)


def _fill_norm(t: torch.Tensor, generator: torch.Generator) -> None:
    t.fill_(1.0)


def _fill_normal(t: torch.Tensor, generator: torch.Generator) -> None:
    t.normal_(0.0, _DUMMY_STD, generator=generator)


def load_model(path: str, arch: ModelArch, load_format: str, dtype: torch.dtype, device: torch.device,
               attn_backend_cls: type[AttentionBackend], seed: int = 0,
               parallel: ParallelContext | None = None, quant: QuantConfig | None = None) -> nn.Module:
    """The model in eval mode, on `device`, in `dtype`, with weights from `path` per `load_format`;
    with `parallel`, only this rank's pipeline stage and tensor-parallel shard; with `quant`, its
    linears quantized that way (their methods attached before loading, run after it)."""
    model_cls = get_model_class(arch.architecture)
    load_format = _resolve_format(path, load_format)
    device = torch.device(device)
    weights: GGUFWeights | SafetensorsWeights | DummyWeights
    if load_format == "gguf":
        weights = GGUFWeights(path, arch)
    elif load_format == "safetensors":
        weights = SafetensorsWeights(path)
    else:
        weights = DummyWeights(model_cls, arch, attn_backend_cls, seed, device, dtype)
    # Parameters are built on the meta device (no default init) in the target dtype, then
    # allocated uninitialized on the device: loading writes every parameter.
    # Attention backends are built under meta too, so they must allocate tensors lazily.
    with _default_dtype(dtype), torch.device("meta"):
        model = model_cls(arch, attn_backend_cls, parallel)
        attach_linear_methods(model, quant, dtype)
    model.to_empty(device=device)
    kv_scales: dict[str, float] = {}
    tensors = take_kv_scales(weights.lazy(), kv_scales, ignored_checkpoint_suffixes(model))
    model.load_weights(tqdm(tensors, total=len(weights), desc=f"Loading {load_format} weights",
                            unit="tensor", disable=parallel is not None and parallel.layout.rank != 0))
    apply_kv_scales(model, kv_scales)
    process_weights_after_loading(model)
    model.activation_dtype = dtype  # what flows between layers (quantized parameters have other dtypes)
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """What the model's tensors take on its device (quantized ones at their packed size)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _resolve_format(path: str, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if load_format == "auto":
        return "gguf" if is_gguf_file(path) else "safetensors"
    if load_format == "gguf" and not is_gguf_file(path):
        raise ValueError(f"load_format 'gguf' needs a .gguf file, got model {path!r}")
    if load_format == "safetensors" and not os.path.isdir(path):
        raise ValueError(f"load_format 'safetensors' needs a model directory, got model {path!r}")
    return load_format


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
