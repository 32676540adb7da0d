"""The L2 prefetch plan of the fp8 batch-1 chain (tokenmill/layers/quantization/fp8_prefetch.py): the
spec it reads, the chain's order (qkv, o, gate_up, down per layer, then the 8-bit head) and the links
it makes. The prefetch itself is CUDA-only inline assembly (`triton_ops.l2_prefetch`); on a GPU,
scripts/gpu_quant.py --parts b1profile checks the chain's outputs bit-identical with and without it."""

import pytest
import torch
from torch import nn

from tokenmill.layers.quantization import fp8_prefetch
from tokenmill.layers.quantization.fp8_prefetch import ALL, Plan


def test_plan_parses_names_sizes_and_mode_and_refuses_what_it_cannot_read():
    assert Plan.parse("off") is None and Plan.parse("0") is None
    plan = Plan.parse("o=all, gate_up=16,qkv=8,mode=3")
    assert plan.mode == 3 and dict(plan.mib) == {"o": ALL, "gate_up": 16, "qkv": 8}
    assert plan.bytes_for("o", 16 << 20) == 16 << 20
    assert plan.bytes_for("gate_up", 100 << 20) == 16 << 20
    assert plan.bytes_for("gate_up", 5000) == 4096  # rounded down to whole 4 KiB chunks
    assert plan.bytes_for("down", 1 << 30) == 0
    for bad in ("up=4", "o=lots", "mode=7"):
        with pytest.raises(ValueError, match="TOKENMILL_FP8_L2_PREFETCH"):
            Plan.parse(bad)


def _model(layers: int = 2) -> nn.Module:
    def block():
        b = nn.Module()
        b.self_attn, b.mlp = nn.Module(), nn.Module()
        b.self_attn.qkv_proj, b.self_attn.o_proj = nn.Linear(64, 96), nn.Linear(64, 64)  # 24 / 16 KiB
        b.mlp.gate_up_proj, b.mlp.down_proj = nn.Linear(64, 128), nn.Linear(64, 64)
        return b
    m = nn.Module()
    m.layers = nn.ModuleList(block() for _ in range(layers))
    m.logits_head = nn.Module()
    m.logits_head.head_8bit = type("Head", (), {"weight": torch.zeros(1024, 64, dtype=torch.int8)})()
    return m


def test_chain_order_and_links_follow_the_plan():
    m = _model()
    chain = fp8_prefetch._chain(m)
    assert [k for k, _, _ in chain] == ["qkv", "o", "gate_up", "down"] * 2 + ["head"]
    assert chain[1][1] is m.layers[0].self_attn.o_proj and chain[4][1] is m.layers[1].self_attn.qkv_proj
    plan = Plan((("o", ALL), ("qkv", 1), ("head", 1)), mode=1)
    links = fp8_prefetch.plan_links(chain, plan, lambda module, w: True)
    got = {id(mod): l for mod, l in links}
    # qkv -> all of o; down -> the next layer's qkv (and the last down -> the head), capped at their size
    assert got[id(m.layers[0].self_attn.qkv_proj)].weight is m.layers[0].self_attn.o_proj.weight
    assert got[id(m.layers[0].mlp.down_proj)].weight is m.layers[1].self_attn.qkv_proj.weight
    assert got[id(m.layers[1].mlp.down_proj)].weight is m.logits_head.head_8bit.weight
    assert got[id(m.layers[0].self_attn.qkv_proj)].nbytes == 16384  # all of o
    assert got[id(m.layers[0].mlp.down_proj)].nbytes == 24576  # qkv's 24 KiB, under its 1 MiB cap
    assert len(links) == 4  # 2 x (qkv -> o), 2 x (down -> next): the plan names no gate_up or down


def test_link_makes_none_on_cpu_and_a_one_row_call_only_gets_its_args():
    m = _model()
    assert fp8_prefetch.link(m, Plan((("o", ALL),))) == 0  # CPU weights, no streaming fp8 linears
    lin = m.layers[0].self_attn.qkv_proj
    lin.__dict__["l2_prefetch"] = fp8_prefetch.Link(torch.zeros(4096, dtype=torch.uint8), 4096, 1)
    assert fp8_prefetch.prefetch_args(lin, torch.zeros(1, 8))[1:] == (4096, 1)
    assert fp8_prefetch.prefetch_args(lin, torch.zeros(2, 8)) is None
