"""The draft-model proposer: a smaller model (same vocabulary; it may be the target itself) with
its own KV cache in the target's block tables, proposing k tokens per row on the device.

Draft KV without holes: every step, the draft runs over exactly the target's inputs (`mirror`:
prompt chunks, the last token and its drafts, at the same positions and KV slots), so each
position the target computed the draft computed too, with the same token. Then, for the rows
that sampled, `propose` starts at the token the step emitted last (the bonus or the correction,
at the row's new computed count) and runs k single-token steps, each feeding the previous
proposal. A rejected draft's KV is overwritten before it is ever read: the next step's mirror
writes those positions again with the verified tokens.

A proposal position past the row's allocated blocks goes to scratch blocks of the draft's own
(beyond the shared pool, a few per row of the proposing step): the scheduler allocates real
blocks before any step feeds a token there, and that step's mirror fills them.

Proposals are drawn with the target's sampling parameters from the draft's distribution q (the
MAIN noise stream at each output position); q is kept per slot for rejection sampling. While the
sampling plan is plain greedy, a proposal is the argmax of the draft's logits, and on CUDA the k
steps replay as one graph per padded batch size (`capture_greedy`; padding rows propose for the
scratch slot, into scratch blocks).
"""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.model.loader import load_model
from tokenmill.worker.graph_capture import capture_per_size, replay_over_rows


class DraftProposer:
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, attention_backend_cls,
                 num_slots: int, k: int) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.k = k
        self.model = load_model(config.path, config.arch, config.load_format, dtype, device, attention_backend_cls,
                                seed=config.seed)
        self.kv_caches: list[torch.Tensor] = []
        self.num_slots = num_slots
        self.probs: torch.Tensor | None = None  # float32 [slots, K, V]: q of each proposal (made on first use)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded rows -> the greedy k steps (CUDA)
        self._graph_slots: torch.Tensor | None = None

    def kv_block_bytes(self, block_size: int) -> int:
        arch = self.config.arch
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element

    def allocate(self, shape_for, num_blocks: int, block_size: int) -> None:
        """`shape_for(num_blocks, num_kv_heads, head_dim)`: the KV tensor shape of one layer. The
        draft holds the pool's `num_blocks` plus its scratch blocks."""
        arch = self.config.arch
        self.scratch_base = num_blocks
        self.scratch_per_row = -(-self.k // block_size) + 1
        total = num_blocks + self.num_slots * self.scratch_per_row
        self.kv_caches = [torch.zeros(shape_for(total, arch.num_kv_heads, arch.head_dim), dtype=self.dtype,
                                      device=self.device) for _ in range(arch.num_layers)]

    @torch.inference_mode()
    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The target's step, for the draft's KV (no logits)."""
        self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, sampler, slots: torch.Tensor, next_token: torch.Tensor, num_computed: torch.Tensor,
                block_table: torch.Tensor, num_blocks: torch.Tensor, block_size: int, max_model_len: int,
                out: torch.Tensor, keep_probs: bool, greedy: bool = False) -> None:
        """k proposals for each of `slots` (int64 [S]) into `out[slots]` (int64 [slots, K]); with
        `keep_probs`, their distributions q into `self.probs[slots]`. `greedy`: the sampling plan is
        plain greedy (proposals are the argmax; a captured graph replays when one fits)."""
        if greedy and replay_over_rows(self._graphs, self._graph_slots, slots, self.num_slots - 1):
            return
        self._steps(None if greedy else sampler, slots, next_token, num_computed, block_table, num_blocks,
                    block_size, max_model_len, out, keep_probs and not greedy)

    @torch.inference_mode()
    def capture_greedy(self, sizes: list[int], slots: torch.Tensor, *tensors_and_sizes) -> None:
        """Graphs of `propose(greedy=True)` for batches padded to `sizes`, reading their rows from
        `slots` (the verification graphs' row buffer, padded with the scratch slot: proposing for
        a prefix of it copies nothing); `tensors_and_sizes`: propose's arguments from `next_token`
        to `out` (persistent tensors, read at each replay)."""
        assert slots.shape[0] >= max(sizes)
        self._graph_slots = slots
        self._graphs, _ = capture_per_size(
            sizes, lambda size: self._steps(None, slots[:size], *tensors_and_sizes, False))

    def _steps(self, sampler, slots: torch.Tensor, next_token: torch.Tensor, num_computed: torch.Tensor,
               block_table: torch.Tensor, num_blocks: torch.Tensor, block_size: int, max_model_len: int,
               out: torch.Tensor, keep_probs: bool) -> None:
        """The k single-token draft steps; `sampler` None: each proposal is the argmax."""
        num_rows = slots.shape[0]
        tokens = next_token.index_select(0, slots)
        positions = num_computed.index_select(0, slots)
        owned = num_blocks.index_select(0, slots)
        tables = block_table.index_select(0, slots)
        columns = torch.arange(tables.shape[1], device=self.device)[None, :]
        scratch = (self.scratch_base + torch.arange(num_rows, device=self.device)[:, None] * self.scratch_per_row
                   + (columns - owned[:, None]).clamp(0, self.scratch_per_row - 1))
        tables = torch.where(columns >= owned[:, None], scratch.to(tables.dtype), tables)
        qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=self.device)
        on_cpu = self.device.type == "cpu"
        host_qsl = torch.arange(num_rows + 1, dtype=torch.int32)
        host_lens = torch.full((num_rows,), max_model_len, dtype=torch.int32)  # an upper bound (CUDA)
        if keep_probs and self.probs is None:
            self.probs = torch.zeros((self.num_slots, self.k, self.config.arch.vocab_size), dtype=torch.float32,
                                     device=self.device)
        for j in range(self.k):
            column = (positions // block_size).clamp_max(tables.shape[1] - 1)
            block = tables.gather(1, column[:, None]).squeeze(1).to(torch.int64)
            slot_mapping = block * block_size + positions % block_size
            seq_lens = (positions + 1).to(torch.int32)
            meta = AttentionMetadata(
                num_tokens=num_rows, max_query_len=1, max_seq_len=max_model_len, query_start_loc=qsl,
                seq_lens=seq_lens, block_table=tables, slot_mapping=slot_mapping,
                query_start_loc_cpu=host_qsl, seq_lens_cpu=seq_lens if on_cpu else host_lens, seq_lens_exact=on_cpu)
            hidden = self.model(tokens, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
            if sampler is None:
                tokens = logits.argmax(dim=-1)
            else:
                offsets = torch.full_like(slots, j)
                q = sampler.probs(logits, slots, offsets)
                tokens = sampler.draw(q, slots, offsets)
                if keep_probs:
                    self.probs[slots, j] = q
            out[slots, j] = tokens
            positions = positions + 1
