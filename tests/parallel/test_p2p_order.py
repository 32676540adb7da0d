"""The order of the pipeline's point-to-point operations (`distributed/p2p_order.py`): the ranks'
sends and receives, over the activations' and the device tokens' communicators, keep one order
that matches, so that NCCL running two communicators' kernels one after the other cannot hang
(last session's device-token hang on two H200s)."""

from __future__ import annotations

import pytest

from tests.helpers.invariance import greedy_params
from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_matches_one_process
from tokenmill import LLM
from tokenmill.distributed import p2p_order
from tokenmill.distributed.p2p_order import find_cycle


def test_matching_orders_pass() -> None:
    first = [(1, "send", "act"), (1, "recv", "tokens"), (1, "send", "act"), (1, "recv", "tokens")]
    last = [(0, "recv", "act"), (0, "send", "tokens"), (0, "recv", "act"), (0, "send", "tokens")]
    assert find_cycle({0: first, 1: last}) is None


def test_crossed_orders_are_a_cycle() -> None:
    """e4c00ef's order: the first stage sent step j+1's activations before receiving step j's
    tokens, while the last stage sent those tokens before receiving the activations."""
    first = [(1, "send", "act"), (1, "send", "act"), (1, "recv", "tokens")]
    last = [(0, "recv", "act"), (0, "send", "tokens"), (0, "recv", "act")]
    assert (cycle := find_cycle({0: first, 1: last})) is not None and "cycle" in cycle


def test_unmatched_operation_is_named() -> None:
    message = find_cycle({0: [(1, "send", "act")], 1: []})
    assert message is not None and "matches" in message


@pytest.mark.parametrize("microbatches", [2, 3])
def test_device_tokens_keep_one_order(family_dirs, one_process_reference, microbatches, tmp_path,
                                      monkeypatch) -> None:
    """PP=2 with device tokens under gloo: every rank logs its operations; they must match in one
    order (and the tokens must still equal one process's)."""
    monkeypatch.setenv(p2p_order.ENV, str(tmp_path))
    reference = one_process_reference("llama")
    with LLM(family_dirs["llama"], pipeline_parallel_size=2, pp_device_tokens=True, pp_microbatches=microbatches,
             **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
    assert_matches_one_process(reference, outputs, f"llama pp=2 device tokens, {microbatches} micro-batches")
    logs = p2p_order.load(str(tmp_path))
    assert sorted(logs) == [0, 1]
    channels = {channel for ops in logs.values() for _, _, channel in ops}
    assert channels == {"act", "tokens"}, channels
    assert find_cycle(logs) is None, find_cycle(logs)
