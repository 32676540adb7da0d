"""The null runner's mirror (token counts in batch-row arrays, block tables in its states) must
match the scheduler's view at every step: the debug digest is checked on every step of random
workloads with chunked prefills, preemptions, aborts and async scheduling."""

from __future__ import annotations

import random
import types

import msgspec
import pytest

from tests.core.workloads import mixed_workload
from tests.core.test_scheduler import MAX_LEN
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import SchedulerOutput
from tokenmill.protocol.digest import check_worker_view
from tokenmill.worker.null_runner import NullRunner


def null_runner() -> NullRunner:
    config = types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=40, seed=0),
                                   cache=types.SimpleNamespace(num_blocks_override=0))
    return NullRunner(config)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(40))
def test_null_runner_mirrors_the_scheduler(seed):
    config, requests = mixed_workload(seed)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=config["max_seqs"], max_num_batched_tokens=config["budget"],
                        async_scheduling=config["async_scheduling"], debug_check_every=1),
        CacheConfig(block_size=config["block_size"], enable_prefix_caching=config["caching"]), config["num_blocks"])
    runner = null_runner()
    for handle, (prompt, params, eos) in enumerate(requests):
        scheduler.add_request(Request(handle, prompt, params, eos, MAX_LEN))
    rng, queue, in_flight = random.Random(seed), [], 2 if config["async_scheduling"] else 1
    for _ in range(20000):
        while len(queue) < in_flight and (so := scheduler.schedule()) is not None:
            wire = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)
            out = runner.launch(wire).output()
            check_worker_view(wire, runner.mirror_view)  # raises on any difference
            queue.append((so, out))
        if not queue:
            break
        scheduler.update(*queue.pop(0))
        if scheduler.requests and rng.random() < 0.05:
            scheduler.abort([rng.choice(sorted(scheduler.requests))])
    assert not scheduler.requests
