"""MoE/MLA configs tokenmill cannot run fail with an error naming the field and the limit."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_moe_models import make_moe_config
from tokenmill.distributed.layout import check_parallel
from tokenmill.model.arch import model_arch


@pytest.mark.parametrize("arch,overrides,match", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ("deepseek_v2", {"n_group": 3}, "n_group=3 must divide the 8 routed experts"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
])
def test_unsupported_configs_are_named(arch, overrides, match):
    with pytest.raises(ValueError, match=match):
        model_arch(make_moe_config(arch, **overrides))


def test_tensor_parallel_must_divide_the_expert_size():
    arch = model_arch(make_moe_config("qwen2_moe", moe_intermediate_size=30, num_attention_heads=4))
    check_parallel(arch, 2, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide the model's moe_intermediate_size \(30\)"):
        check_parallel(arch, 4, 1)


def test_mxfp4_checkpoints_load_unquantized_linears_and_refuse_another_method():
    """gpt-oss's MXFP4 experts are dequantized by its loader: no linear method; asking for one is refused."""
    from tokenmill.quant_config import resolve_quantization
    assert resolve_quantization(None, {"quant_method": "mxfp4"}) is None
    with pytest.raises(ValueError, match="quantization 'fp8' does not apply to a checkpoint of quant_method 'mxfp4'"):
        resolve_quantization("fp8", {"quant_method": "mxfp4"})


def test_mxfp4_halves_must_pair(tmp_path):
    """A gpt-oss MXFP4 tensor whose scales never come is an error naming it."""
    import torch
    from tokenmill.model.gpt_oss import GptOssForCausalLM
    from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
    arch = model_arch(make_moe_config("gpt_oss"))
    with torch.device("meta"):
        model = GptOssForCausalLM(arch, TorchRefAttentionBackend)
    model.to_empty(device="cpu")
    weights = [("model.layers.0.mlp.experts.down_proj_blocks", torch.zeros(6, 64, 1, 16, dtype=torch.uint8))]
    with pytest.raises(ValueError, match=r"without their other half.*layers\.0\.mlp\.experts\.down_proj"):
        model.load_weights(weights)
