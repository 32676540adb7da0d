"""The greedy step-end kernel (`triton_ops.greedy_argmax`) under TRITON_INTERPRET=1 against torch:
the first column of each row's maximum (ties included, across passes and lanes), and the rows
holding NaN / +-inf flagged, as `~isfinite(sum)` flags them."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()


@pytest.mark.parametrize("vocab", [1, 100, 2048, 5000])
def test_greedy_argmax_matches_torch(vocab):
    from tokenmill.layers.triton_ops.greedy_argmax import greedy_argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    if vocab > 1:
        x[1, vocab // 3] = x[1, vocab - 1] = 9.0  # a tie: the first column wins
        x[2, :] = 0.5  # all equal: column 0
        x[3, vocab // 2] = float("nan")
        x[4, vocab - 1] = float("inf")
        x[5, 0] = float("-inf")
    ids, bad = greedy_argmax(x)
    assert ids.dtype == torch.int64 and bad.dtype == torch.bool
    assert torch.equal(bad, ~torch.isfinite(x.sum(-1)))
    assert torch.equal(ids[~bad], x.argmax(-1)[~bad])
    if vocab > 1:
        assert ids[1].item() == vocab // 3 and ids[2].item() == 0


def test_greedy_argmax_reads_strided_rows_and_refuses_columns():
    from tokenmill.layers.triton_ops.greedy_argmax import greedy_argmax

    base = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))
    base[0, 2700] = 50.0  # past the view's columns: never read
    view = base[:, :2500]  # rows 3000 apart
    ids, bad = greedy_argmax(view)
    assert torch.equal(ids, view.argmax(-1)) and not bad.any() and ids[0].item() != 2700
    with pytest.raises(ValueError, match="contiguous rows"):
        greedy_argmax(base.t())


def test_greedy_kernel_compiles_for_sm90():
    """A real compile (a process of its own: no interpreter) to sm_90 SASS with triton's bundled
    ptxas, no GPU needed: no spills."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import json, sys; sys.path.insert(0, 'scripts'); from sass_tools import compile_sm90, disassemble; "
            "from tokenmill.layers.triton_ops import greedy_argmax as ga; "
            "k = compile_sm90(ga._greedy_kernel, {'BLOCK': ga.BLOCK}, "
            "{'x_ptr': 'fp32', 'ids_ptr': 'i64', 'bad_ptr': 'i1'}, num_warps=16); print(json.dumps(disassemble(k)[0]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300, check=False)
    if proc.returncode and ("ptxas" in proc.stderr or "cuobjdump" in proc.stderr) and "No such file" in proc.stderr:
        pytest.skip("triton without its bundled CUDA tools")  # pragma: no cover
    assert proc.returncode == 0, proc.stderr[-2000:]
    figs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figs["stack"] == 0, figs


def test_selftest_passes_and_falls_back(monkeypatch, caplog):
    from tokenmill.layers.triton_ops import greedy_argmax as ga

    monkeypatch.setattr(ga, "_SELFTEST", {})
    assert ga.selftest(torch.device("cpu"))
    monkeypatch.setattr(ga, "_SELFTEST", {})
    monkeypatch.setattr(ga, "greedy_argmax", lambda x: (x.argmax(-1) * 0, ~torch.isfinite(x.sum(-1))))
    assert not ga.selftest(torch.device("cpu")) and "failed its self-test" in caplog.text
