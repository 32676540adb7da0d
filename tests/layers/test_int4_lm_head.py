"""The 8-bit LM head (`lm_head_8bit`) for INT4 W4A16 models too (issue 22, INT4 batch 1)."""

from __future__ import annotations

import torch


def test_8bit_head_is_for_fp8_and_int4_models_only():
    """`lm_head_8bit.attach` gives the head its 8-bit copy (on CUDA) for models whose linears stream
    fp8 or INT4 weights: an INT4 model's batch-1 step reads the bf16 head as a quarter of its bytes
    (planted: INT4 models left out)."""
    from torch import nn

    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization import lm_head_8bit
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod
    from tokenmill.layers.quantization.int4 import Int4LinearMethod
    from tokenmill.quant_config import QuantConfig

    model = nn.Sequential(Linear(64, 64, bias=False), Linear(64, 64, bias=False))
    assert not lm_head_8bit.has_quantized_linears(model)
    model[1].quant_method = Int4LinearMethod(QuantConfig("int4", "gptq", group_size=32), torch.float32, False)
    assert lm_head_8bit.has_quantized_linears(model)
    model[1].quant_method = Fp8LinearMethod(online=True)
    assert lm_head_8bit.has_quantized_linears(model)
