"""Fused Triton ops (RMSNorm + residual add, rotary, SiLU-and-mul) under Triton's CPU interpreter,
against the torch code paths they replace, on small shapes; bfloat16 is checked on the device
(scripts/fused_ops_check.py): the interpreter's bfloat16 is not IEEE on this CPU.

"Within one rounding": every element within one unit in the last place of the torch result, and
nearly all elements bit-identical, which only holds when the kernel rounds where torch does.
Tensors a kernel writes in place sit between NaN guard bands: a stray write shows as a changed
guard, a stray read as NaN.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import subprocess
import sys

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tests.helpers.paged_batch import PagedRunner  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model_dir  # noqa: E402
from tokenmill.config import RopeConfig  # noqa: E402
from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.activation import SiluAndMul  # noqa: E402
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend  # noqa: E402
from tokenmill.layers.norm import RMSNorm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from tokenmill.layers.triton_ops.rotary import rotate_  # noqa: E402
from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul  # noqa: E402
from tokenmill.model.arch import model_arch  # noqa: E402
from tokenmill.model.hf_config import load_hf_config  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402

DTYPES = [torch.float32, torch.float16]
MIN_EXACT = 0.97  # share of half-precision elements that must match the torch path bit for bit
GUARD = 4096  # elements of NaN before and after a guarded tensor


def assert_within_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6 * expected.abs().max().item())
        return
    magnitude = torch.maximum(actual.abs(), expected.abs())
    ulp = torch.nextafter(magnitude, torch.tensor(float("inf"), dtype=magnitude.dtype)) - magnitude
    diff = (actual.float() - expected.float()).abs()
    assert (diff <= ulp.float()).all(), f"max diff {diff.max().item():.3g} beyond one rounding"
    exact = (actual == expected).float().mean().item()
    assert exact >= MIN_EXACT, f"only {exact:.1%} of elements bit-identical to the torch path"


class Guarded:
    """A copy of `t` inside a larger buffer whose margins hold NaN."""

    def __init__(self, t: torch.Tensor) -> None:
        self.buffer = torch.full((GUARD + t.numel() + GUARD,), float("nan"), dtype=t.dtype)
        self.t = self.buffer[GUARD:GUARD + t.numel()].view(t.shape)
        self.t.copy_(t)

    def assert_intact(self) -> None:
        assert self.buffer[:GUARD].isnan().all() and self.buffer[-GUARD:].isnan().all(), "write out of bounds"


def make_norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 960, 64])  # SmolLM2's 576 and 960: not powers of two
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    norm = make_norm(hidden, dtype)
    x = Guarded(randn(7, hidden, dtype=dtype, scale=3.0)).t  # 7 rows: a partial tile of packed rows
    before = x.clone()
    assert_within_one_rounding(rms_norm(x, norm.weight, norm.eps), norm(x))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 960])
def test_fused_add_rms_norm_updates_residual_in_place(dtype: torch.dtype, hidden: int) -> None:
    norm = make_norm(hidden, dtype)
    guarded = Guarded(randn(5, hidden, dtype=dtype, seed=2, scale=4.0))
    x, residual = Guarded(randn(5, hidden, dtype=dtype, seed=1)).t, guarded.t
    x_before, residual_before = x.clone(), residual.clone()
    expected_out, expected_residual = norm.forward_with_residual(x, residual)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    guarded.assert_intact()
    assert new_residual is residual
    assert torch.equal(residual, expected_residual)  # the add rounds once, as torch's does
    assert not torch.equal(residual, residual_before) and torch.equal(x, x_before)
    assert_within_one_rounding(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads_of_a_strided_view(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: heads of q inside the fused qkv output, gaps between tokens."""
    tokens, heads, head_dim = 3, 4, 64
    qkv = randn(tokens, (heads + 4) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    norm = make_norm(head_dim, dtype, seed=4)
    before = qkv.clone()
    out = rms_norm(q, norm.weight, norm.eps)
    assert out.shape == q.shape and out.is_contiguous()
    assert_within_one_rounding(out, norm(q))
    assert torch.equal(qkv, before)


def test_rms_norm_no_rows() -> None:
    norm = make_norm(64, torch.float32)
    assert rms_norm(torch.empty(0, 64), norm.weight, norm.eps).shape == (0, 64)


# ---------------------------------------------------------------- rotary

def make_rope(head_dim: int, partial: float = 1.0, max_position: int = 512) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, RopeConfig(theta=10000.0, partial_rotary_factor=partial))


POSITIONS = torch.tensor([0, 300, 17, 511, 64, 5])  # unsorted, past the first blocks, up to the last row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (128, 1.0), (64, 0.5)])
def test_rotary_in_place_in_fused_qkv(dtype: torch.dtype, head_dim: int, partial: float) -> None:
    """q and k heads rotated where they sit in qkv (one view over both); v untouched."""
    num_heads, num_kv_heads = 4, 2
    rope = make_rope(head_dim, partial)
    tokens = len(POSITIONS)
    guarded = Guarded(randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=5))
    qkv = guarded.t
    qk_size = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :qk_size].view(tokens, num_heads + num_kv_heads, head_dim)
    cos, sin = rope.cos_sin(POSITIONS, dtype)
    expected = apply_rotary(qk, cos, sin)
    before = qkv.clone()
    rotate_(qk, None, POSITIONS, rope.cos_cache, rope.sin_cache, rope.rotary_dim)
    guarded.assert_intact()
    assert_within_one_rounding(qk, expected)
    assert torch.equal(qkv[:, qk_size:], before[:, qk_size:])  # v
    rotated = qkv[:, :qk_size].view(tokens, -1, head_dim)
    assert torch.equal(rotated[..., rope.rotary_dim:], before[:, :qk_size].view(tokens, -1, head_dim)[
        ..., rope.rotary_dim:])  # partial rotary: the tail passes untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_pair_of_separate_tensors(dtype: torch.dtype) -> None:
    """Qwen3's path: q and k normalized into their own tensors, then rotated in one launch."""
    head_dim = 64
    rope = make_rope(head_dim)
    guarded_q = Guarded(randn(len(POSITIONS), 3, head_dim, dtype=dtype, seed=6))  # 3 heads: a partial tile
    guarded_k = Guarded(randn(len(POSITIONS), 1, head_dim, dtype=dtype, seed=7))
    q, k = guarded_q.t, guarded_k.t
    cos, sin = rope.cos_sin(POSITIONS, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rotate_(q, k, POSITIONS, rope.cos_cache, rope.sin_cache, rope.rotary_dim)
    guarded_q.assert_intact()
    guarded_k.assert_intact()
    assert_within_one_rounding(q, expected_q)
    assert_within_one_rounding(k, expected_k)


def test_rotary_reads_only_its_tokens_positions() -> None:
    """Rows past q's tokens in `positions` (padding) change nothing; a longer q is refused."""
    rope = make_rope(64)
    q = randn(2, 2, 64, dtype=torch.float32, seed=8)
    expected = apply_rotary(q, *rope.cos_sin(POSITIONS[:2], torch.float32))
    rotate_(q, None, POSITIONS, rope.cos_cache, rope.sin_cache, rope.rotary_dim)
    assert_within_one_rounding(q, expected)
    with pytest.raises(ValueError, match="positions"):
        rotate_(randn(9, 2, 64, dtype=torch.float32), None, POSITIONS, rope.cos_cache, rope.sin_cache, 64)


# ---------------------------------------------------------------- SiLU-and-mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 1000, 64])  # 1000: a partial column block; 1536 = 1.5 blocks
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    x = Guarded(randn(3, 2 * d, dtype=dtype, seed=9, scale=4.0)).t  # a stray read brings in NaN
    before = x.clone()
    assert_within_one_rounding(silu_and_mul(x), SiluAndMul()(x))
    assert torch.equal(x, before)


# ---------------------------------------------------------------- grammar token masks

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [5000, 64])  # 5000: a partial last word and a partial token block
def test_token_bitmask_by_row(dtype: torch.dtype, vocab: int) -> None:
    """Each row masked by its own mask row (-1: untouched), against the torch reference; a row of
    a strided view (the greedy tail's static logits are whole tensors, eager ones may be views)."""
    from tokenmill.layers.sampling.token_bitmask import apply_bitmask_reference
    from tokenmill.layers.triton_ops.token_bitmask import apply_bitmask
    words = -(-vocab // 32)
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    which = torch.tensor([2, -1, 0, 1, -1, 0], dtype=torch.int32)
    wide = Guarded(randn(6, vocab + 8, dtype=dtype, seed=2))
    logits = wide.t[:, :vocab]
    want = logits.clone()
    apply_bitmask_reference(want, bits, which)
    apply_bitmask(logits, bits, which)
    assert torch.equal(logits, want)
    assert torch.isinf(logits[0]).any() and torch.isfinite(logits[1]).all()
    wide.assert_intact()
    assert not torch.isinf(wide.t[:, vocab:]).any()  # the columns past the view are not written


# ---------------------------------------------------------------- wiring

def test_enabled_only_for_cuda_tensors() -> None:
    assert not triton_ops.enabled(torch.zeros(1))
    assert not triton_ops.enabled(torch.zeros(1, device="meta"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_with_residual(dtype: torch.dtype) -> None:
    """Gemma's (1 + weight) norm, rounded once at the end, alone and taking the residual add."""
    from tokenmill.layers.norm import GemmaRMSNorm
    norm = GemmaRMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(96, generator=torch.Generator().manual_seed(5)))
    norm = norm.to(dtype)
    x, residual = randn(5, 96, dtype=dtype, seed=6), randn(5, 96, dtype=dtype, seed=7, scale=3.0)
    assert_within_one_rounding(rms_norm(x, norm.weight, norm.eps, gemma=True), norm(x))
    expected_out, expected_residual = norm.forward_with_residual(x, residual.clone())
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps, gemma=True)
    assert torch.equal(new_residual, expected_residual)
    assert_within_one_rounding(out, expected_out)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3"])
def test_model_with_fused_ops_matches_torch_path(arch: str, tmp_path, monkeypatch) -> None:
    """The whole model with every fused kernel on (forced onto the CPU under the interpreter):
    rotary by position, norms taking the residual adds, q/k norm over strided heads."""
    path = make_tiny_model_dir(arch, tmp_path)
    model = load_model(path, model_arch(load_hf_config(path)), "dummy", torch.float32, torch.device("cpu"),
                       TorchRefAttentionBackend, seed=0)
    with torch.no_grad():  # dummy norm weights are ones: make them count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    dims = model.dims

    def run() -> torch.Tensor:
        runner = PagedRunner(model, dims.num_layers, dims.num_kv_heads, dims.head_dim, num_seqs=2, max_len=40)
        prefill = runner.step([list(range(3, 23)), list(range(40, 45))], [20, 5])
        decode = runner.step([[7], [9]], [21, 6])
        return torch.cat([prefill, decode])

    expected = run()
    monkeypatch.setattr(triton_ops, "enabled", lambda x: True)
    torch.testing.assert_close(run(), expected, rtol=1e-5, atol=1e-5)


def test_import_without_triton() -> None:
    """CPU-only installs without triton import the layers and run them on the torch paths."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, tokenmill\n"
            "from tokenmill.layers import triton_ops\n"
            "from tokenmill.layers.norm import RMSNorm\n"
            "assert not triton_ops._usable()\n"
            "RMSNorm(8).forward_with_residual(torch.ones(2, 8), torch.ones(2, 8))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
