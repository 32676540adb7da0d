"""bf16 precision rules of the shared layers (HF's roundings or fewer), the bf16 -> float32 LM head
kernel on every CPU path, the CPU path choice, and the packed oneDNN bf16 linear (the AMX path)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers import cpu_isa, cpu_logits
from tokenmill.layers.norm import RMSNorm, residual_stream, rms_norm_reference


def _within_one_bf16_rounding(actual: torch.Tensor, expected: torch.Tensor, min_exact: float = 0.99) -> None:
    assert actual.dtype == expected.dtype == torch.bfloat16
    magnitude = torch.maximum(actual.abs(), expected.abs())
    ulp = torch.nextafter(magnitude, torch.tensor(float("inf"), dtype=magnitude.dtype)) - magnitude
    diff = (actual.float() - expected.float()).abs()
    assert (diff <= ulp.float()).all(), f"max diff {diff.max().item():.3g} beyond one rounding"
    assert (actual == expected).float().mean().item() >= min_exact


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm.to(dtype)


@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_rounds_where_hf_does(hidden: int) -> None:
    torch.manual_seed(0)
    norm = _norm(hidden, torch.bfloat16)
    x = (torch.randn(33, hidden) * 4).bfloat16()
    x[0, 3] = 3000.0  # a massive activation, as real models have on their first token
    _within_one_bf16_rounding(norm(x), rms_norm_reference(x, norm.weight, norm.eps))


def test_rms_norm_with_float32_residual_adds_without_rounding() -> None:
    torch.manual_seed(1)
    norm = _norm(128, torch.bfloat16)
    stream = residual_stream((torch.randn(9, 128) * 50).bfloat16())
    assert stream.dtype == torch.float32
    x = torch.randn(9, 128).bfloat16()
    normed, new_stream = norm.forward_with_residual(x, stream)
    assert new_stream.dtype == torch.float32 and normed.dtype == torch.bfloat16
    assert torch.equal(new_stream, stream + x.float())  # exact: no rounding to bf16
    _within_one_bf16_rounding(normed, rms_norm_reference(new_stream, norm.weight, norm.eps, torch.bfloat16))


def test_float32_norm_is_unchanged() -> None:
    torch.manual_seed(2)
    norm = _norm(64, torch.float32)
    x = torch.randn(5, 64)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, norm.eps), rtol=2e-6, atol=1e-6)


# ---------------------------------------------------------------- the LM head kernel, every path

def _bf16_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What every path computes: exact products of bf16 values summed in (at least) float32."""
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("path", cpu_isa.PATHS, ids=lambda p: p.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("k", [64, 72])
def test_lm_head_kernel_on_every_path(path: cpu_isa.KernelPath, rows: int, k: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, k).bfloat16()  # K = 64: whole 32-wide steps; 72: and a tail of 8
    w = (torch.randn(70, k) * 0.1).bfloat16()  # N = 70: 4-row blocks and a remainder
    expected = _bf16_logits_reference(x, w)
    lib = cpu_logits.library(path)
    if lib is None:
        pytest.fail(f"the {path.name} kernel did not build")
    if not cpu_isa.can_run(path):
        # Built (compile-checked) but not runnable here: its arithmetic is the reference's.
        torch.testing.assert_close(expected, x.float() @ w.float().T, rtol=1e-5, atol=1e-5)
        return
    got = cpu_logits.linear_f32(x, w, lib)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Finer than bf16 output: a bf16-rounded result would differ by up to half a bf16 step.
    assert not torch.equal(got, expected.bfloat16().float()) or rows == 0


def test_lm_head_kernel_strided_input_and_no_rows() -> None:
    x = torch.randn(4, 128).bfloat16()[:, :64]
    w = torch.randn(20, 64).bfloat16()
    torch.testing.assert_close(cpu_logits.linear_f32(x, w), _bf16_logits_reference(x, w), rtol=1e-5, atol=1e-5)
    assert cpu_logits.linear_f32(torch.empty(0, 64).bfloat16(), w).shape == (0, 20)


# ---------------------------------------------------------------- path choice

@pytest.mark.parametrize("flags, expected", [
    ({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma"}, "amx"),
    ({"avx512_bf16", "avx512f", "avx2", "fma"}, "avx512_bf16"),
    ({"avx512f", "avx2", "fma"}, "avx512"),
    ({"avx2", "fma"}, "avx2"),
    ({"sse4_2"}, "generic"),
])
def test_best_path_from_flags(flags: set[str], expected: str) -> None:
    path = cpu_isa.best_path(frozenset(flags))
    assert path.name == expected
    assert path.native_bf16 == (expected in ("amx", "avx512_bf16"))


def test_forced_path_must_be_runnable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV_VAR, "generic")
    cpu_isa.kernel_path.cache_clear()
    try:
        assert cpu_isa.kernel_path().name == "generic"
        assert "forced" in cpu_isa.describe()
        monkeypatch.setenv(cpu_isa.ENV_VAR, "no-such-path")
        cpu_isa.kernel_path.cache_clear()
        with pytest.raises(ValueError, match="TOKENMILL_CPU_PATH"):
            cpu_isa.kernel_path()
        missing = next((p for p in cpu_isa.PATHS if not cpu_isa.can_run(p)), None)
        if missing is not None:
            monkeypatch.setenv(cpu_isa.ENV_VAR, missing.name)
            cpu_isa.kernel_path.cache_clear()
            with pytest.raises(ValueError, match="lacks"):
                cpu_isa.kernel_path()
    finally:
        monkeypatch.delenv(cpu_isa.ENV_VAR)
        cpu_isa.kernel_path.cache_clear()


# ---------------------------------------------------------------- the packed oneDNN bf16 linear

_PACKED_CHECK = r"""
import torch, torch.nn.functional as F
from tokenmill.layers.linear import PackedWeight, linear
torch.manual_seed(0)
for rows in (1, 7, 64):
    x = torch.randn(rows, 96).bfloat16(); w = (torch.randn(80, 96) * 0.1).bfloat16()
    got = linear(x, w, None, PackedWeight()).float()
    ref = x.float() @ w.float().T
    err = ((got - ref).abs() / (ref.abs() + 1e-2)).max().item()
    assert err < 2 ** -7, (rows, err)
print("ok")
"""


@pytest.mark.parametrize("isa", ["AVX2", "DEFAULT"])
def test_packed_bf16_linear_under_onednn_isa(isa: str) -> None:
    """The AMX / AVX512-BF16 path's bf16 linear (oneDNN, weights packed once) against the plain
    float32 matmul of the same bf16 values. oneDNN runs the best ISA it may (AMX on AMX machines);
    capped at AVX2 it emulates bf16: both must agree with the reference to bf16 precision."""
    env = dict(os.environ)
    if isa != "DEFAULT":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", _PACKED_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
