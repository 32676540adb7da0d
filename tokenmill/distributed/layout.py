"""Which part of the model each rank holds: pure arithmetic on the config, no torch.

Ranks: rank = pp_stage * tp_size + tp_rank. Stage s holds decoder layers
[layer_start, layer_end) (an even split unless a partition is given); within a stage, TP rank r
holds query heads [r * H/tp, (r+1) * H/tp), the matching rows of the MLP's intermediate size,
and vocab rows [r * Vp, (r+1) * Vp) of the embedding and LM head (Vp = ceil(V / tp), the last
shard padded). KV heads are split like query heads when there are at least as many as ranks;
otherwise each KV head is replicated on tp / num_kv_heads consecutive ranks, and rank r holds
the one KV head its query heads read (GQA maps query head h to KV head h // (H / num_kv_heads)).

Half layers (`--pp-layer-partition 16.5,15.5`, Llama-layer families): a stage boundary may fall
inside a decoder layer, after its attention. The earlier stage then also runs that layer's input
norm and attention (and holds its KV cache); the later stage runs its post-attention norm and MLP,
from the (attention output, residual) the earlier one hands over, as between whole layers. In
`ParallelConfig` the layer counts the split layer on the later stage and `split_attention[s]`
says that stage s runs the attention of stage s+1's first layer. A decode micro-batch pays the
LM head on every row and a prompt chunk only on its last tokens, so no whole-layer split
balances both; half a layer's attention (mostly the KV read in decode, a quarter of a prompt
chunk's layer) comes close to what the head costs beyond a layer's share.
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


def parse_layer_split(text: str | None, num_layers: int, num_stages: int
                      ) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """`--pp-layer-partition` with half layers: "16.5,15.5" -> ((16, 16), (True,)): layers per
    stage (a split layer counted on the later stage) and, per boundary, whether it falls after the
    attention of the later stage's first layer (see the module doc). Whole numbers: `parse_partition`,
    no splits. ValueError naming the field when it does not fit."""
    if not text or "." not in text:
        return parse_partition(text, num_layers, num_stages), ()
    try:
        halves = [float(part) * 2 for part in text.split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition must be comma-separated numbers of layers, got {text!r}") from None
    if len(halves) != num_stages or sum(halves) != 2 * num_layers or any(h != int(h) or h < 2 for h in halves):
        raise ValueError(f"pp_layer_partition must give each of the {num_stages} pipeline stages a whole or half "
                         f"number of layers (at least 1: every stage holds an attention and its KV cache) summing to the model's {num_layers} layers, got {text!r}")
    return split_from_halves(tuple(int(h) for h in halves))


def split_from_halves(halves: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Half layers per stage, (33, 31) -> ((16, 16), (True,)): `ParallelConfig`'s layer counts and
    split boundaries (see `parse_layer_split`)."""
    bounds = [0]
    for h in halves:
        bounds.append(bounds[-1] + h)  # in half layers: 2i is layer i's attention, 2i + 1 its MLP
    counts = tuple(bounds[s + 1] // 2 - bounds[s] // 2 for s in range(len(halves)))
    return counts, tuple(bool(b % 2) for b in bounds[1:-1])


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
    # Half layers (module doc): this stage also runs the attention of layer `layer_end` (the next
    # stage's first), and / or only the MLP of its own first layer (the previous stage ran its attention).
    borrows_attention: bool = False
    lends_attention: bool = False

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
        split = parallel.split_attention or (False,) * (pp - 1)
        return RankLayout(rank=rank, tp_size=tp, pp_size=pp, layer_start=start, layer_end=start + partition[stage],
                          num_heads=arch.num_heads // tp, num_kv_heads=local_kv, kv_head_start=kv_start,
                          intermediate_size=arch.intermediate_size // tp, vocab_start=tp_rank * per_rank,
                          vocab_per_rank=per_rank, vocab_size=arch.vocab_size,
                          borrows_attention=stage < pp - 1 and split[stage],
                          lends_attention=stage > 0 and split[stage - 1])

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
        """Layers this stage runs whole or in part."""
        return self.layers_end - self.layer_start

    @property
    def layers_end(self) -> int:
        """One past the last layer this stage runs any part of (`layer_end`, or the borrowed one's)."""
        return self.layer_end + self.borrows_attention

    @property
    def kv_layer_start(self) -> int:
        """The first layer whose attention (and KV cache) is here: this stage's KV caches are layers
        [kv_layer_start, layers_end)."""
        return self.layer_start + self.lends_attention

    @property
    def num_kv_layers(self) -> int:
        return self.layers_end - self.kv_layer_start

    @property
    def has_split_layers(self) -> bool:
        return self.borrows_attention or self.lends_attention

    def has_layer(self, index: int) -> bool:
        """Whether this stage runs any part of layer `index`."""
        return self.layer_start <= index < self.layers_end

    def layer_part(self, index: int) -> str:
        """What this stage runs of layer `index` (one it has): "layer", "attention" or "mlp"."""
        if self.lends_attention and index == self.layer_start:
            return "mlp"
        if self.borrows_attention and index == self.layer_end:
            return "attention"
        return "layer"

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
