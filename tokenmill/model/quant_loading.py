"""Loads one checkpoint tensor into a quantized parameter: the rank's shard and the fused part,
found from the parameter's `ParamLayout`, the same way a float weight's rows and columns are.

The model's loader describes the load in weight terms (features, not tensor entries):
- `part`: (offset, size) of the fused parameter's output features this tensor fills (q/k/v,
  gate/up), or None;
- `full`: the checkpoint's (output, input) feature counts for this tensor's weight;
- `source`: (0, start, length) for output features this rank reads (column parallel),
  (1, start, length) for input features (row parallel), or None (the whole tensor).
A parameter without a layout along the sharded axis is replicated there (read whole).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantization.base import ParamLayout, quant_layout_of
from tokenmill.model.weight_source import LazyTensor, read_slice, tensor_shape

TensorSource = torch.Tensor | LazyTensor


def quantized_layout(model: nn.Module, name: str) -> ParamLayout | None:
    """The layout of parameter `name` (dotted) when a quantized linear method created it."""
    prefix, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    return quant_layout_of(module, leaf)


def _entries(features: int, div: int) -> int:
    return -(-features // div)  # partial edge blocks round up


def _aligned(value: int, div: int, what: str, hf_name: str) -> int:
    if value % div:
        raise ValueError(f"weight {hf_name!r}: {what} {value} is not a multiple of {div} (the format's packing, "
                         f"group or block size along that axis)")
    return value // div


def load_quantized_param(param: torch.Tensor, layout: ParamLayout, hf_name: str, tensor: TensorSource,
                         part: tuple[int, int] | None, full: tuple[int, int], source: tuple[int, int, int] | None
                         ) -> None:
    target = param.data
    if part is not None and layout.out_dim is not None:
        offset = _aligned(part[0], layout.out_div, "the fused part's first output row", hf_name)
        target = target.narrow(layout.out_dim, offset, _entries(part[1], layout.out_div))
    shape = tensor_shape(tensor)
    expected = list(target.shape)
    if layout.out_dim is not None:
        expected[layout.out_dim] = _entries(full[0], layout.out_div)
    if layout.in_dim is not None and layout.in_div:
        expected[layout.in_dim] = _entries(full[1], layout.in_div)
    if layout.scalar_ok and (len(shape) == 0 or shape == (1,)):
        value = read_whole(tensor)
        with torch.no_grad():
            target.fill_(value.reshape(()).item())
        return
    # Per-channel scales arrive as [N], [N, 1] or [1, N]: accept any of them with N entries.
    squeezed = tuple(s for s in shape if s != 1)
    if shape != tuple(expected) and not (layout.scalar_ok and squeezed == tuple(s for s in expected if s != 1)):
        raise ValueError(f"weight {hf_name!r} has shape {shape}, expected {tuple(expected)}")
    value = _read(tensor, layout, source, hf_name, shape, expected)
    if part is not None and layout.out_dim is None:
        # A tensor that fused parts share (act-order g_idx): every part must carry the same one.
        if getattr(param, "_shared_part_loaded", False):
            if not torch.equal(target, value.reshape(target.shape).to(device=target.device, dtype=target.dtype)):
                raise ValueError(f"weight {hf_name!r} differs from the one of the part fused with it; "
                                 f"the fused linear can hold only one")
            return
        param._shared_part_loaded = True
    with torch.no_grad():
        target.copy_(value.reshape(target.shape))


def read_whole(tensor: TensorSource) -> torch.Tensor:
    """The whole tensor, 0-d ones (per-tensor scales) included."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    if len(tensor.shape) == 0:
        return tensor._slice[...]  # a safetensors slice reads a 0-d tensor whole
    return read_slice(tensor)


def _read(tensor: TensorSource, layout: ParamLayout, source: tuple[int, int, int] | None, hf_name: str,
          shape: tuple[int, ...], expected: list[int]) -> torch.Tensor:
    if source is None:
        return read_slice(tensor)
    dim, start, length = source
    axis, div = (layout.out_dim, layout.out_div) if dim == 0 else (layout.in_dim, layout.in_div)
    if axis is None or not div:
        return read_slice(tensor)  # replicated along the sharded axis
    if shape != tuple(expected):  # a squeezed per-channel scale: slice its one long axis
        axis = max(range(len(shape)), key=lambda i: shape[i])
    first = _aligned(start, div, "this rank's first feature", hf_name)
    count = _entries(length, div)
    if axis > 1:
        raise ValueError(f"weight {hf_name!r}: cannot shard along axis {axis}")
    return read_slice(tensor, axis, first, count)
