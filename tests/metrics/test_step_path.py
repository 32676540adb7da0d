"""What each kernel adds to a step when kernels overlap (tokenmill/benchmarks/step_path.py), on a
made-up timeline of two layers with PDL-style overlap."""

import pytest

from tokenmill.benchmarks import step_path


def _step(t0: float) -> list[list]:
    """Marker at t0; per layer: a norm, then a GEMV that starts 2 us before the norm ends (PDL), then
    a second GEMV after a 1 us gap; after the layers a head GEMV (the GEMV's tail slot)."""
    ev, t = [], t0 + 1.0
    for _ in range(2):
        ev += [["_rms_norm_kernel", t, 4.0], ["_fp8_stream_kernel", t + 2.0, 10.0],
               ["_fp8_stream_kernel", t + 13.0, 5.0]]
        t += 18.0
    ev.append(["_fp8_stream_kernel", t, 20.0])
    return ev


def test_overlapping_kernels_are_charged_what_they_add_by_slot():
    marker = "spin_kernel"
    events = [[marker, t, 0.5] for t in (0.0, 100.0, 200.0)] + _step(0.0) + _step(100.0)
    a = step_path.attribute({"events": events, "marker": marker}, layers=2)
    rows = {r["kernel"]: r for r in a["kernels"]}
    assert a["steps"] == 2
    assert rows["_rms_norm_kernel[0]"]["adds_us"] == pytest.approx(2 * 4.0)
    assert rows["_rms_norm_kernel[0]"]["gap_before_us"] == pytest.approx(0.0)
    # the first GEMV of a layer runs 10 us, 2 of them under the norm
    assert rows["_fp8_stream_kernel[0]"]["dur_us"] == pytest.approx(20.0)
    assert rows["_fp8_stream_kernel[0]"]["adds_us"] == pytest.approx(2 * 8.0)
    assert rows["_fp8_stream_kernel[1]"]["gap_before_us"] == pytest.approx(2 * 1.0)
    assert rows["_fp8_stream_kernel[tail0]"]["adds_us"] == pytest.approx(20.0)
    assert a["busy_us"] == pytest.approx(2 * (4 + 8 + 5) + 20)
    assert a["gaps_us"] == pytest.approx(2 * 1.0)
    assert "adds us" in step_path.format_table(a)


def test_a_window_without_two_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        step_path.attribute({"events": [["spin_kernel", 0.0, 0.5], ["k", 1.0, 1.0]]}, layers=1)
