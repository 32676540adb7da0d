"""Tensor-parallel layers: each rank holds a shard of the weight, and one collective joins them.

- Column-parallel linears (fused qkv, gate_up) are plain `Linear`s over the rank's output rows:
  no communication (the shard's rows are chosen at load time, `tokenmill.distributed.layout`).
- `RowParallelLinear` (o_proj, down_proj) holds the rank's input columns: each rank's partial
  product is summed over the TP group. Bias and residual are added on TP rank 0 only, before
  the sum, so the packed CPU path still fuses the residual add into the matmul. With
  `wide_output` set (o_proj, down_proj of the Llama family), a CPU bf16 result is float32.
- `VocabParallelEmbedding` holds the rank's vocab rows; a token outside them embeds to zeros,
  and the sum over the group fills every row.
- `ParallelLMHead` computes the rank's vocab columns of the logits and gathers them all; the
  logits are float32 (on CPU in bf16, straight from float32 accumulation: `cpu_logits`).
With one rank every class is its plain counterpart, numerically identical.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import ParallelContext, PendingAllReduce, StartedAllReduce
from tokenmill.layers import cpu_amx_gemm, cpu_bf16_gemm, cpu_logits, triton_ops, wide_linear
from tokenmill.layers.linear import UNQUANTIZED, Linear, PackedWeight, bind_base, bind_base_add, linear


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel
        self.first_rank = parallel.layout.tp_rank == 0
        self._wide_packed = cpu_bf16_gemm.PackedBf16()
        # Set by layers that hand the output straight to an RMSNorm's `forward_with_residual`:
        # where the fused kernel exists, `forward` returns the partial sum as a `PendingAllReduce`
        # and the norm all-reduces, adds and normalizes in one launch.
        self.defer_reduce = False
        # Set by layers whose output joins the float32 residual stream: on CPU in bf16 the result
        # is then float32, never rounded to bf16 (`wide_linear`). (Rebinds.)
        self.wide_output = False

    @property
    def wide_output(self) -> bool:
        return self.__dict__["wide_output"]

    @wide_output.setter
    def wide_output(self, value: bool) -> None:
        self.__dict__["wide_output"] = value
        self.rebind()

    def rebind(self) -> None:
        """`Linear.rebind` for a row-parallel layer: `run` (x, lora_into) and `run_add` (x, residual),
        each ending in the TP reduction, and the weight a float32 result may come from (`wide`)."""
        if "wide_output" not in self.__dict__:  # (Linear's __init__: this one's binds at its end)
            return
        lora, weight = self.__dict__["lora"], self.weight
        bias = self.bias if self.first_rank else None
        base = bind_base(self, bias)
        self.__dict__["_wide_weight"] = weight if (  # (not registered: the weight's own Parameter)
            self.wide_output and lora is None and self.quant_method is UNQUANTIZED
            and wide_linear.takes_weight(weight)) else None
        self.run = self._bind_run(base, lora)
        self.run_add = self._bind_run_add(base, lora, bias)

    def _bind_run(self, base: Callable, lora) -> Callable:
        reduce = self._reduce
        if lora is not None:
            batch = lora.batch

            def run_lora(x: torch.Tensor, lora_into: torch.Tensor | None = None):
                if not batch.active:
                    return reduce(base(x))
                # A LoRA delta (on this rank's input columns) joins the partial sum before the reduction.
                sink = lora_into if self.parallel.tp_size == 1 else None
                return reduce(lora.forward(x, lambda: base(x), sink))
            return run_lora
        if self._wide_weight is None:
            return lambda x, lora_into=None: reduce(base(x))

        def run_wide(x: torch.Tensor, lora_into: torch.Tensor | None = None):
            if self.wide(x):
                return self.parallel.all_reduce(
                    wide_linear.linear_f32(x, self._wide_weight, self._bias(), self._packed, self._wide_packed))
            return reduce(base(x))
        return run_wide

    def _bind_run_add(self, base: Callable, lora, bias: torch.Tensor | None) -> Callable:
        """(x, residual) -> `forward(x) + residual` (the add on rank 0 only), reduced."""
        if self.first_rank:
            add = bind_base_add(self, bias, base)
        else:
            def add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                return base(x)
        if lora is not None:
            batch = lora.batch

            def run_lora(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                if not batch.active:
                    return self.parallel.all_reduce(add(x, residual))
                return self.parallel.all_reduce(lora.forward(x, lambda: add(x, residual), plain=False))
            return run_lora
        if self._wide_weight is None:
            return lambda x, residual: self.parallel.all_reduce(add(x, residual))

        def run_wide(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            # a float32 residual stream with a `wide` result: the add in the GEMM's epilogue, unrounded
            if self.wide(x) and residual.dtype == torch.float32:
                return self.parallel.all_reduce(wide_linear.linear_f32(
                    x, self._wide_weight, self._bias(), self._packed, self._wide_packed,
                    add=residual if self.first_rank else None))
            return self.parallel.all_reduce(add(x, residual))
        return run_wide

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor | PendingAllReduce | StartedAllReduce:
        if getattr(self.parallel, "starts_reduces", False):  # (model/tp_overlap.py: its caller waits)
            return self.parallel.start_all_reduce(partial)
        if self.defer_reduce and self.parallel.defers_reduce():
            return PendingAllReduce(partial, self.parallel)
        return self.parallel.all_reduce(partial)

    def _bias(self) -> torch.Tensor | None:
        return self.bias if self.first_rank else None

    def wide(self, x: torch.Tensor) -> bool:
        """Whether this layer's result for an input like `x` (any width) is float32 (`wide_linear`)."""
        weight = self._wide_weight  # (None unless a plain bf16 CPU weight of a wide_output layer: `rebind`)
        return weight is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu \
            and not (torch.is_grad_enabled() and weight.requires_grad)

    def forward(self, x: torch.Tensor, lora_into: torch.Tensor | None = None) -> torch.Tensor:
        """`lora_into`: the residual stream the output is added to next: without TP (the output is
        the whole sum) a LoRA delta may go there directly (`LoRASlots.forward`'s sink)."""
        return self.run(x, lora_into)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`forward(x) + residual`; the add runs inside rank 0's matmul where it can (a float32
        residual stream with a `wide` result: in the GEMM's epilogue, unrounded)."""
        return self.run_add(x, residual)


class VocabParallelEmbedding(nn.Module):
    """`weight`: [vocab_per_rank, hidden], the rank's vocab rows (the last shard zero-padded)."""

    def __init__(self, num_rows: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size), requires_grad=False)
        self.parallel = parallel
        self.start = parallel.layout.vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        if triton_ops.enabled(input_ids) and input_ids.dim() == 1 and self.weight.is_contiguous():  # one launch
            from tokenmill.layers.triton_ops.vocab_embedding import vocab_embedding
            return self.parallel.all_reduce(vocab_embedding(input_ids, self.weight, self.start))
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(out.masked_fill_(outside[:, None], 0.0))


class ParallelLMHead:
    """Logits over the whole vocabulary from each rank's vocab rows of `weight` (the LM head's,
    or the embedding's when tied)."""

    def __init__(self, parallel: ParallelContext) -> None:
        self.parallel = parallel
        self.packed = PackedWeight()
        self.gemm_packed = cpu_bf16_gemm.PackedBf16()
        self._cuda_f32_out = True  # until torch.mm(out_dtype=float32) turns out unsupported
        self._cuda_f32_into = True  # the same with out=
        self.head_8bit = None  # fp8 models on CUDA: an 8-bit copy for small batches (`quantization.lm_head_8bit`)

    def _cuda_logits(self, hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """float32 logits straight from cuBLAS's float32 accumulation (not rounded to bf16 first),
        into `out` [rows, V] float32 when given."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if out is not None and self._cuda_f32_into:
            try:
                return torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
            except (RuntimeError, TypeError):  # no `out` with out_dtype here: the caller copies
                self._cuda_f32_into = False
        try:
            result = torch.mm(h, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # older torch: no mixed-dtype mm; the first (eager) call decides
            self._cuda_f32_out = False
            return F.linear(hidden, weight)
        return result.view(*hidden.shape[:-1], weight.shape[0])

    def _cpu_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """float32 logits of bf16 on CPU: the packed AVX512-BF16 GEMM where the machine has it (the
        weight packed once, a copy of it kept: ~1.3-2x faster than the dot-product kernel at 1 to
        64 rows, and than oneDNN's bf16 matmul), else `cpu_logits`' kernel."""
        if cpu_bf16_gemm.available():
            h = hidden.reshape(-1, hidden.shape[-1])
            if cpu_amx_gemm.takes_f32(h.shape[0]):  # (AMX tiles: the same packed weight)
                out = cpu_amx_gemm.gemm(h, weight, self.gemm_packed)
            else:
                out = cpu_bf16_gemm.gemm_f32(h, weight, self.gemm_packed)
            return out.view(*hidden.shape[:-1], weight.shape[0])
        return cpu_logits.linear_f32(hidden, weight)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               gather: bool = True) -> torch.Tensor:
        """float32 logits [rows, V]; written into `out` when given (a buffer a CUDA graph replays into).
        `gather=False`: this rank's vocab columns only ([rows, vocab_per_rank], the last shard's
        padding columns included), for `gather` or `argmax` later."""
        whole = self.parallel.tp_size == 1 or not gather
        if cpu_logits.supports(hidden, weight):  # bf16 on CPU: float32 logits, never rounded to bf16
            local = self._cpu_logits(hidden, weight)
        elif self.head_8bit is not None and self.head_8bit.takes(hidden):
            local = self.head_8bit.logits(hidden)
        elif self._cuda_f32_out and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            local = self._cuda_logits(hidden, weight, out if whole and hidden.dim() == 2 else None)
            if local is out:
                return out
        else:
            local = linear(hidden, weight, None, self.packed)
        result = local if whole else self.gather(local)
        return result.float() if out is None else out.copy_(result)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from every rank's `logits(..., gather=False)`."""
        if self.parallel.tp_size == 1:
            return local
        return self.parallel.all_gather_last_dim(local)[..., :self.parallel.layout.vocab_size]

    def shards_argmax(self) -> bool:
        """Whether `argmax` serves this layout: TP > 1 and every rank holds a vocab row."""
        layout = self.parallel.layout
        return layout.tp_size > 1 and (layout.tp_size - 1) * layout.vocab_per_rank < layout.vocab_size

    def argmax(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy token id, row not finite) per row of the whole vocabulary's float32 logits, from this
        rank's columns `local` ([rows, vocab_per_rank]) without gathering them: each rank's
        maximum, its id and its row's finiteness go to every rank (3 numbers a row instead of the
        logits), `pick_sharded_argmax` takes the row's answer. Equal on every rank."""
        start, count = self.parallel.layout.vocab_rows()
        return pick_sharded_argmax(self.parallel.all_gather_stacked(pack_shard_argmax(local, start, count)))


def pack_shard_argmax(local: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """float32 [3, rows]: per row of a rank's logits columns (the first `count` real, vocab ids from
    `start`), its maximum, the maximum's first id, and 1.0 where the row is not finite."""
    part = local[:, :count]
    bad = ~torch.isfinite(part.sum(dim=-1, dtype=torch.float32))
    idx = part.argmax(dim=-1)
    best = part.gather(1, idx[:, None]).squeeze(1).float()
    return torch.stack([best, (idx + start).to(torch.float32), bad.to(torch.float32)])  # (ids exact below 2**24)


def pick_sharded_argmax(every: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From every rank's `pack_shard_argmax` ([ranks, 3, rows], ranks in vocab order): per row the id
    of the first rank holding the largest maximum (ties: the lowest id, as `argmax` over the whole
    row) and whether any rank's part of the row is not finite."""
    rank = every[:, 0].argmax(dim=0)
    ids = every[:, 1].gather(0, rank[None]).squeeze(0).to(torch.int64)
    return ids, every[:, 2].amax(dim=0) > 0
