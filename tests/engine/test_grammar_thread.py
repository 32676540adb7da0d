"""The grammar work (advancing matchers, filling masks) runs on the grammar thread, off the engine
core's loop: with a slow mask fill the core's `update` spans stay short and the core waits for the
mask only where it must ship it (`mask_wait`), with the same tokens as the grammar work on the
loop (`structured_outputs_mask_thread=False`). And the engine-level check catches a mask made
before the tokens of the step before are fed (one token late)."""

from __future__ import annotations

import json
import re
import time

from tests.engine.conftest import tiny_llm
from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.core.grammar_job import GrammarJobRunner
from tokenmill.errors import RequestFailedError
from tokenmill.structured_output.backend import GrammarBackend

PROMPTS = ["abcabcabcabc", "xyz-xyz-xyz-x", "hello hello h", "q1q2q3q1q2q3"]
REGEXES = [r"[a-c]{12}", r"(xyz-|xy-){4}", r"[a-z ]{12}", r"(q[0-9]){6}"]
FILL_DELAY_S = 0.03


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r))
            for r in REGEXES]


def _spans(path, name: str) -> list[float]:
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e["dur"] / 1e6 for e in events if e.get("name") == name and "dur" in e]


def _run(model_dir, trace, thread: bool):
    llm = tiny_llm(model_dir, async_scheduling=True, trace_steps=str(trace), structured_outputs_mask_thread=thread)
    try:
        outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


def test_slow_masks_do_not_hold_the_core_loop(tiny_model_dir, tmp_path, monkeypatch) -> None:
    fill = GrammarBackend.fill_bitmask

    def slow_fill(self, matchers, out):
        time.sleep(FILL_DELAY_S)
        return fill(self, matchers, out)

    monkeypatch.setattr(GrammarBackend, "fill_bitmask", slow_fill)
    on_loop = _run(tiny_model_dir, tmp_path / "loop.json", thread=False)
    threaded = _run(tiny_model_dir, tmp_path / "thread.json", thread=True)
    for out, regex in zip(threaded, REGEXES):
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out
    assert [o.token_ids for o in threaded] == [o.token_ids for o in on_loop]
    # On the loop, the step's update makes the next mask (>= the fill's sleep); with the thread it
    # only hands the tokens over, and the core waits for the mask in `mask_wait` instead.
    loop_updates, thread_updates = _spans(tmp_path / "loop.json", "update"), _spans(tmp_path / "thread.json", "update")
    assert sum(u >= FILL_DELAY_S for u in loop_updates) >= 5, loop_updates
    assert max(thread_updates) < FILL_DELAY_S, thread_updates
    assert len(_spans(tmp_path / "thread.json", "mask_wait")) >= 5


def test_a_mask_filled_before_the_feed_breaks_outputs(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Planted defect: the job fills the mask first and feeds the step's tokens after (each mask
    one token late). The outputs then break their grammar: the check above would see it."""
    run = GrammarJobRunner.run

    def late(self, job):
        if job.mask_step is None or not job.feed:
            return run(self, job)
        feed, job.feed = job.feed, []
        result = run(self, job)
        job.feed, job.mask_step = feed, None
        fed = run(self, job)
        result.complete, result.broken = fed.complete, fed.broken
        return result

    monkeypatch.setattr(GrammarJobRunner, "run", late)
    try:
        outs = _run(tiny_model_dir, tmp_path / "late.json", thread=True)
    except RequestFailedError as exc:  # a sampled token the matcher refused: the request failed
        assert "grammar" in str(exc)
        return
    assert not all(re.fullmatch(r, o.text) and o.finish_reason == "stop" for r, o in zip(REGEXES, outs)), (
        "a one-token-late mask went unnoticed")
