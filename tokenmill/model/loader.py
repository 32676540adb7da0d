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
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.model.gguf_loader import GGUFWeights
from tokenmill.model.paths import is_gguf_file
from tokenmill.model.registry import get_model_class

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


def load_model(path: str, arch: ModelArch, load_format: str, dtype: torch.dtype, device: torch.device,
               attn_backend_cls: type[AttentionBackend], seed: int = 0) -> nn.Module:
    """The model in eval mode, on `device`, in `dtype`, with weights from `path` per `load_format`."""
    model_cls = get_model_class(arch.architecture)
    load_format = _resolve_format(path, load_format)
    weights: GGUFWeights | SafetensorsWeights | None = None
    if load_format == "gguf":
        weights = GGUFWeights(path, arch)
    elif load_format == "safetensors":
        weights = SafetensorsWeights(path)
    # Parameters are built on the meta device (no default init) in the target dtype, then
    # allocated uninitialized on the device: both branches below write every parameter.
    # Attention backends are built under meta too, so they must allocate tensors lazily.
    with _default_dtype(dtype), torch.device("meta"):
        model = model_cls(arch, attn_backend_cls)
    model.to_empty(device=device)
    if weights is None:
        _init_dummy(model, seed, torch.device(device))
    else:
        model.load_weights(tqdm(weights, total=len(weights), desc=f"Loading {load_format} weights", unit="tensor"))
    return model.eval()


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


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int, device: torch.device) -> None:
    """Deterministic random weights: norms at 1, everything else N(0, 0.02) so logits stay sane."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
        else:
            param.normal_(0.0, _DUMMY_STD, generator=generator)
