"""A checkpoint tensor read lazily, whole or in part, so each rank reads only its shard.

`load_weights` takes (HF name, tensor or `LazyTensor`) pairs; it asks for the slice its rank
holds (`read_slice`) and never touches the tensors of layers on other pipeline stages.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Protocol

import torch


class LazyTensor(Protocol):
    shape: tuple[int, ...]

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length) of the tensor."""


def tensor_shape(source: torch.Tensor | LazyTensor) -> tuple[int, ...]:
    return tuple(source.shape)


def read_slice(source: torch.Tensor | LazyTensor, dim: int | None = None, start: int = 0,
               length: int | None = None) -> torch.Tensor:
    """The whole tensor (dim None), or `length` entries along `dim` from `start`."""
    if dim is None:
        dim, start, length = 0, 0, source.shape[0]
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, length)
    return source.read(dim, start, length)


class SafetensorsTensor:
    """One tensor of an open safetensors file, read through its slice API."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
        return self._slice[index]


class DummyTensor:
    """Random weights of a checkpoint that does not exist: each tensor drawn from its own generator,
    seeded by (seed, name), so every rank and every parallel layout sees the same full tensor."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype,
                 fill: Callable[[torch.Tensor, torch.Generator], None]) -> None:
        self.name, self.shape = name, shape
        self._seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)
        self._device, self._dtype, self._fill = device, dtype, fill

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        full = torch.empty(self.shape, dtype=self._dtype, device=self._device)
        self._fill(full, torch.Generator(device=self._device).manual_seed(self._seed))
        return full.narrow(dim, start, length)
