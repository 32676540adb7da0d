"""Programmatic dependent launch switches (tokenmill/layers/triton_ops/pdl.py): never on a CPU
tensor (the interpreter has no grid dependency control), TOKENMILL_PDL=0 and `FORCE` decide on
CUDA, and the kernels' wait / launch_dependents helpers compile away without PDL. The ordering
itself needs a GPU: `scripts/gpu_quant.py --parts pdl,pdlplant` (bitwise replays, planted race)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module

require_module("triton")  # skipped on a machine without it; in CI, missing fails

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tokenmill.layers.triton_ops import pdl  # noqa: E402


def test_cpu_tensors_never_launch_with_pdl(monkeypatch):
    monkeypatch.setattr(pdl, "FORCE", True)
    assert pdl.launch_kwargs(torch.device("cpu")) == {"USE_PDL": False}
    assert not pdl.enabled(torch.device("cpu"))


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("1", True), ("", True)])
def test_environment_and_force_decide_on_cuda(monkeypatch, value, on):
    monkeypatch.setenv(pdl.ENV_VAR, value) if value else monkeypatch.delenv(pdl.ENV_VAR, raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)  # as on an H100 / H200
    pdl._env_on.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert pdl.enabled(cuda) is on
        assert pdl.launch_kwargs(cuda) == ({"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False})
        monkeypatch.setattr(pdl, "FORCE", not on)  # a benchmark's override wins
        assert pdl.enabled(cuda) is (not on)
        monkeypatch.setattr(pdl, "_capable", lambda index: False)  # before Hopper: never
        assert not pdl.enabled(cuda)
    finally:
        pdl._env_on.cache_clear()


@triton.jit
def _copy_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs))


def test_kernels_with_the_helpers_run_without_pdl():
    out = torch.zeros(8)
    _copy_kernel[(1,)](torch.arange(8.0), out, BLOCK=8, **pdl.launch_kwargs(out.device))
    torch.testing.assert_close(out, torch.arange(8.0))
