"""Start-up work on CUDA: size the KV pool from a profiled peak, and run every kernel shape once
(so the first request does not pay for compiles or allocator growth)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.model.intermediate import IntermediateTensors

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def dummy_metadata(query_lens: list[int], seq_lens: list[int], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    """Sequences laid out in consecutive blocks from block 0; every slot is written."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    width = max(blocks_per_seq)
    table = np.zeros((len(seq_lens), width), dtype=np.int32)
    slots, first = [], 0
    for i, (q, s, nb) in enumerate(zip(query_lens, seq_lens, blocks_per_seq)):
        table[i, :nb] = np.arange(first, first + nb)
        positions = np.arange(s - q, s)
        slots.append(table[i, positions // block_size].astype(np.int64) * block_size + positions % block_size)
        first += nb
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    qsl_cpu = torch.from_numpy(qsl)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=qsl_cpu.to(device), seq_lens=seq_cpu.to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu)


@torch.inference_mode()
def run_dummy(runner: ModelRunner, query_lens: list[int], seq_lens: list[int], sample_rows: int) -> None:
    meta = dummy_metadata(query_lens, seq_lens, runner.block_size, runner.device)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(runner.device)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long, device=runner.device)
    stage = runner.stage
    if stage.num_stages == 1:
        hidden = runner.model(ids, positions, runner.kv_caches, meta)
    else:  # each stage on its own: a later one starts from zero activations (no peer is involved)
        intermediate = None if stage.layout.is_first_stage else IntermediateTensors.of(
            [torch.zeros(shape, dtype=runner.dtype, device=runner.device)
             for shape in runner.model.intermediate_shapes(meta.num_tokens)])
        hidden = runner.model(ids, positions, runner.kv_caches, meta, intermediate)
        if not stage.is_last:
            return
    logits = runner.model.compute_logits(hidden[-sample_rows:])
    logits.softmax(-1)


def split_into_sequences(num_tokens: int, max_len: int) -> list[int]:
    """`num_tokens` prompt tokens as sequences of at most `max_len` (a full step of prefills)."""
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


def profile_and_budget(runner: ModelRunner) -> int:
    """Run the largest step once (a full token budget of prefills); the KV pool gets what the
    utilization target leaves."""
    config, device = runner.config, runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    lens = split_into_sequences(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
    runner.allocate_kv_cache(sum(-(-n // runner.block_size) for n in lens))
    run_dummy(runner, lens, lens, min(config.scheduler.max_num_seqs, sum(lens)))  # logits of a full decode batch
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    runner.kv_caches = []
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    budget = int(total * config.cache.gpu_memory_utilization) - peak - used_by_others
    logger.info("GPU memory: total %.1f GiB, model peak %.2f GiB, KV budget %.2f GiB",
                total / 2**30, peak / 2**30, budget / 2**30)
    return budget


def warm_up_kernels(runner: ModelRunner) -> None:
    """One step of each kind the engine runs, so the first request pays for no compile, lazy
    module load or allocator growth: prefill steps of every power-of-two token count up to the
    budget (the matmuls pick kernels by size), a mixed batch (chunks over cached context,
    decodes, multi-token decodes) and eager decode batches."""
    start = time.perf_counter()
    config = runner.config
    max_len = config.model.max_model_len
    budget = config.scheduler.max_num_batched_tokens
    num_blocks = runner.kv_caches[0].shape[1] if runner.kv_caches else 0
    shapes = []
    sizes = sorted({min(1 << k, budget) for k in range(4, budget.bit_length() + 1)} | {budget})
    for size in sizes:
        lens = split_into_sequences(size, max_len)
        shapes.append((lens, lens))
    mixed_q, mixed_s = [64, 1, 1, 4], [min(192, max_len), min(300, max_len), 17, min(40, max_len)]
    shapes.append((mixed_q, mixed_s))
    for batch in sorted({1, min(8, config.scheduler.max_num_seqs), config.scheduler.max_num_seqs}):
        shapes.append(([1] * batch, [min(100, max_len)] * batch))
    for query_len in (2, 4, 8):  # decode tiles of several query tokens (a short last prefill chunk)
        shapes.append(([query_len] * 4, [min(100, max_len)] * 4))
    ran = 0
    for query_lens, seq_lens in shapes:
        if sum(-(-s // runner.block_size) for s in seq_lens) <= num_blocks:
            run_dummy(runner, query_lens, seq_lens, min(len(query_lens), config.scheduler.max_num_seqs))
            ran += 1
    torch.cuda.synchronize(runner.device)
    logger.info("warmed up %d step shapes in %.1f s", ran, time.perf_counter() - start)
