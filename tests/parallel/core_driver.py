"""An engine core in the test's process driving real pipeline-stage worker processes (the mp
executor), so a test can reach into the scheduler and step the loop by hand."""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.core.engine_core import EngineCore
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.executor.worker_group import WorkerGroup
from tokenmill.frontend.engine_config import resolve_engine_config
from tokenmill.protocol import EngineCoreRequest, FinishReason, pack_ids
from tokenmill.sampling_params import SamplingParams
from tokenmill.transport.channels import EngineAddresses


def engine_config(model: str, **kwargs) -> EngineConfig:
    kwargs.setdefault("dtype", "float32")
    return resolve_engine_config(EngineArgs(model=model, **kwargs))


@contextlib.contextmanager
def mp_engine_core(config: EngineConfig) -> Iterator[EngineCore]:
    run_dir = tempfile.mkdtemp(prefix="tokenmill-")
    workers = WorkerGroup(config, EngineAddresses(run_dir))
    core = None
    try:
        core = EngineCore(config, functools.partial(MultiprocExecutor, workers=workers))
        yield core
    finally:
        if core is not None:
            core.shutdown()
        else:
            workers.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)


def run_to_end(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
               after_step: Callable[[EngineCore, int], None] | None = None
               ) -> tuple[dict[int, list[int]], dict[int, FinishReason]]:
    """Add the prompts (handles 0..n-1), step until the core is idle; tokens and finish reasons by
    handle. `after_step(core, steps_so_far)` may abort requests, add more, look inside."""
    for handle, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(handle, pack_ids(prompt), params))
    tokens: dict[int, list[int]] = {h: [] for h in range(len(prompts))}
    finished: dict[int, FinishReason] = {}
    steps = 0
    while core.has_work():
        outputs = core.step()
        steps += 1
        for out in outputs.all_outputs():
            tokens[out.handle] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.handle] = out.finish_reason
        if after_step is not None:
            after_step(core, steps)
    return tokens, finished


def assert_nothing_left(core: EngineCore) -> None:
    """No request, block, sampled token or step left in the core, and (after one more step that
    tells the workers what finished) no request state in any worker."""
    scheduler = core.scheduler
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not scheduler.num_pending, scheduler.num_pending
    assert scheduler.in_flight_tokens == 0
    assert not scheduler.kv.blocks and not any(scheduler.kv.pool.ref_counts)
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_blocks
    while core.in_flight or scheduler.finished_to_send:  # deliver the last finished handles
        core.step()
    assert core.executor.held_requests() == [0] * core.config.parallel.world_size
