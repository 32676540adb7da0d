"""gpt-oss's MoE pieces: the biased router (top-k of the logits, softmax over those k) against HF's
GptOssTopKRouter, the CPU experts (biases, interleaved gate/up de-interleaved at load, clamped
SwiGLU) against HF's GptOssExperts, and the fused Triton kernel's bias + clamped-SwiGLU variant
against the per-expert loop in Triton's interpreter (fp32, fp16), with inputs that cross the clamp.
Each check is also run with a planted defect (no clamp, no bias, interleaving kept) that it catches."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_moe_models import make_moe_config
from tokenmill.layers.moe.layer import Router
from tokenmill.layers.moe.torch_experts import Activation, experts_forward, experts_reference
from tokenmill.model.moe_arch import moe_arch

CLAMPED = Activation("swiglu_clamped", 1.702, 1.5)


def _hf_to_ours(experts) -> tuple[torch.Tensor, ...]:
    """HF GptOssExperts' tensors -> (w13 [E, 2I, H], b13 [E, 2I], w2 [E, H, I], b2 [E, H]), as our loader
    places them (gate = even columns, up = odd)."""
    gu, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gu[:, :, 0::2], gu[:, :, 1::2]], dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=1)
    return w13, b13, experts.down_proj.detach().transpose(1, 2).contiguous(), experts.down_proj_bias.detach()


def _hf_moe(seed=0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
    config = make_moe_config("gpt_oss")
    gen = torch.Generator().manual_seed(seed)
    router, experts = GptOssTopKRouter(config), GptOssExperts(config)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    x = torch.randn(30, config.hidden_size, generator=gen)
    return config, router, experts, x


def test_router_matches_hf():
    config, hf_router, _, x = _hf_moe()
    moe = moe_arch(config, config.model_type)
    router = Router(config.hidden_size, moe)
    with torch.no_grad():
        router.weight.copy_(hf_router.weight)
        router.bias.copy_(hf_router.bias)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = router(x)
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, ours = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.gather(1, ours), hf_weights.gather(1, order), atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        router.bias.zero_()  # planted: the bias dropped
    assert not torch.equal(router(x)[1].sort(dim=-1).values, hf_ids)


def test_cpu_experts_match_hf():
    config, router, experts, x = _hf_moe()
    _, weights, ids = router(x)
    with torch.no_grad():
        expected = experts(x, ids, weights)
    w13, b13, w2, b2 = _hf_to_ours(experts)
    act = Activation("swiglu_clamped", config.swiglu_alpha, config.swiglu_limit)
    out = experts_forward(x, w13, w2, weights, ids, b13, b2, act)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_reference(x, w13, w2, weights, ids, b13, b2, act), expected,
                               atol=1e-5, rtol=1e-5)
    # Planted defects: each must miss HF.
    unclamped = Activation("swiglu_clamped", config.swiglu_alpha, 1e9)
    gu = experts.gate_up_proj.detach().transpose(1, 2).contiguous()  # interleaving kept
    for bad in (experts_forward(x, w13, w2, weights, ids, b13, b2, unclamped),
                experts_forward(x, w13, w2, weights, ids, None, None, act),
                experts_forward(x, gu, w2, weights, ids, b13, b2, act)):
        assert not torch.allclose(bad, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype,t", [(torch.float32, 9), (torch.float16, 9), (torch.float32, 1)])
def test_fused_kernel_with_biases_and_clamp_matches_the_loop(dtype, t):
    pytest.importorskip("triton")
    from tokenmill.layers.moe.fused_moe import fused_experts
    from tokenmill.layers.moe.tile_configs import TileConfig
    gen = torch.Generator().manual_seed(3)
    e, h, i, k = 6, 32, 24, 3
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / 2).to(dtype)  # projections of std ~3: past the limit
    w2 = (torch.randn(e, h, i, generator=gen) / 4).to(dtype)
    b13 = torch.randn(e, 2 * i, generator=gen).to(dtype)
    b2 = torch.randn(e, h, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # expert 5 gets none
    weights = torch.rand(t, k, generator=gen)
    config = TileConfig(block_m=16, block_n=16, block_k=16, down_block_n=32, down_block_k=16)
    ref = experts_reference(x.float(), w13.float(), w2.float(), weights, ids, b13.float(), b2.float(), CLAMPED)
    out = fused_experts(x, w13, w2, weights, ids, config, b13=b13, b2=b2, act=CLAMPED)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for bad in (fused_experts(x, w13, w2, weights, ids, config, b13=b13, b2=b2, act=Activation()),
                fused_experts(x, w13, w2, weights, ids, config, b13=b13, b2=b2,
                              act=Activation("swiglu_clamped", 1.702, 1e9)),
                fused_experts(x, w13, w2, weights, ids, config, b13=b13 * 0, b2=b2, act=CLAMPED),
                fused_experts(x, w13, w2, weights, ids, config, b13=b13, b2=b2 * 0, act=CLAMPED)):
        assert not torch.allclose(bad.float(), ref, atol=tol * 10, rtol=tol * 10)
