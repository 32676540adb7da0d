"""Per-layer KV cache scales of an FP8 KV cache, read from the checkpoint.

Quantized checkpoints (llm-compressor, ModelOpt, Quark) carry one float per layer for K and one
for V: the cache holds k / k_scale in fp8 and attention multiplies it back. They are named
`<attention module>.k_scale` / `.v_scale` (also under `.attn.`, or as `k_proj.output_scale`).
They are taken out of the tensor stream here (the model modules never see them) and set on the
attention backend of the module they name; layers without one keep 1.0.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

from torch import nn

from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.model.quant_loading import read_whole

logger = logging.getLogger(__name__)

_KV_SCALE = re.compile(r"^(?P<module>.+?)\.(?:attn\.(?P<a>[kv])_scale|(?P<b>[kv])_scale|(?P<c>[kv])_proj\.output_scale)$")


def take_kv_scales(tensors: Iterable[tuple[str, object]], found: dict[str, float],
                   ignored_suffixes: tuple[str, ...] = ()) -> Iterator[tuple[str, object]]:
    """The tensors without KV scales (collected into `found`, keyed 'module.k' / 'module.v') and
    without the names ending in `ignored_suffixes` (parts of a format nothing reads)."""
    for name, tensor in tensors:
        match = _KV_SCALE.match(name)
        if match:
            which = match.group("a") or match.group("b") or match.group("c")
            value = read_whole(tensor)
            found[f"{match.group('module')}.{which}"] = float(value.reshape(-1)[0])
            continue
        if ignored_suffixes and name.rsplit(".", 1)[-1] in ignored_suffixes:
            continue
        yield name, tensor


def apply_kv_scales(model: nn.Module, found: dict[str, float]) -> None:
    used = 0
    for name, module in model.named_modules():
        backend = getattr(module, "attn", None)
        if not isinstance(backend, AttentionBackend):
            continue
        for which in ("k", "v"):
            value = found.get(f"{name}.{which}")
            if value is not None:
                setattr(backend, f"{which}_scale", value)
                used += 1
    if found:
        logger.info("KV cache scales: %d of %d read from the checkpoint", used, len(found))
