"""Triton attention backend (GPU fast path): any mix of rows in one attention launch per layer.

1. `triton_kv_write`: this step's K/V into the paged cache at `slot_mapping` (or, given the step's
   rotary inputs, `triton_rope_kv_write`: q and k rotated and K/V written in one launch).
2. `triton_paged_attention`: one launch over the paged cache for every row of the
   batch (fresh prefills, chunked prefills over cached context, decodes of 1..8
   tokens), plus a small reduce launch when KV is split (flash-decoding).

CUDA graphs: `forward` never syncs with the host and allocates only through the
caching allocator. The launch depends on tensor shapes (rows of q, sequences in
`seq_lens`, heads), the SM count, and two host ints of `AttentionMetadata`, which
choose the launch but never affect correctness (`num_tokens` and the `_cpu`
tensors are not read):
- `max_query_len`: <= `decode_max_query_len` selects decode tiles and allows
  split-KV; any actual query length is still computed right (a longer one just
  takes several tiles).
- `max_seq_len`: caps the split count (short contexts are not split finely); any
  actual seq_len is right, the shares are sized on the device.
A graph captured with max_query_len=1 and max_seq_len=max_model_len replays
correctly for every decode batch of that size. Rows past the last sequence come
out as zeros; slots of -1 write nothing; a padding sequence may have query length
0, or query length 1 with seq_len 0 (its row comes out as zeros).

Importing this module does not import triton; the first `forward` does.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from tokenmill.layers.attention.backend import AttentionBackend, is_fp8
from tokenmill.layers.attention.metadata import AttentionMetadata

MAX_KV_SPLITS = 128  # the reduce kernel merges at most this many shares
MIN_TILE_ROWS = 16  # tl.dot needs at least 16 rows


@dataclass(frozen=True)
class DecodeTiles:
    """The launch of single-token decode tiles: each token's query rows of one KV group, padded.
    (Multi-token decode tiles take the config's block_n, decode_warps and num_stages.)"""

    block_n: int = 128  # keys per KV tile
    warps: int = 4
    stages: int = 2
    min_rows: int = MIN_TILE_ROWS  # query rows per tile at least (16; 64: Hopper's wgmma; H200: slower)
    # Round trips a tile waits on (the config's flags of the same names turn them on everywhere):
    early_v_load: bool = False  # V loaded with K (one round trip for both)
    table_prefetch: bool = False  # the next tile's block-table lookups issued before this tile's loads
    fp8_convert_on_load: bool | int = False  # fp8 caches: K/V to float16 where they load (not after the layout
    # change); 2: the values only (the keys' layout change is no transpose: wide shared-memory reads already)
    prewait: bool = False  # the step's inputs and the first KV tile's cached K/V read before the PDL wait


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile sizes and the split-KV rule. Prefill tiles: first guesses for H100/H200, untuned. Decode
    tiles of one token (query rows of one KV group padded to 16): tuned on an H200 by
    scripts/gpu_attention.py (Llama-3.1-8B heads; docs/results/gpu-attention.md)."""

    decode_max_query_len: int = 8  # launches with no longer query use decode tiles and may split KV
    decode_max_rows: int = 64  # query rows (tokens x heads of a KV group) per decode program, at most
    decode_warps: int = 4
    # Other launches: wide tiles when rows average at least `wide_min_query_len` tokens per sequence
    # (prefill-heavy), else narrower ones so that decode rows mixed in waste less compute.
    prefill_rows: int = 64
    prefill_warps: int = 4
    wide_rows: int = 128
    wide_warps: int = 8
    wide_min_query_len: int = 64
    block_n: int = 64  # keys per KV tile
    num_stages: int = 2
    # Single-token decode launches, per cache dtype and whether the KV axis is split (None: the next
    # one up: fp8 split -> fp8 -> (16-bit) split -> decode_tiles). H200, bf16 cache: 128-key tiles
    # 5-11% faster than 64 at 256 rows x 640 / 2048 keys and at 1 row x 16k; 2 stages best. fp8:
    # one stage and 2 warps 1.3-1.5x faster than 2 stages at 256 rows; split launches (few rows,
    # latency-bound) 4 stages and 4 warps. bf16 at 256 rows x 128 keys would take 64-key tiles (48.0 vs
    # 53.8 us) but 640 / 2048 keys lose 3% / 1% with them, and a decode graph (max_seq_len =
    # max_model_len) cannot tell the two apart: 128 keys (the engine's 1000x512x256 decodes at 512-768).
    decode_tiles: DecodeTiles = DecodeTiles()
    # Split (few sequences: latency-bound): each program reads the step's inputs and its first tile's cached
    # K/V before the PDL wait (`triton_paged_attention`'s PREWAIT), so that at batch 1 (one tile a program)
    # the reads run under the qkv GEMV and the KV write; the tile is held in registers across the wait:
    # 8 warps (172 registers; 4 warps spill). Without it (TOKENMILL_ATTN_PREWAIT=0): decode_tiles.
    split_decode_tiles: DecodeTiles | None = DecodeTiles(block_n=128, warps=8, stages=2, prewait=True)
    # fp8: the VALUES converted to float16 where they load (fp8_convert_on_load=2; without it the V tile is
    # read back from shared memory one byte per load), the keys after their layout change (no transpose:
    # wide shared-memory reads; converting them on load too sent them through shared memory twice more).
    # H100, per layer with the KV write: 256 rows x 640 keys 143.0 us against 168.9 converting both
    # (bf16 236.2); batch 1 x 16k (split, 4 stages) 24.9 against 25.9 converting neither (bf16 36.2)
    # (docs/results/gpu-kvfp8.md). 4 warps, 2 stages unsplit (3 stages: 143.4).
    fp8_decode_tiles: DecodeTiles | None = DecodeTiles(block_n=128, warps=4, stages=2, fp8_convert_on_load=2)
    fp8_split_decode_tiles: DecodeTiles | None = DecodeTiles(block_n=128, warps=4, stages=4, fp8_convert_on_load=2)
    # A share of the KV axis spans at least this many keys (of max_seq_len). H200, batch 1, context 640
    # captured at max_seq_len 784: 8 shares 8.1 / 8.6 us at 4 / 8 KV heads against 11.2 / 12.8 for the
    # 2 that 256 allowed (scripts/gpu_layouts.py --parts single).
    min_keys_per_split: int = 64
    waves: int = 2  # split until (sequences x KV heads x splits) fills this many waves of SMs
    kv_splits: int | None = None  # force this split count on decode launches (tests, tuning)
    interior: bool = True  # unmasked walk over the KV tiles every row of a tile sees whole
    lookup_blocks: bool = False  # in those tiles, one block-table read per cache block, not per key
    fp8_qk_dot: bool = False  # e4m3 caches: q . k as two fp8 dots (keys unconverted)
    fp8_pv_dot: bool = False  # e4m3 caches: p @ v as two fp8 dots (values unconverted)
    # On for every launch (else per DecodeTiles): decode launches' V loaded with K; fp8 K/V converted to
    # float16 where they load; block-table lookups one tile ahead in the unmasked walk.
    early_v_load: bool = False
    fp8_convert_on_load: bool = False
    table_prefetch: bool = False
    # fp8 caches: each block's values stored [kv head, head_dim, slot] (slots contiguous), so p @ v takes
    # its fp8 operand without a transpose (no float16 round trip through shared memory); the backend's
    # writes and reads both follow it, and nothing else reads the cache (backend.transpose_v_blocks).
    # Off: as first written (its V tile loaded [dim, keys] and transposed) triton 3.6, the GPU's, spilled
    # it (255 registers + 584 bytes of stack; H100 256 x 640 170.2 us, 3 stages 779, against 143.0); the
    # tile is now loaded [keys, dim] keys-contiguous (3.6: 206 registers, no stack), not yet timed.
    fp8_v_transposed: bool = False
    # The rotary + KV write kernel reads the positions, cos / sin rows and slots before its PDL wait.
    prewait_rope: bool = True
    # Single-token split decodes with PREWAIT (full rotary, power-of-two head_dim, values not transposed): the
    # attention kernel rotates q and this step's k and writes k, v into the cache itself (no rotary + KV
    # write launch: `triton_paged_attention`'s ROPE), after its device self-test (`rope_selftest`). TOKENMILL_ATTN_ROPE=0: off.
    rope_in_attention: bool = True


def decode_tiles_for(config: TritonAttentionConfig, kv_fp8: bool, split: bool) -> DecodeTiles:
    """The single-token decode launch for a cache dtype and a split / unsplit KV axis."""
    chain = ([config.fp8_split_decode_tiles] if kv_fp8 and split else []) + ([config.fp8_decode_tiles] if kv_fp8 else [])
    chain += ([config.split_decode_tiles] if split else []) + [config.decode_tiles]
    return next(t for t in chain if t is not None)


@dataclass(frozen=True)
class LaunchPlan:
    block_q: int  # query tokens per program
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    early_v_load: bool = False
    table_prefetch: bool = False
    fp8_convert_on_load: bool | int = False
    prewait: bool = False  # DecodeTiles.prewait


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


MIN_KEYS_ENV = "TOKENMILL_ATTN_MIN_KEYS_PER_SPLIT"
PREWAIT_ENV = "TOKENMILL_ATTN_PREWAIT"  # 0: `without_prewait`; 64: 4-warp 64-key prewait tiles (A/B timing)
ROPE_ENV = "TOKENMILL_ATTN_ROPE"  # 0: no rotary + KV write inside the attention kernel (A/B timing)
# A/B timing only: JSON overrides of the config, e.g. '{"fp8_decode_tiles": {"block_n": 64, "stages": 3},
# "wide_rows": 64}': DecodeTiles fields replace those of the named tiles, other keys the config's fields.
CONFIG_ENV = "TOKENMILL_ATTN_CONFIG"


def config_override(config: TritonAttentionConfig, raw: str) -> TritonAttentionConfig:
    """`config` with the fields of the JSON object `raw` (CONFIG_ENV) replaced."""
    import json

    changes = {}
    for name, value in json.loads(raw).items():
        if not hasattr(config, name):
            raise ValueError(f"{CONFIG_ENV}: TritonAttentionConfig has no field {name!r}")
        old = getattr(config, name)
        changes[name] = (dataclasses.replace(old or DecodeTiles(), **value) if isinstance(value, dict) else value)
    return dataclasses.replace(config, **changes)


def without_prewait(config: TritonAttentionConfig) -> TritonAttentionConfig:
    """The config with no reads before the PDL wait: the rotary + KV write as before, and decode tiles
    with prewait replaced by the next ones in `decode_tiles_for`'s chain (the default's split
    launches: decode_tiles, as before PREWAIT)."""
    drop = {name: None for name in ("split_decode_tiles", "fp8_split_decode_tiles", "fp8_decode_tiles")
            if getattr(config, name) is not None and getattr(config, name).prewait}
    if config.decode_tiles.prewait:
        drop["decode_tiles"] = dataclasses.replace(config.decode_tiles, prewait=False)
    return dataclasses.replace(config, prewait_rope=False, **drop)


def choose_kv_splits(config: TritonAttentionConfig, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                     sm_count: int) -> int:
    """Split count for a decode launch, from static numbers only."""
    if config.kv_splits is not None:
        return max(1, min(config.kv_splits, MAX_KV_SPLITS))
    programs = max(num_seqs * num_kv_heads, 1)
    target = config.waves * sm_count
    if programs >= target:
        return 1
    wanted = -(-target // programs)
    by_length = max(max_seq_len // config.min_keys_per_split, 1)
    # A power of two (H200, batch 1 x 16k: 32 shares 28.6 us, 33 shares 29.7).
    return 1 << (max(1, min(wanted, by_length, MAX_KV_SPLITS)).bit_length() - 1)


def plan_launch(config: TritonAttentionConfig, num_heads: int, num_kv_heads: int, num_rows: int, num_seqs: int,
                max_query_len: int, max_seq_len: int, sm_count: int, kv_fp8: bool = False) -> LaunchPlan:
    group_pad = _next_pow2(num_heads // num_kv_heads)
    min_q = -(-MIN_TILE_ROWS // group_pad)
    if max_query_len <= config.decode_max_query_len:
        # One tile per row where it fits, so a multi-token decode reads its KV once.
        splits = choose_kv_splits(config, num_seqs, num_kv_heads, max_seq_len, sm_count)
        tiles = decode_tiles_for(config, kv_fp8, splits > 1)
        if tiles.prewait and max(num_seqs, 1) * num_kv_heads * splits > sm_count:
            # a prewait program holds its tile across the wait (8 warps, ~200 registers: one a SM): where they
            # would take more than one wave, the launch without it (a few sequences: batch 1-2 of Llama-8B)
            tiles = decode_tiles_for(without_prewait(config), kv_fp8, splits > 1)
        min_rows = max(tiles.min_rows, MIN_TILE_ROWS)
        block_q = max(min(_next_pow2(max(max_query_len, 1)), config.decode_max_rows // group_pad),
                      -(-min_rows // group_pad), 1)
        early_v = config.early_v_load
        prefetch = config.table_prefetch
        bits = config.fp8_convert_on_load
        if block_q * group_pad > min_rows:  # multi-token decode tiles: untuned, but fp8 ones convert as the
            # single-token tiles of the dtype do (sm_90 SASS, 32 rows: without it V is read one byte per load)
            return LaunchPlan(block_q, config.block_n, splits, config.decode_warps, config.num_stages, early_v,
                              prefetch, bits or (tiles.fp8_convert_on_load if kv_fp8 else False))
        return LaunchPlan(block_q, tiles.block_n, splits, tiles.warps, tiles.stages, early_v or tiles.early_v_load,
                          prefetch or tiles.table_prefetch, bits or tiles.fp8_convert_on_load, tiles.prewait)
    if num_rows >= config.wide_min_query_len * max(num_seqs, 1):
        rows, warps = config.wide_rows, config.wide_warps
    else:
        rows, warps = config.prefill_rows, config.prefill_warps
    # Prefill launches: no early V (its tiles' registers); the table lookahead and bit conversion as set.
    return LaunchPlan(max(rows // group_pad, min_q, 1), config.block_n, 1, warps, config.num_stages, False,
                      config.table_prefetch, config.fp8_convert_on_load)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None, *,
                 config: TritonAttentionConfig | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if head_dim < 16:
            raise ValueError(f"head_dim={head_dim}: the Triton backend needs head_dim >= 16")
        self.config = config or TritonAttentionConfig()
        if config is None and head_dim > 128:
            # Wide heads (Gemma: 256): half-size tiles keep the K/V tiles and the float32
            # accumulator within the SM's shared memory and registers.
            c = self.config
            half = lambda t: t and dataclasses.replace(t, block_n=t.block_n // 2)  # (None stays None)
            self.config = dataclasses.replace(c, block_n=c.block_n // 2, prefill_rows=c.prefill_rows // 2,
                                              wide_rows=c.wide_rows // 2, decode_max_rows=c.decode_max_rows // 2,
                                              decode_tiles=half(c.decode_tiles),
                                              split_decode_tiles=half(c.split_decode_tiles),
                                              fp8_decode_tiles=half(c.fp8_decode_tiles),
                                              fp8_split_decode_tiles=half(c.fp8_split_decode_tiles))
        keys = os.environ.get(MIN_KEYS_ENV)  # A/B timing only: the split rule's fewest keys a share
        if config is None and keys:
            self.config = dataclasses.replace(self.config, min_keys_per_split=int(keys))
        prewait = os.environ.get(PREWAIT_ENV, "1")  # A/B timing only
        if config is None and prewait == "0":
            self.config = without_prewait(self.config)
        elif config is None and prewait == "64":  # 4-warp 64-key tiles, 16 shares at 768 keys (one tile a share)
            self.config = dataclasses.replace(self.config, min_keys_per_split=32, split_decode_tiles=DecodeTiles(
                block_n=64, warps=4, stages=2, prewait=True))
        if config is None and os.environ.get(ROPE_ENV, "1") == "0":  # A/B timing only
            self.config = dataclasses.replace(self.config, rope_in_attention=False)
        if config is None and os.environ.get(CONFIG_ENV):  # A/B timing only
            self.config = config_override(self.config, os.environ[CONFIG_ENV])
        self._sm_count: int | None = None  # read from the device on the first forward
        self._rope_tested = False  # rope_selftest's own backends: no test of the test
        # TOKENMILL_FUSED_ROPE_KV_WRITE=0: rotary and KV write apart (A/B timing only).
        self._fuse_rope = os.environ.get("TOKENMILL_FUSED_ROPE_KV_WRITE", "1") != "0"

    def fuses_rope(self, rope, kv_cache: torch.Tensor) -> bool:
        return self._fuse_rope and rope.cos is None and kv_cache.dtype in (
            torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, rope=None, kperm: bool = False) -> torch.Tensor:
        """`rope` (where `fuses_rope`): q and k are unrotated; one kernel rotates q in place and
        writes k rotated, with v, into the cache (`rope_in_attention`: in single-token split decode launches
        with PREWAIT the attention kernel does it, q rotated in registers, no launch of its own). `kperm` (head_dim a multiple of 64): each head's output in the
        INT4 swapped GEMM's K order (`quantization.int4_kperm`, for o_proj)."""
        from tokenmill.layers.attention import (
            rope_selftest,
            triton_kv_write,
            triton_paged_attention,
            triton_rope_kv_write,
        )

        if kv_cache.stride(-1) != 1:
            raise ValueError("the KV cache's head_dim axis must be contiguous")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        v_trans = self.v_transposed(kv_cache)
        # A window bounds the keys any query reads: split the KV axis by that, not the context.
        keys = meta.max_seq_len if self.sliding_window is None else min(
            meta.max_seq_len, self.sliding_window + meta.max_query_len)
        plan = plan_launch(self.config, self.num_heads, self.num_kv_heads, q.shape[0], meta.seq_lens.shape[0],
                           meta.max_query_len, keys, self._sm_count_of(q.device), is_fp8(kv_cache))
        rope_in = (rope is not None and self.config.rope_in_attention and plan.prewait and meta.max_query_len == 1
                   and rope.rotary_dim == self.head_dim and self.head_dim & (self.head_dim - 1) == 0 and not v_trans
                   and (self._rope_tested or rope_selftest.passed(self, kv_cache, q.dtype, rope)))
        if rope_in:
            pass  # the attention kernel rotates q and this step's k and writes k, v into the cache
        elif rope is not None:
            triton_rope_kv_write.rotate_and_write_kv(q, k, v, rope.positions, rope.cos_cache, rope.sin_cache,
                                                     rope.rotary_dim, kv_cache, meta.slot_mapping, self.k_scale,
                                                     self.v_scale, v_transposed=v_trans,
                                                     prewait=self.config.prewait_rope)
        else:
            triton_kv_write.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale,
                                     v_transposed=v_trans)
        return triton_paged_attention.paged_attention(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, self.scale,
            self.num_kv_heads, block_q=plan.block_q, block_n=plan.block_n, num_splits=plan.num_splits,
            max_splits=_next_pow2(plan.num_splits), num_warps=plan.num_warps, num_stages=plan.num_stages,
            interior=self.config.interior, lookup_blocks=self.config.lookup_blocks,
            fp8_qk_dot=self.config.fp8_qk_dot, fp8_pv_dot=self.config.fp8_pv_dot,
            early_v_load=plan.early_v_load, fp8_convert_on_load=plan.fp8_convert_on_load, table_prefetch=plan.table_prefetch,
            v_transposed=v_trans,
            sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
            k_scale=self.k_scale, v_scale=self.v_scale, sinks=self.sinks, kperm=kperm, prewait=plan.prewait,
            rope=(rope, k, v, meta.slot_mapping) if rope_in else None)

    def v_transposed(self, kv_cache: torch.Tensor) -> bool:
        """Whether this backend stores `kv_cache`'s values transposed per block (fp8_v_transposed)."""
        return self.config.fp8_v_transposed and is_fp8(kv_cache)

    def _sm_count_of(self, device: torch.device) -> int:
        if self._sm_count is None:
            self._sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                              if device.type == "cuda" else 1)
        return self._sm_count
