"""Which `LinearMethod` each `Linear` of a built model gets, and the after-loading pass.

The model modules build plain `Linear`s; the loader calls `attach_linear_methods` once the model
exists (on the meta device, before its tensors are allocated) and `process_weights_after_loading`
once every checkpoint tensor is in. Layers the config ignores (by HF module name) stay float.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from tokenmill.layers.linear import UNQUANTIZED, Linear
from tokenmill.layers.parallel_linear import RowParallelLinear
from tokenmill.layers.quantization.base import LinearMethod
from tokenmill.quant_config import QuantConfig

logger = logging.getLogger(__name__)

# Fused linears and the HF modules they stand for (an ignore list names the HF ones).
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _hf_names(prefix: str) -> list[str]:
    head, _, last = prefix.rpartition(".")
    return [f"{head}.{part}" if head else part for part in _FUSED_PARTS.get(last, (last,))]


def is_ignored(config: QuantConfig, prefix: str) -> bool:
    for name in _hf_names(prefix):
        for item in config.ignore:
            if item.startswith("re:"):
                if re.fullmatch(item[3:], name):
                    return True
            elif name == item or name.endswith("." + item) or f".{item}." in f".{name}.":
                return True
    return False


def make_linear_method(config: QuantConfig, act_dtype: torch.dtype, row_parallel: bool) -> LinearMethod:
    if config.scheme == "fp8":
        from tokenmill.layers.quantization.fp8 import Fp8LinearMethod
        return Fp8LinearMethod(config.online)
    if config.scheme == "fp8_block":
        from tokenmill.layers.quantization.fp8 import Fp8BlockLinearMethod
        return Fp8BlockLinearMethod(tuple(config.block), config.online)
    if config.scheme == "int4":
        from tokenmill.layers.quantization.int4 import Int4LinearMethod
        return Int4LinearMethod(config, act_dtype, row_parallel)
    raise ValueError(f"quantization scheme {config.scheme!r} is not supported; supported: fp8, fp8_block, int4")


def attach_linear_methods(model: nn.Module, config: QuantConfig | None, act_dtype: torch.dtype) -> None:
    """Give every `Linear` its method and let the method create its parameters."""
    if config is None:
        return
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or is_ignored(config, name):
            continue
        row_parallel = isinstance(module, RowParallelLinear)
        module.full_in_features = module.in_features * (module.parallel.tp_size if row_parallel else 1)
        module.quant_method = make_linear_method(config, act_dtype, row_parallel)
        module.quant_method.create_weights(module)


def ignored_checkpoint_suffixes(model: nn.Module) -> tuple[str, ...]:
    """Tensor-name suffixes the attached formats carry but never read (e.g. static input scales)."""
    found: set[str] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            found.update(module.quant_method.ignored_suffixes)
    return tuple(sorted(found))


def process_weights_after_loading(model: nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear) and module.quant_method is not UNQUANTIZED:
                module.quant_method.process_weights_after_loading(module)
    for module in model.modules():
        if isinstance(module, Linear):
            module.rebind()  # the weights are final: each layer's forward is decided for them (`Linear.rebind`)
    from tokenmill.layers.quantization.fp8 import mark_fused_producers
    mark_fused_producers(model)  # norms / activations that feed W8A8 linears quantize for them
    from tokenmill.layers.quantization import int4_kperm
    linked = int4_kperm.mark_producers(model)  # ... and write INT4 linears' input in the swapped GEMM's K order
    if linked:
        logger.info("int4: %d norms / activations write their INT4 linear's input in the swapped GEMM's K order "
                    "where it takes the rows (TOKENMILL_INT4_KPERM=%d)", linked, int(int4_kperm.ENABLED))
    from tokenmill.layers.quantization import lm_head_8bit
    lm_head_8bit.attach(model)  # (opt-in: TOKENMILL_LM_HEAD_8BIT=int8|fp8)


def linear_methods_summary(model: nn.Module) -> str:
    """'fp8 W8A8 (...) x 210, unquantized x 2': what the model's linears compute with."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            what = module.quant_method.describe()
            counts[what] = counts.get(what, 0) + 1
    return ", ".join(f"{what} x {n}" for what, n in counts.items()) or "no linears"
