"""Which part of the model each rank holds: pure arithmetic on the config, no torch.

Ranks: rank = pp_stage * tp_size + tp_rank. Stage s holds decoder layers
[layer_start, layer_end) (an even split unless a partition is given); within a stage, TP rank r
holds query heads [r * H/tp, (r+1) * H/tp), the matching rows of the MLP's intermediate size,
and vocab rows [r * Vp, (r+1) * Vp) of the embedding and LM head (Vp = ceil(V / tp), the last
shard padded). KV heads are split like query heads when there are at least as many as ranks;
otherwise each KV head is replicated on tp / num_kv_heads consecutive ranks, and rank r holds
the one KV head its query heads read (GQA maps query head h to KV head h // (H / num_kv_heads)).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ModelArch, ParallelConfig


def even_partition(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible. When they do not divide evenly the first stages take
    one extra layer each, so the last stage, which also runs the final norm and the LM head and
    samples, never holds more layers than another."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    for i in range(extra):
        counts[i] += 1
    return tuple(counts)


def parse_partition(text: str | None, num_layers: int, num_stages: int) -> tuple[int, ...]:
    """`--pp-layer-partition "10,6"` -> (10, 6) ("even" or nothing: `even_partition`); ValueError
    naming the field when it does not fit."""
    if not text or text.strip().lower() == "even":
        return even_partition(num_layers, num_stages)
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"pp_layer_partition must be comma-separated integers, got {text!r}") from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"pp_layer_partition must give each of the {num_stages} pipeline stages at least one "
                         f"layer and sum to the model's {num_layers} layers, got {text!r}")
    return counts


def check_parallel(arch: ModelArch, tp: int, pp: int) -> None:
    """ValueError naming the field when the model cannot be split this way."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
    if arch.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's num_attention_heads "
                         f"({arch.num_heads})")
    kv = arch.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's num_key_value_heads ({kv}) "
                         f"or be a multiple of it")
    if arch.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's intermediate_size "
                         f"({arch.intermediate_size})")
    moe = arch.moe
    if moe is not None:
        for field, size in (("moe_intermediate_size", moe.intermediate_size),
                            ("shared expert intermediate size", moe.shared_intermediate_size)):
            if size % tp:
                raise ValueError(f"tensor_parallel_size {tp} must divide the model's {field} ({size})")
    if pp > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} must be at most the model's {arch.num_layers} layers")


@dataclass(frozen=True)
class RankLayout:
    rank: int
    tp_size: int
    pp_size: int
    layer_start: int
    layer_end: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # the model's index of the first local KV head
    intermediate_size: int  # local
    vocab_start: int
    vocab_per_rank: int  # Vp: rows of the local embedding / LM head shard (padded)
    vocab_size: int  # the model's

    @staticmethod
    def of(arch: ModelArch, parallel: ParallelConfig, rank: int) -> RankLayout:
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        tp_rank, stage = rank % tp, rank // tp
        partition = parallel.layer_partition or even_partition(arch.num_layers, pp)
        start = sum(partition[:stage])
        kv = arch.num_kv_heads
        if kv >= tp:
            local_kv, kv_start = kv // tp, tp_rank * (kv // tp)
        else:
            local_kv, kv_start = 1, tp_rank // (tp // kv)
        per_rank = -(-arch.vocab_size // tp)
        return RankLayout(rank=rank, tp_size=tp, pp_size=pp, layer_start=start, layer_end=start + partition[stage],
                          num_heads=arch.num_heads // tp, num_kv_heads=local_kv, kv_head_start=kv_start,
                          intermediate_size=arch.intermediate_size // tp, vocab_start=tp_rank * per_rank,
                          vocab_per_rank=per_rank, vocab_size=arch.vocab_size)

    @staticmethod
    def single(arch: ModelArch) -> RankLayout:
        return RankLayout.of(arch, ParallelConfig(), 0)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_stage == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def has_layer(self, index: int) -> bool:
        return self.layer_start <= index < self.layer_end

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def prev_stage_rank(self) -> int:
        return self.rank - self.tp_size

    def vocab_rows(self) -> tuple[int, int]:
        """(first, count) of the model's vocab rows this rank holds (count < Vp on a padded last shard)."""
        count = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        return self.vocab_start, count
