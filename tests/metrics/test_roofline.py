"""The decode roofline of `bench throughput`: what one GPU must read per step, with and without
model parallelism (the Llama-3.1-8B shape; figures checked by hand)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.benchmarks import roofline, throughput
from tokenmill.config import ModelArch

LLAMA_8B = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     rms_norm_eps=1e-5, max_position=131072)
BANDWIDTH = 4.0e12


def figures(tp: int, pp: int, max_num_seqs: int = 256, monkeypatch=None) -> dict:
    monkeypatch.setattr(roofline, "measure_copy_bandwidth", lambda *a, **k: BANDWIDTH)
    config = SimpleNamespace(model=SimpleNamespace(arch=LLAMA_8B, dtype="bfloat16"),
                             parallel=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                             scheduler=SimpleNamespace(max_num_seqs=max_num_seqs, pp_microbatches=0))
    ns = SimpleNamespace(num_prompts=1000, input_len=512, output_len=256)
    return throughput.roofline_figures(config, ns, {"device_step_ms_p50": 10.0})


def test_one_gpu_reads_every_weight_and_every_rows_kv(monkeypatch):
    r = figures(1, 1, monkeypatch=monkeypatch)
    # 8.03e9 parameters in bf16, less the input embedding (a step reads B of its 128256 rows)
    assert r["weight_GB"] == pytest.approx((8.03e9 - 128256 * 4096) * 2 / 1e9, abs=0.01)
    assert r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    kv = 256 * 640 * 131072
    assert r["floor_step_ms"] == pytest.approx((r["weight_GB"] * 1e9 + kv) / BANDWIDTH * 1e3)
    assert r["roofline_output_tokens_per_s"] == pytest.approx(256 / (r["floor_step_ms"] / 1e3))
    assert r["fraction_of_roofline_step_p50"] == pytest.approx(r["floor_step_ms"] / 10.0)


def test_tensor_parallel_ranks_read_a_share_each(monkeypatch):
    one, tp2 = figures(1, 1, monkeypatch=monkeypatch), figures(2, 1, monkeypatch=monkeypatch)
    assert tp2["floor_step_ms"] == pytest.approx(one["floor_step_ms"] / 2)
    assert tp2["roofline_output_tokens_per_s"] == pytest.approx(2 * one["roofline_output_tokens_per_s"])


def test_a_pipeline_stage_step_runs_one_micro_batch_through_its_layers(monkeypatch):
    pp2 = figures(1, 2, monkeypatch=monkeypatch)
    kv_half = 128 * 640 * 131072
    assert pp2["rows_per_micro_batch"] == 128
    assert pp2["floor_step_ms"] == pytest.approx((pp2["weight_GB"] * 1e9 + kv_half) / 2 / BANDWIDTH * 1e3)
    assert pp2["roofline_output_tokens_per_s"] == pytest.approx(128 / (pp2["floor_step_ms"] / 1e3))
