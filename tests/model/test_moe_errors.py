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
