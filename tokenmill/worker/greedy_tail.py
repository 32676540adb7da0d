"""The end of an all-greedy decode step as a CUDA graph of its own, replayed right after the
forward graph (`DecodeGraphs`): argmax, draft verification, and every device state update the
step makes, in one launch instead of some sixty small ones.

It reads the forward graph's static logits and row lists, and writes one packed int64 result
that the caller clones for the read-back:
- query_len 1 (plain decode): [size] sampled ids, -NON_FINITE_LOGITS on rows whose logits are
  not finite;
- query_len k + 1 (verification): [size, k + 2], each row's emitted tokens (-1 past the last)
  then its emitted count (or the sentinel).
and sets each real row's next input, its computed-token count (the forward graph counted every
draft; rejected ones are taken back) and, with speculation on, appends the emitted tokens to
the speculator's history. Padded rows (the scratch slot) change nothing that is read: their
count and history length stay as they were.

Valid only while the sampling plan is plain greedy with no logprobs (the caller checks): the
argmax of the raw logits is then exactly what `Sampler.sample` returns and `Sampler.advance`
has nothing to record. On CPU a "replay" runs the body eagerly (tests).

A masked tail (structured outputs) also applies the step's grammar masks between the non-finite
screen and the argmax: it reads them from a `StaticMasks` block (each logits row's mask index, -1
for an unconstrained row, then the distinct masks) that `run_masked` fills just before the replay,
so a constrained greedy step costs one small copy and one replay once its masks arrive, as an
unconstrained one does.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from tokenmill.layers import triton_ops
from tokenmill.layers.sampling.spec_verify import verify_drafts
from tokenmill.layers.sampling.token_bitmask import apply_bitmask_by_row
from tokenmill.protocol import RowFailure
from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.graph_capture import capture_per_size
from tokenmill.worker.mask_upload import MaskUpload, StaticMasks
from tokenmill.worker.persistent_batch import PersistentBatch
from tokenmill.worker.speculator import Speculator

logger = logging.getLogger(__name__)


def _triton_greedy(logits: torch.Tensor) -> bool:
    """Whether the unmasked argmax and non-finite screen run as one Triton kernel
    (`triton_ops.greedy_argmax`, after its device self-test; TOKENMILL_TRITON_GREEDY=0: torch's two
    reductions, A/B runs)."""
    if not (triton_ops.enabled(logits) and logits.dim() == 2 and logits.stride(-1) == 1
            and os.environ.get("TOKENMILL_TRITON_GREEDY", "1") != "0"):
        return False
    from tokenmill.layers.triton_ops.greedy_argmax import selftest
    return selftest(logits.device)


class GreedyTail:
    def __init__(self, graphs: DecodeGraphs, batch: PersistentBatch, speculator: Speculator | None,
                 masks: StaticMasks | None = None) -> None:
        """`masks`: a masked tail's block, rows for the largest size's logits rows."""
        assert graphs.last_stage, "only the last pipeline stage has logits"
        self.graphs = graphs
        self.batch = batch
        self.speculator = speculator
        self.masks = masks
        self.masked_twin: GreedyTail | None = None  # the same tail with grammar masks (graph_families.py)
        self.results: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size of the forward graphs (which must be captured already)."""
        start = time.perf_counter()
        for logits in self.graphs.logits.values():  # the argmax kernel's self-test, before the captures
            _triton_greedy(logits)
            break
        # Every graph row is the scratch slot now: the bodies run here write nothing that is read.
        self._graphs, self.results = capture_per_size(self.graphs.sizes, self.body)
        logger.info("captured %d greedy step-end CUDA graphs in %.2f s", len(self._graphs),
                    time.perf_counter() - start)

    def run(self, num_rows: int) -> torch.Tensor:
        """After the forward replay of `num_rows` rows: a fresh tensor with the rows' packed result."""
        size = self.graphs.padded_size(num_rows)
        graph = self._graphs.get(size)
        if graph is None:  # not captured (CPU): run the body itself
            self.results[size] = self.body(size)
        else:
            graph.replay()
        return self.results[size][:num_rows].clone()

    def run_masked(self, num_rows: int, upload: MaskUpload, bits, which) -> torch.Tensor:
        """`run` of a masked tail: logits row i (row i // q, position i % q) takes mask row
        which[i] of bits (int32 numpy [distinct, words]; which int32 numpy, -1 or short: none)."""
        upload.into(self.masks, bits, which)
        result = self.run(num_rows)
        self.masks.release()
        return result

    def body(self, size: int) -> torch.Tensor:
        graphs, batch = self.graphs, self.batch
        q = graphs.query_len
        slots = graphs.slots[:size]
        logits = graphs.logits[size]  # [size * q, V] (`local_logits`: this TP rank's vocab columns)
        if graphs.local_logits and self.masks is None:  # argmax across the ranks, logits not gathered
            sampled, bad = graphs.model.logits_head.argmax(logits)
        else:
            logits = graphs.whole_logits(logits)
            if self.masks is None and _triton_greedy(logits):  # one launch: the argmax and the screen
                from tokenmill.layers.triton_ops.greedy_argmax import greedy_argmax
                sampled, bad = greedy_argmax(logits)
            else:
                bad = ~torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))  # per position
                if self.masks is not None:  # after the screen: masked logits are -inf by design
                    apply_bitmask_by_row(logits, self.masks.bits, self.masks.which[:size * q])
                sampled = logits.argmax(dim=-1)
        sampled = torch.where(bad, 0, sampled)  # a failed row still gets a valid next input
        real = slots != batch.scratch
        failure = -int(RowFailure.NON_FINITE_LOGITS)
        if q == 1:
            batch.next_token_dev[slots] = sampled
            if self.speculator is not None:
                self.speculator.record(slots, sampled[:, None], real.to(torch.int64))
            return torch.where(bad, failure, sampled)
        num_drafts = graphs.num_drafts[:size]
        emitted, num_emitted = verify_drafts(sampled.view(size, q), graphs.drafts[slots, :q - 1], num_drafts)
        batch.next_token_dev[slots] = emitted.gather(1, (num_emitted - 1)[:, None]).squeeze(1)
        # The forward graph advanced each real row by 1 + its drafts: take the rejected ones back.
        batch.num_computed_dev.index_add_(0, slots, torch.where(real, num_emitted - num_drafts - 1, 0))
        if self.speculator is not None:
            self.speculator.record(slots, emitted, torch.where(real, num_emitted, 0))
        # Positions past a row's drafts are padding: their logits do not fail the row.
        verified = torch.arange(q, device=slots.device)[None, :] <= num_drafts[:, None]
        row_bad = (bad.view(size, q) & verified).any(dim=1)
        return torch.cat([emitted, torch.where(row_bad, failure, num_emitted)[:, None]], dim=1)
