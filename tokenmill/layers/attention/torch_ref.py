"""Pure-torch paged attention: the reference backend (CPU, tests, GPU fallback), fast enough on CPU.

Everything that depends only on the step's metadata (which rows are decodes,
which are fresh prefills, gather indices, masks) is worked out once per step in
a `_StepPlan` and shared by every layer; each layer then runs a handful of ops:

- KV write: one `index_copy_` per K and V into the flat cache.
- Fresh prefills (no cached context): straight from the new q/k/v, no cache
  gather; sequences of equal length share one causal SDPA call ([B, H, L, D]).
- Decodes (query length 1): on CPU, one call of a small C kernel that reads K/V
  in place through the block table (`cpu_decode.py`); elsewhere (or without a C
  compiler) one gather of their blocks into a buffer reused by every layer,
  then one masked SDPA call over all of them. On CPU with the kernel, short
  chunks after cached context (speculative verification) join them, one
  single-query attention per token.
- Other prefill chunks with cached context: one SDPA call each over their own
  context, with a causal mask offset by the context.

Sliding-window layers (`sliding_window` W) get their own plan: bands in the masks, and the
decode gather and chunk reads start at the first block a query can see (the C kernel skips the
earlier ones itself), so no block wholly before a window is read. Soft-capped layers and layers
with attention sinks run the eager form (scores, cap, mask, softmax with the sink logit as one
more column, values): SDPA has neither.

GQA never copies K/V per query head: decodes fold the query heads sharing a KV
head into the query axis, prefills use SDPA's `enable_gqa`.
Attention runs in the activation dtype (CPU and CUDA SDPA kernels accumulate
half precision in float32).

FP8 KV cache: the write stores k / k_scale (v / v_scale) in fp8; reads convert the fp8 blocks to
the activation dtype and fold the scales into the softmax scale (K) and the output (V). Fresh
prefills attend over their new K/V rounded the same way, so every query sees the values the
cache holds, however the work was scheduled (as in the Triton backend, which reads the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import cpu_decode, cpu_rope_kv
from tokenmill.layers.attention.backend import FP8_KV_DTYPES, AttentionBackend, is_fp8, quantize_kv
from tokenmill.layers.attention.metadata import AttentionMetadata


# On CPU with the C kernel, chunks after cached context of at most this many tokens run as
# single-query attentions (see `_build_plan`).
_SHORT_CHUNK = 16


@dataclass
class _Chunk:
    """A prefill chunk that attends to cached context too."""

    seq: int
    start: int
    end: int
    seq_len: int
    num_blocks: int
    mask: torch.Tensor  # bool [q_len, seq_len - first_block * block_size]
    first_block: int = 0  # the first block any of its queries sees (sliding window)


@dataclass
class _StepPlan:
    num_tokens: int
    slots: torch.Tensor  # int64 [num_tokens]: where each real token's K/V goes
    valid_rows: torch.Tensor | None  # rows whose slot is not -1, when some are; None: all of [:num_tokens]
    # Fresh prefills grouped by length: (q_len, first row, number of seqs) for runs that sit
    # back to back in the flat batch, or (q_len, row index [B * q_len], B) otherwise.
    fresh: list[tuple[int, int | torch.Tensor, int]] = field(default_factory=list)
    all_fresh: bool = False  # one contiguous group covers every real token
    decode_rows: torch.Tensor | None = None  # int64 [S]; None when there are no decodes
    decode_contiguous: bool = False  # decode rows are exactly 0..S-1
    decode_blocks: torch.Tensor | None = None  # int64 [S * nb]: block ids to gather, row-major
    decode_mask: torch.Tensor | None = None  # bool [S, 1, 1, nb * block_size]
    decode_block_table: torch.Tensor | None = None  # int32 [S, nb], for the C kernel (CPU only)
    decode_seq_lens: torch.Tensor | None = None  # int32 [S], for the C kernel
    num_decodes: int = 0
    chunks: list[_Chunk] = field(default_factory=list)
    buffers: dict = field(default_factory=dict)  # gather buffers, shared by the step's layers


def _plan_for(meta: AttentionMetadata, block_size: int, window: int | None) -> _StepPlan:
    """The step's plan, built by its first layer of each window and kept on the metadata for the others."""
    key = ("torch_ref_plan", block_size, window)
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _build_plan(meta, block_size, window)
    return plan


def band_mask(q_len: int, seq_len: int, window: int | None, device: torch.device | str = "cpu",
              first_key: int = 0) -> torch.Tensor:
    """bool [q_len, seq_len - first_key]: the last q_len of seq_len positions (queries) against
    keys first_key..seq_len-1: causal, and within `window` (HF: key > query - window)."""
    q = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k = torch.arange(first_key, seq_len, device=device)[None, :]
    visible = k <= q
    if window is not None:
        visible &= k > q - window
    return visible


def _build_plan(meta: AttentionMetadata, block_size: int, window: int | None) -> _StepPlan:
    device = meta.slot_mapping.device
    qsl = meta.query_start_loc_cpu.tolist()
    # The reference backend needs exact lengths on the host: a sync under speculation on CUDA.
    seq_lens = (meta.seq_lens_cpu if meta.seq_lens_exact else meta.seq_lens.cpu()).tolist()
    n = qsl[-1] if qsl else 0
    slots = meta.slot_mapping[:n]
    valid_rows = None
    # On the host the check is free; on a GPU it would sync, so take the masked path there.
    if device.type != "cpu" or bool((slots < 0).any()):
        valid_rows = torch.nonzero(slots >= 0).squeeze(1)
        slots = slots[valid_rows]
    plan = _StepPlan(num_tokens=n, slots=slots, valid_rows=valid_rows)

    # Single-query attentions: each query row, its sequence, and how many keys it sees.
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    decode_lens: list[int] = []
    split_short_chunks = device.type == "cpu" and cpu_decode.available()
    fresh_by_len: dict[int, list[int]] = {}
    for i in range(len(seq_lens)):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        if q_len == 1:
            decode_rows.append(qsl[i])
            decode_seqs.append(i)
            decode_lens.append(seq_lens[i])
        elif seq_lens[i] == q_len:
            fresh_by_len.setdefault(q_len, []).append(i)
        elif split_short_chunks and q_len <= _SHORT_CHUNK and seq_lens[i] > q_len:
            # A short chunk after cached context (speculative verification: 1 + k tokens): each
            # query as a decode over the keys up to itself, in the C kernel, which reads K/V in
            # place; the result is the one plain decoding of that token would get. (Padding rows
            # of a verification graph have seq_len 0 < q_len: they stay chunks.)
            decode_rows.extend(range(qsl[i], qsl[i + 1]))
            decode_seqs.extend([i] * q_len)
            decode_lens.extend(range(seq_lens[i] - q_len + 1, seq_lens[i] + 1))
        else:
            seq_len = seq_lens[i]
            first_key = max(seq_len - q_len - window + 1, 0) if window is not None else 0
            first_block = first_key // block_size
            mask = band_mask(q_len, seq_len, window, device, first_block * block_size)
            plan.chunks.append(_Chunk(i, qsl[i], qsl[i + 1], seq_len, -(-seq_len // block_size), mask, first_block))

    for q_len, seqs in fresh_by_len.items():
        # Split into runs of sequences whose rows are back to back.
        run_start = 0
        for j in range(1, len(seqs) + 1):
            if j == len(seqs) or qsl[seqs[j]] != qsl[seqs[j - 1]] + q_len:
                run = seqs[run_start:j]
                plan.fresh.append((q_len, qsl[run[0]], len(run)))
                run_start = j
    if len(plan.fresh) > 2:
        # Many runs of one length (fresh prefills interleaved with other rows): gather them instead.
        merged: dict[int, list[tuple[int, int]]] = {}
        for q_len, first, count in plan.fresh:
            merged.setdefault(q_len, []).append((first, count))
        plan.fresh = []
        for q_len, runs in merged.items():
            if len(runs) == 1:
                plan.fresh.append((q_len, runs[0][0], runs[0][1]))
                continue
            rows = torch.cat([torch.arange(f, f + c * q_len) for f, c in runs]).to(device)
            plan.fresh.append((q_len, rows, sum(c for _, c in runs)))
    plan.all_fresh = (len(plan.fresh) == 1 and isinstance(plan.fresh[0][1], int)
                      and plan.fresh[0][1] == 0 and plan.fresh[0][0] * plan.fresh[0][2] == n)

    if decode_rows:
        s = len(decode_rows)
        plan.num_decodes = s
        plan.decode_contiguous = decode_rows == list(range(s))
        plan.decode_rows = torch.tensor(decode_rows, dtype=torch.int64).to(device)
        seq_idx = torch.tensor(decode_seqs, dtype=torch.int64).to(device)
        lens = torch.tensor(decode_lens, dtype=torch.int64).to(device)
        if device.type == "cpu" and cpu_decode.available():
            nb = -(-max(decode_lens) // block_size)
            plan.decode_block_table = meta.block_table[seq_idx, :nb].to(torch.int32).contiguous()
            plan.decode_seq_lens = lens.to(torch.int32)
        # The gather path reads each row's blocks from the first one its window reaches.
        starts = [max(n - window, 0) if window is not None else 0 for n in decode_lens]
        first = [a // block_size for a in starts]
        nb = max(-(-n // block_size) - f for n, f in zip(decode_lens, first))
        first_t = torch.tensor(first, dtype=torch.int64).to(device)
        # Columns past a row's last block repeat it (masked out): a row reads only its own blocks.
        last_t = torch.tensor([max(-(-n // block_size) - 1, 0) for n in decode_lens], dtype=torch.int64).to(device)
        columns = torch.minimum(first_t[:, None] + torch.arange(nb, device=device)[None, :], last_t[:, None])
        plan.decode_blocks = meta.block_table[seq_idx[:, None], columns].reshape(-1).long()
        keys = first_t[:, None] * block_size + torch.arange(nb * block_size, device=device)[None, :]
        visible = keys < lens[:, None]
        if window is not None:
            visible &= keys >= torch.tensor(starts, dtype=torch.int64).to(device)[:, None]
        plan.decode_mask = visible.view(s, 1, 1, nb * block_size)
    return plan


class TorchRefAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.group = num_heads // num_kv_heads

    def fuses_rope(self, rope, kv_cache: torch.Tensor) -> bool:
        """On CPU, rotary and the KV write run as one C pass (`cpu_rope_kv`) where it takes the cache."""
        return rope.cos is not None and cpu_rope_kv.supports(kv_cache, rope.rotary_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, rope=None) -> torch.Tensor:
        """`rope` (where `fuses_rope`): q and k are unrotated; the C pass rotates them in place and
        writes k and v into the cache (or, where it cannot take these tensors, torch does both)."""
        block_size = kv_cache.shape[2]
        plan = _plan_for(meta, block_size, self.sliding_window)
        n = plan.num_tokens
        fp8 = kv_cache.dtype in FP8_KV_DTYPES  # (asked once per layer call, not per helper)
        if rope is None or not cpu_rope_kv.rotate_and_write(q, k, v, rope.positions, rope.cos_cache, rope.sin_cache,
                                                            rope.rotary_dim, kv_cache, meta.slot_mapping, n):
            if rope is not None:
                q, k = rope.rotate(q), rope.rotate(k)
            _write(kv_cache, k, v, plan, self.k_scale, self.v_scale, fp8)
        if fp8 and plan.fresh:  # what the cache holds, for prefills that skip reading it
            k = quantize_kv(k, self.k_scale, kv_cache.dtype).to(k.dtype) * self.k_scale
            v = quantize_kv(v, self.v_scale, kv_cache.dtype).to(v.dtype) * self.v_scale
        if plan.all_fresh and q.shape[0] == n:
            q_len, _, count = plan.fresh[0]
            o = self._fresh(q, k, v, 0, q_len, count)
            return o.transpose(1, 2).reshape(n, self.num_heads, self.head_dim)
        if plan.decode_contiguous and plan.num_decodes == n == q.shape[0] and not fp8:
            return self._decode(q, kv_cache, plan, None, fp8)  # all decodes: their output is the output
        # Rows past the last sequence (padding for a fixed batch shape) stay zero.
        out = q.new_zeros(q.shape) if q.shape[0] > n else q.new_empty(q.shape)
        for q_len, first, count in plan.fresh:
            if isinstance(first, int):
                o = self._fresh(q, k, v, first, q_len, count)
                out[first:first + q_len * count].view(count, q_len, self.num_heads, self.head_dim).copy_(
                    o.transpose(1, 2))
            else:
                o = self._fresh(q[first], k[first], v[first], 0, q_len, count)
                out[first] = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        if plan.num_decodes:
            self._decode(q, kv_cache, plan, out, fp8)
        for c in plan.chunks:
            out[c.start:c.end] = self._chunk(q[c.start:c.end], kv_cache, meta.block_table[c.seq], c)
        return out

    def _fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, q_len: int,
               count: int) -> torch.Tensor:
        """`count` prefills of `q_len` tokens with no context, from row `first`: [B, H, L, D]."""
        end = first + q_len * count
        qb = q[first:end].view(count, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kb = k[first:end].view(count, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vb = v[first:end].view(count, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        window = self.sliding_window
        if not self._sdpa_ok():
            return self._attend(qb, kb, vb, band_mask(q_len, q_len, window, q.device))
        if window is None or q_len <= window:
            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale,
                                                  enable_gqa=self.group > 1)
        # A window shorter than the prompt: SDPA with the band mask, as HF's default attention
        # does (the eager path would round the scores to bf16 before the softmax: on CUDA tiny
        # Phi-3's prefill deviated 1.12x HF's bf16 mean that way, its decode 0.96x).
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=band_mask(q_len, q_len, window, q.device),
                                              scale=self.scale, enable_gqa=self.group > 1)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, out: torch.Tensor | None,
                fp8: bool) -> torch.Tensor | None:
        """The decode rows' attention into `out`; `out` None (every row a decode, in order): returned."""
        s = plan.num_decodes
        qd = q if out is None else q[:s] if plan.decode_contiguous else q[plan.decode_rows]
        if plan.decode_block_table is not None and not fp8 and cpu_decode.supports(qd, kv_cache):
            o = cpu_decode.decode_attention(qd, kv_cache, plan.decode_block_table, plan.decode_seq_lens,
                                            self.scale, self.sliding_window, self.logit_softcap, self.sinks)
            if out is None:
                return o
            if plan.decode_contiguous:
                out[:s] = o
            else:
                out[plan.decode_rows] = o
            return None
        blocks = plan.decode_blocks
        cache = _raw(kv_cache)
        key = (cache.dtype, cache.shape[2:])
        buf = plan.buffers.get(key)
        if buf is None:
            buf = cache.new_empty((2, blocks.shape[0]) + tuple(cache.shape[2:]))
            plan.buffers[key] = buf
        torch.index_select(cache, 1, blocks, out=buf)
        # [2, S * nb, bs, Hkv, D] -> [2, S, Hkv, L, D]
        kv = _cooked(buf, kv_cache.dtype, q.dtype).view(2, s, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        qd = qd.view(s, self.num_kv_heads, self.group, self.head_dim)
        if self._sdpa_ok():
            o = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=plan.decode_mask,
                                               scale=self._qk_scale(kv_cache))
        else:  # the group's query heads as queries of one KV head
            sinks = None if self.sinks is None else self.sinks.view(1, self.num_kv_heads, self.group, 1)
            o = self._attend(qd, self._k_scaled(kv[0], kv_cache), kv[1], plan.decode_mask, group=1, sinks=sinks)
        o = self._v_scaled(o.reshape(s, self.num_heads, self.head_dim), kv_cache)
        if out is None:
            return o
        if plan.decode_contiguous:
            out[:s] = o
        else:
            out[plan.decode_rows] = o
        return None

    def _chunk(self, q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, c: _Chunk) -> torch.Tensor:
        # [2, nb, bs, Hkv, D] -> [2, Hkv, keys, D], from the first block any query sees
        keys = c.seq_len - c.first_block * kv_cache.shape[2]
        kv = _raw(kv_cache)[:, block_ids[c.first_block:c.num_blocks].long()].flatten(1, 2)[:, :keys].transpose(1, 2)
        kv = _cooked(kv, kv_cache.dtype, q.dtype)
        qh = q.transpose(0, 1)  # [H, q_len, D]
        if not self._sdpa_ok():
            o = self._attend(qh[None], self._k_scaled(kv[0], kv_cache)[None], kv[1][None], c.mask)
            return self._v_scaled(o[0].transpose(0, 1), kv_cache)
        o = F.scaled_dot_product_attention(qh[None], kv[0][None], kv[1][None], attn_mask=c.mask,
                                           scale=self._qk_scale(kv_cache), enable_gqa=self.group > 1)
        return self._v_scaled(o[0].transpose(0, 1), kv_cache)

    def _sdpa_ok(self) -> bool:
        """SDPA computes this layer's attention (no soft-cap, no sinks)."""
        return self.logit_softcap is None and self.sinks is None

    def _qk_scale(self, kv_cache: torch.Tensor) -> float:
        return self.scale * self.k_scale if is_fp8(kv_cache) else self.scale

    def _v_scaled(self, o: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return o * self.v_scale if is_fp8(kv_cache) and self.v_scale != 1.0 else o

    def _k_scaled(self, k: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Keys read from an fp8 cache times k_scale (for the soft-capped path, which scales itself)."""
        return k * self.k_scale if is_fp8(kv_cache) and self.k_scale != 1.0 else k

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                group: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Eager attention with soft-capping (HF's order: scale, cap, mask, float32 softmax) and
        sinks: q [B, H, Lq, D], k/v [B, H / group, Lk, D], mask bool broadcastable to
        [B, H, Lq, Lk]; `sinks` broadcastable to [B, H, Lq, 1] (default: this layer's, per head)."""
        group = self.group if group is None else group
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.logit_softcap is not None:
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None and self.sinks is not None:
            sinks = self.sinks.view(1, -1, 1, 1)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:  # the sink is one more logit in the softmax, dropped before the values
            column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)
            probs = probs[..., :-1].to(q.dtype)
        return torch.matmul(probs, v)


def _raw(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as bytes where it is fp8 (CPU indexing kernels do not take fp8 tensors)."""
    return kv_cache.view(torch.uint8) if is_fp8(kv_cache) else kv_cache


def _cooked(raw: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache entries in the activation dtype (scales are applied by the caller)."""
    return raw.view(cache_dtype).to(dtype) if raw.dtype != cache_dtype else raw


def _write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _StepPlan, k_scale: float,
           v_scale: float, fp8: bool) -> None:
    flat = (kv_cache.view(torch.uint8) if fp8 else kv_cache).view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    n = plan.num_tokens
    if plan.valid_rows is None:
        k, v = k[:n], v[:n]
    else:
        k, v = k[plan.valid_rows], v[plan.valid_rows]
    if fp8:
        k, v = (quantize_kv(k, k_scale, kv_cache.dtype).view(torch.uint8),
                quantize_kv(v, v_scale, kv_cache.dtype).view(torch.uint8))
    flat[0].index_copy_(0, plan.slots, k.to(flat.dtype))
    flat[1].index_copy_(0, plan.slots, v.to(flat.dtype))

