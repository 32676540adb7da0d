"""The Ray executor on a local two-node cluster (two raylets on this machine, one CPU each, so a
two-rank placement group must span both nodes): TP=2 through `LLM` (front-end, engine-core
process, Ray actors) and PP=2 through an engine core in this process, each equal to one process,
with ranks on both nodes and nothing left behind."""

from __future__ import annotations

import os

import pytest

from tests.helpers.invariance import greedy_params
from tests.helpers.requirements import require_module
from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_idle, assert_matches_one_process
from tests.parallel.core_driver import assert_nothing_left, engine_config, run_to_end
from tests.parallel.test_pp_lifecycle import GREEDY, _prompts
from tokenmill import LLM
from tokenmill.child_process import package_root
from tokenmill.core.engine_core import EngineCore

ray = require_module("ray")
_NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={**_NODE, "include_dashboard": False})
    cluster.add_node(**_NODE)
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address  # the engine-core process joins this cluster
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": package_root()}})
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield cluster
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        cluster.shutdown()


def _live_placement_nodes() -> set[str]:
    """The nodes of the one placement group alive now."""
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1, groups
    return set(groups[0]["bundles_to_node_id"].values())


def test_tp2_through_llm(two_node_cluster, family_dirs, one_process_reference) -> None:
    reference = one_process_reference("llama")
    with LLM(family_dirs["llama"], tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        assert len(_live_placement_nodes()) == 2, "both ranks landed on one node"
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, "ray tp=2")
        assert_idle(llm)


def test_pp2_in_process_core(two_node_cluster, tiny_model) -> None:
    from tokenmill.executor.ray_executor import RayExecutor
    reference_core = EngineCore(engine_config(tiny_model, kv_cache_memory_gb=0.01, max_num_batched_tokens=48,
                                              block_size=4))
    try:
        reference, _ = run_to_end(reference_core, _prompts(), GREEDY)
    finally:
        reference_core.shutdown()
    config = engine_config(tiny_model, pipeline_parallel_size=2, distributed_executor_backend="ray",
                           kv_cache_memory_gb=0.01, max_num_batched_tokens=48, block_size=4)
    core = EngineCore(config, RayExecutor)
    try:
        assert len({node for node, _ in core.executor.nodes}) == 2, "both stages landed on one node"
        tokens, _ = run_to_end(core, _prompts(), GREEDY)
        assert tokens == reference
        assert_nothing_left(core)
    finally:
        core.shutdown()


def test_constrained_requests_pp2_through_llm(two_node_cluster, tiny_model) -> None:
    """Structured outputs through Ray actors: each masked step is launched by `execute` and sampled
    by `finish`, which brings its masks; PP=2 with async scheduling gives one process's tokens."""
    from tests.parallel.test_structured_pp import PROMPTS as CONSTRAINED, REGEXES, params
    with LLM(tiny_model, single_process=True, async_scheduling=False, **ENGINE) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(CONSTRAINED, params(), use_tqdm=False)]
    with LLM(tiny_model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        outputs = llm.generate(CONSTRAINED, params(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert all(o.outputs[0].finish_reason == "stop" for o, regex in zip(outputs, REGEXES) if regex)
        assert_idle(llm)
