"""The L2 prefetch plan of the fp8 batch-1 chain (tokenmill/layers/quantization/fp8_prefetch.py): the
spec it reads, the chain's order (qkv, o, gate_up, down per layer, then the 8-bit head) and the byte
ranges each linear is given. The prefetch itself is CUDA-only inline assembly (`triton_ops.l2_prefetch`);
on a GPU, scripts/gpu_quant.py --parts b1profile checks the chain's outputs bit-identical with and
without it."""

import pytest
import torch
from torch import nn

from tokenmill.layers.quantization import fp8_prefetch
from tokenmill.layers.quantization.fp8_prefetch import Plan

MIB = 1 << 20


def test_plan_parses_names_sizes_and_mode_and_refuses_what_it_cannot_read():
    assert Plan.parse("off") is None and Plan.parse("0") is None
    plan = Plan.parse("qkv=32, o=16,down=8,mode=3")
    assert plan.mode == 3 and plan.ahead("qkv") == 32 * MIB and plan.ahead("gate_up") == 0
    for bad in ("up=4", "o=all", "mode=7"):
        with pytest.raises(ValueError, match="TOKENMILL_FP8_L2_PREFETCH"):
            Plan.parse(bad)


def _model(layers: int = 2) -> nn.Module:
    def block():
        b = nn.Module()
        b.self_attn, b.mlp = nn.Module(), nn.Module()
        b.self_attn.qkv_proj, b.self_attn.o_proj = nn.Linear(8, 24), nn.Linear(8, 8)
        b.mlp.gate_up_proj, b.mlp.down_proj = nn.Linear(8, 32), nn.Linear(16, 8)
        return b
    m = nn.Module()
    m.layers = nn.ModuleList(block() for _ in range(layers))
    m.logits_head = nn.Module()
    m.logits_head.head_8bit = type("Head", (), {"weight": torch.zeros(40, 8, dtype=torch.int8)})()
    return m


def test_chain_runs_qkv_o_gate_up_down_per_layer_then_the_head():
    m = _model()
    chain = fp8_prefetch._chain(m)
    assert [k for k, _, _ in chain] == ["qkv", "o", "gate_up", "down"] * 2 + ["head"]
    assert chain[1][1] is m.layers[0].self_attn.o_proj and chain[4][1] is m.layers[1].self_attn.qkv_proj
    assert chain[-1][2] is m.logits_head.head_8bit.weight


def _llama8b_chain(layers: int = 2):
    """Llama-3.1-8B's fp8 weights (meta tensors): qkv 24, o 16, gate_up 112, down 56 MiB, int8 head."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    chain = [(kind, (i, kind), torch.empty(*shapes[kind], dtype=torch.float8_e4m3fn, device="meta"))
             for i in range(layers) for kind in shapes]
    return chain + [("head", "head", torch.empty(128256, 4096, dtype=torch.int8, device="meta"))]


def test_each_linear_prefetches_from_the_furthest_byte_asked_for_up_to_its_lookahead():
    chain = _llama8b_chain()
    got = {key: link for key, link in fp8_prefetch.plan_links(chain, Plan.parse("qkv=32,o=32,down=8"),
                                                              lambda key: True)}
    weight = {key: w for _, key, w in chain}
    name = {id(w): key for key, w in weight.items()}
    assert [(name[id(w)], lo // MIB, n // MIB) for w, lo, n in got[(0, "qkv")].ranges] \
        == [((0, "o"), 0, 16), ((0, "gate_up"), 0, 16)]  # all of o, then gate_up up to 32 MiB past qkv's end
    assert [(lo // MIB, n // MIB) for _, lo, n in got[(0, "o")].ranges] == [(16, 16)]  # gate_up [16, 32) MiB
    assert (0, "gate_up") not in got  # no lookahead asked of gate_up
    assert [(lo // MIB, n // MIB) for _, lo, n in got[(0, "down")].ranges] == [(0, 8)]  # the next layer's qkv
    assert got[(0, "down")].ranges[0][0] is weight[(1, "qkv")]
    assert got[(1, "down")].ranges[0][0] is weight["head"] and "head" not in got
    assert all(lo % 4096 == 0 and n % 4096 == 0 for link in got.values() for _, lo, n in link.ranges)


def test_no_plan_no_links_and_a_one_row_call_only_gets_its_args():
    m = _model()
    assert fp8_prefetch.plan_links(_llama8b_chain(), None, lambda key: True) == []
    assert fp8_prefetch.link(m, Plan.parse("qkv=16")) == 0  # CPU weights, no streaming fp8 linears
    lin = m.layers[0].self_attn.qkv_proj
    w = torch.zeros(8192, dtype=torch.uint8)
    lin.__dict__["l2_prefetch"] = fp8_prefetch.Link(((w, 4096, 4096),), 1)
    addr, n, addr2, n2, mode = fp8_prefetch.prefetch_args(lin, torch.zeros(1, 8))
    assert (addr - w.data_ptr(), n, addr2, n2, mode) == (4096, 4096, addr, 0, 1)
    assert fp8_prefetch.prefetch_args(lin, torch.zeros(2, 8)) is None
