"""The interface of a linear layer's computation (`LinearMethod`) and how its parameters map
onto checkpoint tensors (`ParamLayout`).

A layer is an `nn.Linear` ([out, in] `weight`, optional `bias`) of this rank's local sizes. A
method may replace `weight` with its own parameters (setting `layer.weight` to None), each
tagged with a `ParamLayout` so that the model's loader can shard and fuse them like a weight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """Where a quantized parameter keeps a weight's output and input features.

    `out_dim` / `in_dim`: the tensor axis holding output / input features (None: the parameter
    does not vary along them: replicated, never sliced). Along an axis, `div` features share one
    entry (8 for int4 packed along it, the group size for group scales, a block for block
    scales; edge blocks may be partial, so sizes round up). `scalar_ok`: a checkpoint may give
    one number for the whole tensor (per-tensor scales), which fills the part it loads into.
    """

    out_dim: int | None
    out_div: int = 1
    in_dim: int | None = None
    in_div: int = 1
    scalar_ok: bool = False


def new_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, layout: ParamLayout) -> None:
    """A loadable parameter; its layout is kept on the layer (`quant_layouts`), since moving a
    module between devices may replace its Parameter objects."""
    layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    if "quant_layouts" not in layer.__dict__:
        layer.quant_layouts = {}
    layer.quant_layouts[name] = layout


def quant_layout_of(layer: nn.Module, name: str) -> ParamLayout | None:
    return layer.__dict__.get("quant_layouts", {}).get(name)


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set (or drop, with None) a processed parameter: no layout, so it is no longer loadable."""
    layer.__dict__.get("quant_layouts", {}).pop(name, None)
    if name in layer._parameters:
        del layer._parameters[name]
    if value is None:
        layer.register_parameter(name, None)
    else:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class LinearMethod(ABC):
    """How one `Linear` holds and applies its weight. Stateless per layer: one instance may
    serve every layer of a model; per-layer data lives in the layer's parameters."""

    quantized = True
    # Checkpoint tensor suffixes of this format that carry nothing this method uses.
    ignored_suffixes: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module) -> None:
        """Register the parameters loading fills (called once the layer exists, on any device)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack, quantize (online) or move the loaded parameters into the form `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` for x [..., in_features]."""

    def apply_add(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                  other: torch.Tensor) -> torch.Tensor:
        return self.apply(layer, x, bias) + other

    def describe(self) -> str:
        return type(self).__name__
