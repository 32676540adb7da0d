"""What a quantized model's linears hold: read once from the HF config's `quantization_config`
(or asked for with `quantization="fp8"`) into a typed, frozen `QuantConfig` that travels with the
`ModelConfig` to every worker. Plain Python: no torch, no transformers.

Supported (anything else is refused here, at start, naming the field and listing what is):
- FP8 W8A8, dynamic per-token activation scales:
  `quantization="fp8"` on a float checkpoint (online: per-channel weight scales), checkpoints of
  `quant_method` `fp8` (per-tensor scales, or `weight_block_size` [bn, bk] with `weight_scale_inv`),
  `fbgemm_fp8` (per-channel) and `compressed-tensors` float-quantized (8-bit float weights,
  channel or tensor strategy).
- INT4 W4A16: `gptq` (v1 and v2 zero points, group size, `desc_act`, sym/asym), `awq` (GEMM
  packing) and `compressed-tensors` `pack-quantized` (4-bit int weights, group or channel).
- MXFP4 experts (`mxfp4`, gpt-oss): the family's loader dequantizes them at load
  (`tokenmill.model.mxfp4`); every linear stays float, so no QuantConfig.
"""

from __future__ import annotations

from typing import Any

import msgspec

FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
INT4_METHODS = ("gptq", "awq", "compressed-tensors")
SUPPORTED_QUANT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "gptq", "awq")
SUPPORTED_BITS = (4,)
# Formats whose tensors the model's loader dequantizes at load (the linears run in float).
DEQUANTIZED_AT_LOAD = ("mxfp4",)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128, 256)
# vLLM's names for kernels of the same formats.
_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}


class QuantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """scheme: how the linears compute. fmt: the checkpoint layout their tensors arrive in."""

    scheme: str  # fp8 (per-channel/per-tensor W8A8) | fp8_block | int4 (W4A16)
    fmt: str  # fp8 | fbgemm_fp8 | compressed-tensors | gptq | awq
    online: bool = False  # quantize float weights at load (quantization="fp8", dummy weights)
    block: tuple[int, ...] = ()  # fp8_block: (output rows, input columns) per scale
    group_size: int = -1  # int4: input channels per scale; -1: one group (per channel)
    sym: bool = True  # int4: no zero points (the midpoint, 8)
    desc_act: bool = False  # gptq: act-order (g_idx gives each input channel's group)
    zero_offset: int = 0  # gptq v1 stores zero points minus one: add this back
    ignore: tuple[str, ...] = ()  # HF module names (or "re:" patterns) left unquantized

    def describe(self) -> str:
        if self.scheme == "int4":
            group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
            extra = (", act-order" if self.desc_act else "") + (", sym" if self.sym else ", asym")
            return f"int4 W4A16 ({self.fmt}, {group}{extra})"
        if self.scheme == "fp8_block":
            return f"fp8 W8A8 ({self.fmt}, {self.block[0]}x{self.block[1]} blocks)"
        return f"fp8 W8A8 ({'online' if self.online else self.fmt}, per-channel weights, per-token activations)"


def resolve_quantization(requested: str | None, hf_quant: dict[str, Any] | None,
                         load_format: str = "auto") -> QuantConfig | None:
    """The model's QuantConfig: from the checkpoint's `quantization_config`, or online fp8 when
    `requested` is "fp8" and the checkpoint is not quantized. A dummy model of a quantized
    config quantizes its random float weights at load into that format (benchmarks)."""
    if requested is not None:
        requested = _ALIASES.get(requested, requested)
        if requested not in SUPPORTED_QUANT_METHODS:
            raise ValueError(f"quantization {requested!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_QUANT_METHODS)} (only fp8 quantizes a float checkpoint online)")
    if not hf_quant:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(f"quantization {requested!r} needs a checkpoint quantized that way (its config has "
                             f"no quantization_config); only fp8 quantizes a float checkpoint online")
        return QuantConfig(scheme="fp8", fmt="fp8", online=True)
    method = _ALIASES.get(str(hf_quant.get("quant_method", "")), str(hf_quant.get("quant_method", "")))
    if method in DEQUANTIZED_AT_LOAD:
        if requested is not None:
            raise ValueError(f"quantization {requested!r} does not apply to a checkpoint of quant_method "
                             f"{method!r} (its tensors are dequantized at load; leave quantization unset)")
        return None
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_QUANT_METHODS)}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization {requested!r} does not match the checkpoint's quant_method {method!r}")
    config = _PARSERS[method](hf_quant)
    if load_format == "dummy":
        config = msgspec.structs.replace(config, online=True)
    return config


def _parse_fp8(q: dict[str, Any]) -> QuantConfig:
    ignore = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported; supported: dynamic, "
                         f"static (its input scales are not used: activations are scaled per token)")
    block = q.get("weight_block_size")
    if block is None:
        return QuantConfig(scheme="fp8", fmt="fp8", ignore=ignore)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b >= 16 and
                                                                       b & (b - 1) == 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported; supported: "
                         f"two powers of two >= 16, e.g. [128, 128]")
    return QuantConfig(scheme="fp8_block", fmt="fp8", block=tuple(block), ignore=ignore)


def _parse_fbgemm(q: dict[str, Any]) -> QuantConfig:
    return QuantConfig(scheme="fp8", fmt="fbgemm_fp8", ignore=tuple(q.get("modules_to_not_convert") or ()))


def _check_int4(bits: Any, group_size: Any, field: str) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantization_config.{field}bits {bits!r} is not supported; supported: "
                         f"{', '.join(map(str, SUPPORTED_BITS))}")
    group_size = -1 if group_size is None else group_size
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"quantization_config.{field}group_size {group_size!r} is not supported; supported: "
                         f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
    return group_size


def _parse_gptq(q: dict[str, Any]) -> QuantConfig:
    group = _check_int4(q.get("bits"), q.get("group_size", 128), "")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    return QuantConfig(scheme="int4", fmt="gptq", group_size=group, sym=bool(q.get("sym", True)),
                       desc_act=bool(q.get("desc_act", False)), zero_offset=1 if fmt == "gptq" else 0,
                       ignore=tuple(q.get("modules_to_not_convert") or ()))


def _parse_awq(q: dict[str, Any]) -> QuantConfig:
    group = _check_int4(q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size", 128)), "")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r} is not supported; supported: gemm")
    if not q.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false is not supported for awq; supported: true")
    return QuantConfig(scheme="int4", fmt="awq", group_size=group, sym=False,
                       ignore=tuple(q.get("modules_to_not_convert") or ()))


def _parse_compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: exactly one group is supported, got {len(groups)}")
    group = next(iter(groups.values()))
    fmt = group.get("format") or q.get("format")
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    ignore = tuple(q.get("ignore") or ())
    wtype, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if wtype == "float" and bits == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"quantization_config.format {fmt!r} is not supported for 8-bit float weights; "
                             f"supported: float-quantized")
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"quantization_config weights.strategy {strategy!r} is not supported for fp8; "
                             f"supported: channel, tensor")
        if acts is not None and not (acts.get("dynamic") and acts.get("strategy") == "token"):
            raise ValueError("quantization_config input_activations: only dynamic per-token fp8 is supported "
                             f"(FP8_DYNAMIC), got {acts!r}")
        return QuantConfig(scheme="fp8", fmt="compressed-tensors", ignore=ignore)
    if wtype == "int":
        if fmt != "pack-quantized":
            raise ValueError(f"quantization_config.format {fmt!r} is not supported for int weights; "
                             f"supported: pack-quantized")
        if acts is not None:
            raise ValueError("quantization_config input_activations: int weights are supported weight-only "
                             f"(W4A16), got activation quantization {acts!r}")
        if strategy not in ("group", "channel"):
            raise ValueError(f"quantization_config weights.strategy {strategy!r} is not supported for int4; "
                             f"supported: group, channel")
        size = _check_int4(bits, weights.get("group_size") if strategy == "group" else -1, "weights.")
        if weights.get("actorder") not in (None, False):
            raise ValueError(f"quantization_config weights.actorder {weights.get('actorder')!r} is not supported "
                             f"for compressed-tensors; supported: null")
        return QuantConfig(scheme="int4", fmt="compressed-tensors", group_size=size,
                           sym=bool(weights.get("symmetric", True)), ignore=ignore)
    raise ValueError(f"quantization_config weights type {wtype!r} with num_bits {bits!r} is not supported; "
                     f"supported: float 8 (FP8_DYNAMIC), int 4 (W4A16 pack-quantized)")


_PARSERS = {"fp8": _parse_fp8, "fbgemm_fp8": _parse_fbgemm, "gptq": _parse_gptq, "awq": _parse_awq,
            "compressed-tensors": _parse_compressed_tensors}

KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def resolve_kv_cache_dtype(name: str, model_dtype: str) -> str:
    """vLLM's `kv_cache_dtype` names into a torch dtype name (auto: the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype
