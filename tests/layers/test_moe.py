"""The MoE layer's pieces: routing against HF's own routers, the CPU experts against the per-expert
loop (and only experts with tokens run), the device-side alignment, and the fused Triton kernel
against the loop in Triton's interpreter (fp32, fp16; small shapes: the interpreter is slow)."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.tiny_moe_models import make_moe_config
from tokenmill.layers.moe import torch_experts
from tokenmill.layers.moe.align import align_by_expert
from tokenmill.layers.moe.routing import select_experts
from tokenmill.layers.moe.torch_experts import experts_forward, experts_reference
from tokenmill.model.moe_arch import moe_arch


def _hf_router(arch: str, config):
    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as R
    elif arch in ("qwen2_moe", "qwen3_moe"):
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeTopKRouter as R,
        )
    elif arch == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter as R
    elif arch == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as R,
        )
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as R,
        )
    return R(config)


@pytest.mark.parametrize("arch,overrides", [
    ("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}),
    ("olmoe", {"norm_topk_prob": True}), ("deepseek_v2", {}), ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v3", {}), ("deepseek_v3", {"norm_topk_prob": False, "routed_scaling_factor": 2.5}),
])
def test_routing_matches_hf_routers(arch, overrides):
    config = make_moe_config(arch, **overrides)
    moe = moe_arch(config, config.model_type)
    router = _hf_router(arch, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        bias = None
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(moe.num_experts, generator=gen) * 0.1)
            bias = router.e_score_correction_bias
    x = torch.randn(40, config.hidden_size, generator=gen)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight), moe, bias)
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, ours = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.gather(1, ours), hf_weights.float().gather(1, order), atol=1e-6, rtol=1e-6)


def _random_experts(t=9, e=6, h=32, i=24, k=2, dtype=torch.float32, unused=(4,)):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / 4).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / 4).to(dtype)
    allowed = torch.tensor([j for j in range(e) if j not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    return x, w13, w2, weights, ids


def test_cpu_experts_match_the_loop_and_skip_idle_experts(monkeypatch):
    x, w13, w2, weights, ids = _random_experts()
    calls = []
    linear = F.linear
    monkeypatch.setattr(torch_experts.F, "linear", lambda a, w, b=None: calls.append(a.shape[0]) or linear(a, w, b))
    out = experts_forward(x, w13, w2, weights, ids)
    used = len(set(ids.flatten().tolist()))
    assert used < w13.shape[0] and len(calls) == 2 * used, "only experts that received tokens run"
    assert sum(calls) == 2 * ids.numel(), "each token-expert pair is computed once"
    monkeypatch.setattr(torch_experts.F, "linear", linear)
    torch.testing.assert_close(out, experts_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_alignment_pads_each_expert_to_the_block():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])
    align = align_by_expert(ids, num_experts=5, block_m=4)
    pairs, experts = align.sorted_pairs.tolist(), align.block_expert.tolist()
    sentinel = ids.numel()
    for block, expert in enumerate(experts):
        rows = [p for p in pairs[block * 4:(block + 1) * 4] if p != sentinel]
        if expert >= 5:
            assert not rows
        assert all(ids.flatten()[p] == expert for p in rows)
    assert sorted(p for p in pairs if p != sentinel) == list(range(sentinel))
    assert experts[:4] == [0, 2, 3, 5] and align.max_blocks == -(-(8 + 5 * 3) // 4)


@pytest.mark.parametrize("arch,overrides", [("olmoe", {}), ("qwen3_moe", {}), ("mixtral", {}),
                                            ("olmoe", {"norm_topk_prob": True, "num_experts": 20})])
@pytest.mark.parametrize("t", [1, 19])
def test_triton_router_equals_the_torch_rule(arch, overrides, t):
    """The Triton router (CUDA): the same experts and weights as `select_experts` over the float32
    logits, with a router bias (gpt-oss) and a scaling factor too."""
    pytest.importorskip("triton")
    from tokenmill.layers.moe.triton_router import route
    config = make_moe_config(arch, **overrides)
    moe = moe_arch(config, config.model_type)
    gen = torch.Generator().manual_seed(t)
    e, h = moe.num_experts, 300  # the logits split the hidden axis: 5 slices of 64, the last one ragged
    x, w, bias = torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen), torch.randn(e, generator=gen)
    for b, m in ((None, moe), (bias, msgspec.structs.replace(moe, routed_scaling_factor=2.5, router_bias=True))):
        want_w, want_ids = select_experts(F.linear(x, w, b), m)
        got_w, got_ids = route(x, w, b, m)
        assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
        want_ids, order = want_ids.sort(dim=-1)
        got_ids, got_order = got_ids.sort(dim=-1)
        assert torch.equal(got_ids, want_ids)
        # float32 summation order: the kernel sums 5 slices of the hidden axis, F.linear whatever its BLAS
        # does on this CPU (on an AMX Xeon MKL's order moved one weight by 1.4e-5 relative)
        torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, order), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("t,k,e,block_m", [(1, 8, 128, 16), (9, 3, 6, 4), (300, 8, 64, 32), (37, 2, 5, 16)])
def test_triton_alignment_equals_the_torch_one(t, k, e, block_m):
    """The one-launch alignment (decode batches on CUDA) gives the torch ops' layout element for
    element: stable order within each expert, sentinel padding, each block's expert, E past the end."""
    pytest.importorskip("triton")
    from tokenmill.layers.moe.align import align_by_expert_torch
    from tokenmill.layers.moe.triton_align import align_by_expert_triton
    gen = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if t == 300:  # one expert takes most pairs: several blocks of one expert, experts left empty
        ids[:200, 0] = 7
    want, got = align_by_expert_torch(ids, e, block_m), align_by_expert_triton(ids, e, block_m)
    assert got.max_blocks == want.max_blocks
    assert torch.equal(got.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.block_expert, want.block_expert)


@pytest.mark.parametrize("dtype,t,align_impl", [(torch.float32, 9, "torch"), (torch.float16, 9, "torch"),
                                               (torch.float32, 1, "torch"), (torch.float32, 9, "triton")])
def test_fused_kernel_matches_the_loop(dtype, t, align_impl, monkeypatch):
    """(CUDA decode batches align with the Triton kernel: "triton" runs that pairing here.)"""
    pytest.importorskip("triton")
    from tokenmill.layers.moe import align
    from tokenmill.layers.moe.fused_moe import fused_experts
    monkeypatch.setattr(align, "IMPL", align_impl)
    from tokenmill.layers.moe.tile_configs import TileConfig
    x, w13, w2, weights, ids = _random_experts(t=t, dtype=dtype, k=3)
    config = TileConfig(block_m=16, block_n=16, block_k=16, down_block_n=32, down_block_k=16)
    ref = experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_experts(x, w13, w2, weights, ids, config)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_tile_table_picks_the_smallest_bucket_that_fits(tmp_path, monkeypatch):
    from tokenmill.layers.moe import tile_configs
    monkeypatch.setattr(tile_configs, "CONFIG_DIR", tmp_path)
    tile_configs._table.cache_clear()
    (tmp_path / tile_configs.config_file_name(4, 8, 16, "bfloat16")).write_text(
        '{"8": {"block_m": 16}, "64": {"block_m": 32}, "256": {"block_m": 64}}')
    try:
        assert [tile_configs.tile_config(4, 8, 16, t, "bfloat16", 2).block_m for t in (1, 8, 9, 300)] == [16, 16, 32, 64]
        assert tile_configs.tile_config(4, 8, 32, 1, "bfloat16", 2) == tile_configs.default_config(2, 4)
    finally:
        tile_configs._table.cache_clear()


def test_olmoe_qk_norm_fused_path_equals_the_torch_one(monkeypatch):
    """OLMoE's q/k norm at TP=1 takes the fused RMSNorm kernel on CUDA (here in the interpreter,
    `triton_ops.enabled` forced on): the torch ops' result, on a q slice of a fused qkv output."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from tokenmill.layers import triton_ops
    from tokenmill.model.olmoe import ShardedRMSNorm
    gen = torch.Generator().manual_seed(0)
    norm = ShardedRMSNorm(48, 48, 1e-5, SimpleNamespace(tp_size=1, all_reduce=lambda x: x))
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    qkv = torch.randn(5, 3 * 48, generator=gen)
    q = qkv[:, :48]  # rows 144 apart, as the q slice of the fused projection
    want = norm(q)
    monkeypatch.setattr(triton_ops, "enabled", lambda x: True)
    got = norm(q)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
