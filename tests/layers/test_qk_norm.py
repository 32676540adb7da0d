"""q/k norm + rotary from the float32 qkv projection, rounded once (`tokenmill.layers.qk_norm`), and
its Triton kernel (`triton_ops.qk_norm_rope`) under Triton's CPU interpreter, in float32 and fp16
(the interpreter's bfloat16 is not IEEE here; bf16 is checked on the device by scripts/gpu_bf16.py).

The torch reference is held to a float64 evaluation of the formula; the kernel to the reference;
and a bf16 Qwen3 attention layer to "one rounding of the exact result" for the q and k it hands
to attention (the old path, which rounded the projection, the norm and the rotary each, misses
that by several units in the last place).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tests.helpers.tiny_models import make_tiny_model_dir  # noqa: E402
from tokenmill.config import RopeConfig  # noqa: E402
from tokenmill.layers import qk_norm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402
from tokenmill.layers.triton_ops.qk_norm_rope import qk_norm_rope  # noqa: E402

POSITIONS = torch.tensor([0, 300, 17, 511, 64, 5])  # unsorted, up to the caches' last row
EPS = 1e-6


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_rope(head_dim: int, partial: float = 1.0) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0, partial_rotary_factor=partial))


def cos_sin(rope: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(0, rope.rotary_dim)
    return rope.cos_cache[positions][:, None, rows], rope.sin_cache[positions][:, None, rows]


def float64_formula(x: torch.Tensor, w: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """HF's q_norm then rotary, every step in float64 (nothing rounded)."""
    x, w = x.double(), w.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    cos, sin = (c.double() for c in cos_sin(rope, positions))
    r = rope.rotary_dim
    rotated = torch.cat([-y[..., r // 2:r], y[..., :r // 2]], dim=-1)
    return torch.cat([y[..., :r] * cos + rotated * sin, y[..., r:]], dim=-1)


def assert_one_rounding(actual: torch.Tensor, exact: torch.Tensor) -> None:
    """`exact` (float64) computed in float32 and rounded once to actual's dtype: every element within
    half a unit in the last place of it, plus float32 arithmetic's error (relative to the tensor's
    scale: rotary's differences cancel, so small elements carry the large ones' absolute error)."""
    nearest = exact.to(actual.dtype)
    magnitude = nearest.abs()
    ulp = (torch.nextafter(magnitude, torch.tensor(float("inf"), dtype=magnitude.dtype)) - magnitude).double()
    slack = 4e-7 * exact.abs().max().item()
    half_ulp = 0.0 if actual.dtype == torch.float32 else 0.5
    excess = (actual.double() - exact).abs() - half_ulp * ulp - slack
    worst = int(excess.argmax())
    assert excess.max().item() <= 0, (f"{actual.flatten()[worst].item()} vs exact {exact.flatten()[worst].item()}: "
                                      "more than one rounding off")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (32, 0.5)])
def test_reference_is_the_formula_rounded_once(out_dtype: torch.dtype, head_dim: int, partial: float) -> None:
    rope = make_rope(head_dim, partial)
    x = randn(len(POSITIONS), 3, head_dim, seed=1, scale=4.0)
    w = 1 + 0.5 * randn(head_dim, seed=2)
    cos, sin = cos_sin(rope, POSITIONS)
    out = qk_norm.norm_rope_reference(x, w, EPS, cos, sin, out_dtype)
    assert out.dtype == out_dtype
    assert_one_rounding(out, float64_formula(x, w, rope, POSITIONS))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,partial,num_heads,num_kv_heads", [(64, 1.0, 3, 1), (128, 1.0, 4, 2),
                                                                      (32, 0.5, 5, 5)])
def test_triton_kernel_matches_reference(out_dtype: torch.dtype, head_dim: int, partial: float,
                                         num_heads: int, num_kv_heads: int) -> None:
    """q and k read where they sit in a float32 qkv (strided views), written to new tensors."""
    rope = make_rope(head_dim, partial)
    tokens = len(POSITIONS)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, seed=3, scale=3.0)
    before = qkv.clone()
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    wq, wk = 1 + 0.5 * randn(head_dim, seed=4), 1 + 0.5 * randn(head_dim, seed=5)
    q_out, k_out = qk_norm_rope(q, k, wq, wk, EPS, 1e-5, POSITIONS, rope.cos_cache, rope.sin_cache,
                                rope.rotary_dim, out_dtype)
    assert torch.equal(qkv, before)  # the inputs are only read
    cos, sin = cos_sin(rope, POSITIONS)
    expected_q = qk_norm.norm_rope_reference(q, wq, EPS, cos, sin, out_dtype)
    expected_k = qk_norm.norm_rope_reference(k, wk, 1e-5, cos, sin, out_dtype)
    for actual, expected in ((q_out, expected_q), (k_out, expected_k)):
        assert actual.shape == expected.shape and actual.dtype == out_dtype and actual.is_contiguous()
        if out_dtype == torch.float32:
            torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
        else:  # the same float32 value rounded once: equal, or one unit apart where summation order tips it
            diff = (actual.float() - expected.float()).abs()
            ulp = (torch.nextafter(expected.abs(), torch.tensor(float("inf"), dtype=out_dtype)) - expected.abs()).float()
            assert (diff <= ulp).all()
            assert (actual == expected).float().mean().item() >= 0.97


def test_triton_kernel_refuses_bad_input() -> None:
    rope = make_rope(64)
    q = torch.zeros(2, 2, 64)
    with pytest.raises(ValueError, match="float32"):
        qk_norm_rope(q.half(), q, torch.ones(64), torch.ones(64), EPS, EPS, POSITIONS, rope.cos_cache,
                     rope.sin_cache, 64, torch.float16)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope(q, q, torch.ones(64), torch.ones(64), EPS, EPS, POSITIONS, rope.cos_cache, rope.sin_cache,
                     66, torch.float16)


def test_float32_models_keep_the_plain_path() -> None:
    from tokenmill.layers.linear import Linear
    layer = Linear(64, 96, bias=False)
    assert qk_norm.qkv_float32(layer, torch.zeros(3, 64)) is None


def test_bf16_qwen3_attention_rounds_q_and_k_once(tmp_path, monkeypatch) -> None:
    """A bf16 Qwen3 layer's q and k, as they enter attention, are the exact norm + rotary of the
    exact projection (bf16 weights and input, float64 arithmetic), rounded once (the CPU path,
    off by default there, turned on: the same code the CUDA path runs, but for the GEMM)."""
    monkeypatch.setattr(qk_norm, "ON_CPU", True)
    from tokenmill.benchmarks import bf16_deviation as bd
    from tokenmill.model.llama import LlamaAttention
    path = make_tiny_model_dir("qwen3", tmp_path, seed=3, initializer_range=0.1)
    model = bd.load_tokenmill(path, torch.bfloat16)
    attn = next(m for m in model.modules() if isinstance(m, LlamaAttention))
    seen = {}
    with torch.inference_mode():
        probe = qk_norm.qkv_float32(attn.qkv_proj, torch.zeros(2, model.dims.hidden_size, dtype=torch.bfloat16))
    if probe is None:
        pytest.skip("no float32 epilogue for bf16 linears on this CPU")
    attn.register_forward_pre_hook(lambda mod, args: seen.__setitem__("hidden", args[0]))
    original = attn.attn.forward

    def capture(q, k, v, *args, **kwargs):
        seen["q"], seen["k"] = q.clone(), k.clone()
        return original(q, k, v, *args, **kwargs)

    attn.attn.forward = capture
    ids = list(range(5, 25))
    bd.tokenmill_logits(model, ids, "prefill")
    qkv = seen["hidden"].double() @ attn.qkv_proj.weight.double().T
    t, d = qkv.shape[0], attn.head_dim
    positions = torch.arange(t)
    rope = model.model.rotary_emb
    q = qkv[:, :attn.q_size].view(t, -1, d)
    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(t, -1, d)

    def exact(x, norm):
        global EPS
        saved, EPS = EPS, norm.eps
        try:
            return float64_formula(x, norm.weight.double(), rope, positions)
        finally:
            EPS = saved

    assert_one_rounding(seen["q"], exact(q, attn.q_norm))
    assert_one_rounding(seen["k"], exact(k, attn.k_norm))
