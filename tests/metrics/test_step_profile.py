"""The decode-step profile's analysis (tokenmill/benchmarks/step_profile.py) on a made-up timeline."""

import pytest

from tokenmill.benchmarks import step_profile


def _step(t0: float) -> list[list]:
    """One step after the marker at t0: a GEMM, a norm 1 us later, an all-reduce after a 20 us host
    gap, its last work ending 14 us before the next marker (at t0 + 100)."""
    return [["nvjet_sm90_tst_64x8", t0 + 5, 20.0], ["_rms_norm_kernel", t0 + 26, 10.0],
            ["one_shot_all_reduce_kernel", t0 + 56, 30.0]]


def test_steps_are_cut_at_markers_and_gaps_split_by_length():
    marker = "at::cuda::(anonymous namespace)::spin_kernel(long)"  # the name the trace gives torch.cuda._sleep's
    events = [[marker, t, 0.5] for t in (0.0, 100.0, 200.0)] + _step(0.0) + _step(100.0)
    a = step_profile.analyze({"rank": 0, "events": events, "marker": "spin_kernel"}, host_gap_us=8.0)
    assert a["steps"] == 2
    assert a["period_us"] == pytest.approx(100.0)
    assert a["kernel_us"] == pytest.approx(60.0) and a["busy_us"] == pytest.approx(60.0)
    assert a["groups_us"] == pytest.approx({"all_reduce": 30.0, "gemm": 20.0, "norm": 10.0})
    assert a["kernels_per_step"] == pytest.approx(3.0)
    assert a["launch_gaps_us"] == pytest.approx(1.0) and a["launch_gaps_per_step"] == pytest.approx(1.0)
    assert a["host_gaps_us"] == pytest.approx(20.0) and a["host_gaps_per_step"] == pytest.approx(1.0)
    assert a["between_steps_us"] == pytest.approx(5.0 + 14.0)
    assert a["idle_us"] == pytest.approx(a["launch_gaps_us"] + a["host_gaps_us"] + a["between_steps_us"])
    assert a["largest_host_gaps"][0]["after"] == "_rms_norm_kernel"
    assert a["largest_host_gaps"][0]["before"] == "one_shot_all_reduce_kernel"


def test_the_first_steps_of_a_long_window_are_left_out():
    """A peer's profiler start stalls the first all-reduce of the window: those steps do not count."""
    events = [["spin_kernel", 100.0 * i, 0.5] for i in range(13)] + [e for i in range(12) for e in _step(100.0 * i)]
    events[13 + 2][2] = 5000.0  # step 0's all-reduce waited 5 ms
    a = step_profile.analyze({"events": events}, settle=4)
    assert a["steps"] == 8 and a["groups_us"]["all_reduce"] == pytest.approx(30.0)


def test_overlapping_events_count_once_as_busy():
    events = [["spin_kernel", 0.0, 0.5], ["nvjet_a", 2.0, 10.0], ["Memcpy DtoH", 5.0, 10.0], ["spin_kernel", 20.0, 0.5]]
    a = step_profile.analyze({"events": events})
    assert a["busy_us"] == pytest.approx(13.0) and a["kernel_us"] == pytest.approx(20.0)
    assert a["groups_us"] == pytest.approx({"gemm": 10.0, "copies": 10.0})


@pytest.mark.parametrize("name, group", [
    ("_all_reduce_add_rms_norm_kernel", "all_reduce"), ("ncclDevKernel_AllReduce_Sum_bf16", "all_reduce"),
    ("_paged_attention_kernel", "attention"), ("_reduce_splits_kernel", "attention"),
    ("_write_kv_kernel", "kv_write"), ("_rotary_kernel", "rope"), ("_silu_and_mul_kernel", "activation"),
    ("void cublasLt::splitKreduce_kernel<32, 16>", "gemm"), ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("_quantize_rows_kernel", "act_quant"), ("_rms_norm_quant_kernel", "act_quant"), ("_fp8_stream_kernel", "gemm"),
    ("_fp8_gemm_kernel", "gemm"),
])
def test_kernel_groups(name, group):
    assert step_profile.group_of(name) == group


def test_worker_window_counts_only_full_batch_decode_steps(tmp_path):
    """The window opens after `skip` steps of `batch` rows of one token each (others do not count)
    and writes the rank's file after `steps` more."""
    import json

    import numpy as np
    import torch

    from tokenmill.worker.device_profile import ENV_VAR, DeviceProfile

    env = {ENV_VAR: json.dumps({"out_dir": str(tmp_path), "batch": 2, "skip": 2, "steps": 3})}
    prof = DeviceProfile.from_env(env, 1, torch.device("cpu"))
    assert DeviceProfile.from_env({}, 0, torch.device("cpu")) is None
    decode, prefill, other = np.array([1, 1]), np.array([1, 7]), np.array([1, 1, 1])
    for counts in (prefill, decode, other, decode):  # two counted: the window opens
        prof.after_launch(counts)
    for _ in range(2):
        torch.ones(8).add_(1)
        prof.after_launch(decode)
        prof.after_launch(prefill)
    assert not (tmp_path / "rank1.json").exists()
    prof.after_launch(decode)
    record = json.loads((tmp_path / "rank1.json").read_text())
    assert record["rank"] == 1 and record["steps"] == 3 and record["events"]
    prof.after_launch(decode)  # closed for good
    assert step_profile.analyze(record)["steps"] == 3


def test_a_prefill_window_then_a_decode_window_in_one_run(tmp_path):
    """A list of windows: the first holds steps of at least `min_tokens` tokens (prefill chunks,
    whatever their rows), the second full-batch decode steps; each writes its own folder, and the
    decode window does not open while the prefill one is."""
    import json

    import numpy as np
    import torch

    from tokenmill.worker.device_profile import ENV_VAR, DeviceProfile, DeviceProfiles

    windows = [{"out_dir": str(tmp_path / "prefill"), "min_tokens": 8, "skip": 1, "steps": 2},
               {"out_dir": str(tmp_path / "decode"), "batch": 2, "skip": 1, "steps": 2}]
    prof = DeviceProfile.from_env({ENV_VAR: json.dumps(windows)}, 0, torch.device("cpu"))
    assert isinstance(prof, DeviceProfiles)
    chunk, decode = np.array([1, 9]), np.array([1, 1])
    prof.after_launch(chunk)  # the prefill window opens
    prof.after_launch(decode)  # held by nobody: the open window is the prefill one
    assert not prof.profiles[1].open and prof.profiles[1]._seen == 0
    for _ in range(2):
        torch.ones(8).add_(1)
        prof.after_launch(chunk)
    record = json.loads((tmp_path / "prefill" / "rank0.json").read_text())
    assert record["min_tokens"] == 8 and record["steps"] == 2
    for _ in range(3):
        torch.ones(8).add_(1)
        prof.after_launch(decode)
    assert json.loads((tmp_path / "decode" / "rank0.json").read_text())["batch"] == 2
