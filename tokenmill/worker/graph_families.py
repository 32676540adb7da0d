"""The CUDA graph families of a model runner, captured once at start.

Decode graphs for every batch size (each family with its greedy step-end graph on the last
pipeline stage, and that graph's masked twin for structured outputs), a draft model's KV graphs, batch-1 prompt-chunk graphs, and with speculation the
verification graphs and the proposer's. The runner replays them (model_runner.py); this module
only builds them and sets them on the runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.greedy_tail import GreedyTail
from tokenmill.worker.mask_upload import StaticMasks
from tokenmill.worker.prompt_graphs import PromptGraphs

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

# Verification graphs are captured for batches up to this many rows (each holds logits for
# rows * (k + 1) positions); larger batches verify eagerly, and at saturation nothing drafts.
VERIFY_GRAPH_ROWS = 64


def capture_graph_families(runner: ModelRunner) -> None:
    """Decode graphs, and with speculation the verification graphs and the proposer's; each
    family with its greedy step-end graph (the last pipeline stage)."""
    max_seqs, max_len = runner.config.scheduler.max_num_seqs, runner.config.model.max_model_len
    mirror = None if runner.draft is None else runner.draft.mirror
    runner.graphs = DecodeGraphs(runner.model, runner.batch, runner.kv_caches, max_seqs, max_len,
                                 runner.block_size, runner.stage.layout, lora=runner.lora)
    runner.graphs.capture()
    if runner.draft is not None:  # replayed before the target's while the draft's KV is held
        runner.draft_graphs = DecodeGraphs(runner.draft.model, runner.batch, runner.draft.kv_caches, max_seqs,
                                           max_len, runner.block_size, kv_only=True)
        runner.draft_graphs.capture()
    histories = runner.speculator if runner.speculator is not None and runner.speculator.keeps_histories else None
    if runner.stage.is_last:
        runner.graph_tail = _tail(runner, runner.graphs, None)
        if histories is not None:
            runner.recording_tail = _tail(runner, runner.graphs, histories)
    if runner.stage.num_stages > 1:
        return
    runner.prompt_graphs = PromptGraphs(runner.model, runner.batch, runner.kv_caches, max_len, runner.block_size,
                                        runner.config.scheduler.max_num_batched_tokens, mirror=mirror,
                                        lora=runner.lora)
    runner.prompt_graphs.capture()
    if runner.speculator is None:
        return
    k = runner.speculator.k
    runner.verify_graphs = DecodeGraphs(runner.model, runner.batch, runner.kv_caches,
                                        min(max_seqs, VERIFY_GRAPH_ROWS), max_len, runner.block_size,
                                        runner.stage.layout, query_len=k + 1, drafts=runner.speculator.drafts,
                                        mirror=mirror, lora=runner.lora)
    runner.verify_graphs.capture()
    runner.verify_tail = _tail(runner, runner.verify_graphs, histories)
    if runner.draft is None:
        runner.speculator.capture(runner.verify_graphs.sizes, runner.verify_graphs.slots)
    else:
        runner.draft.capture_greedy(runner.verify_graphs.sizes, runner.verify_graphs.slots, *runner.draft_inputs())


def _tail(runner: ModelRunner, graphs: DecodeGraphs, histories) -> GreedyTail:
    """A family's greedy step-end graphs, captured, with their masked twin (`masked_twin`: grammar
    masks applied first, for structured outputs; its static mask block holds the largest size's
    logits rows)."""
    tail = GreedyTail(graphs, runner.batch, histories)
    tail.capture()
    words = -(-runner.config.model.arch.vocab_size // 32)
    masks = StaticMasks(max(graphs.sizes) * graphs.query_len, words, runner.device)
    tail.masked_twin = GreedyTail(graphs, runner.batch, histories, masks)
    tail.masked_twin.capture()
    return tail
