"""Shared pieces of the end-to-end engine tests: a tiny model directory, tiny engines, and the
after-every-test check that each engine a test used is idle, with its whole KV pool free."""

from __future__ import annotations

import pytest

from tests.helpers.engine import worker_runner
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM


def assert_engine_idle(llm: LLM) -> None:
    """No request left anywhere (front-end, scheduler, in flight) and every KV block free."""
    stats = llm.kv_cache_stats()
    assert stats["num_requests"] == 0, f"{stats['num_requests']} requests left in the engine"
    assert stats["num_free_blocks"] == stats["num_blocks"], f"KV blocks leaked: {stats}"
    scheduler = llm.engine.scheduler
    assert not scheduler.waiting and not scheduler.running, "scheduler queues are not empty"
    assert not scheduler.num_pending, f"sampled tokens still pending: {scheduler.num_pending}"
    assert not scheduler.kv.blocks, f"block tables left behind: {list(scheduler.kv.blocks)}"
    assert not any(scheduler.kv.pool.ref_counts), "a block still holds a reference"
    # With async scheduling a last step may still be queued, but it may only carry finished handles.
    assert all(not batch.scheduled_handles for batch, *_ in llm.engine.in_flight), "a step is still in flight"
    assert not llm.output_processor.has_unfinished(), "the front-end still tracks a request"
    # The worker may still hold the requests whose end it has not been told yet, and no others.
    worker_states = set(worker_runner(llm).states)
    assert worker_states <= set(scheduler.finished_to_send), (
        f"worker keeps state for requests the scheduler forgot: {worker_states - set(scheduler.finished_to_send)}")


@pytest.fixture(autouse=True)
def _engines_idle_after_each_test(request):
    yield
    for name in request.fixturenames:
        if name.endswith("llm"):
            value = request.getfixturevalue(name)
            if isinstance(value, LLM):
                assert_engine_idle(value)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny"))


def tiny_llm(path: str, **kwargs) -> LLM:
    """A single-process float32 engine with a small KV pool. Scheduling is the engine's default
    (async on) unless `async_scheduling` is given: tests that compare modes must pass it."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_memory_gb", 0.01)
    kwargs.setdefault("single_process", True)  # the tests inspect the scheduler and the worker
    return LLM(path, **kwargs)
