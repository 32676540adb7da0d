"""TorchRefAttentionBackend against a naive per-sequence float64 reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.helpers.requirements import skip_or_fail
from tokenmill.layers.attention.backend import kv_cache_shape
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend

HEAD_DIM = 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    expected: torch.Tensor  # float64, [num_tokens, H, D]
    written: torch.Tensor  # bool [num_blocks * block_size]: slots holding this step's or earlier K/V


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Q, H, D] (the last Q positions), k, v: [L, Hkv, D] -> [Q, H, D], in float64. `window` W:
    a query at p sees keys p-W+1..p (HF's rule); `softcap` c: scores -> c * tanh(scores / c);
    `sinks` [H]: head h's softmax gets one more logit sinks[h], with no value (HF's gpt-oss)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = max(pos - window + 1, 0) if window is not None else 0
            scores = (kh[lo: pos + 1] @ q[j, h].double()) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is None:
                out[j, h] = torch.softmax(scores, 0) @ vh[lo: pos + 1]
            else:
                probs = torch.softmax(torch.cat([scores, sinks[h:h + 1].double()]), 0)[:-1]
                out[j, h] = probs @ vh[lo: pos + 1]
    return out


def make_case(contexts: list[int], q_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
              dtype: torch.dtype, device: str, pad_tokens: int = 0, seed: int = 0,
              head_dim: int = HEAD_DIM, window: int | None = None, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> Case:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks that no sequence owns
    # Fragmented, non-contiguous block ids.
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq) + 1
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g).to(dtype)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    qs, ks, vs, slots, expected = [], [], [], [], []
    scale = 1.0 / math.sqrt(head_dim)
    for i, (ctx, q_len) in enumerate(zip(contexts, q_lens)):
        ids = [perm.pop() for _ in range(blocks_per_seq[i])]
        block_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        seq_slots = torch.tensor([ids[p // block_size] * block_size + p % block_size for p in range(seq_lens[i])])
        k_all = torch.randn(seq_lens[i], num_kv_heads, head_dim, generator=g).to(dtype)
        v_all = torch.randn(seq_lens[i], num_kv_heads, head_dim, generator=g).to(dtype)
        q = torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype)
        flat[0, seq_slots[:ctx]] = k_all[:ctx]  # the context is already cached
        flat[1, seq_slots[:ctx]] = v_all[:ctx]
        written[seq_slots] = True
        qs.append(q), ks.append(k_all[ctx:]), vs.append(v_all[ctx:]), slots.append(seq_slots[ctx:])
        expected.append(reference(q, k_all, v_all, scale, window, softcap, sinks))
    # Padding rows: garbage q/k/v, slot -1, not part of any sequence.
    qs.append(torch.randn(pad_tokens, num_heads, head_dim, generator=g).to(dtype))
    ks.append(torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype))
    vs.append(torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype))
    slots.append(torch.full((pad_tokens,), -1))
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=sum(q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(device), seq_lens=seq_lens_t.to(device), block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).long().to(device), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens_t)
    return Case(torch.cat(qs).to(device), torch.cat(ks).to(device), torch.cat(vs).to(device),
                cache.to(device), meta, torch.cat(expected), written)


MIXES = {
    "decodes": ([5, 0, 40, 17], [1, 1, 1, 1]),
    "prefills": ([0, 0, 0], [7, 1 + 16, 33]),
    "chunked": ([16, 9, 31], [16, 5, 2]),
    "mixed": ([12, 0, 3, 20, 0], [1, 9, 1, 6, 1]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (4, 1)])
def test_matches_reference(device: str, mix: str, block_size: int, heads: tuple[int, int]) -> None:
    contexts, q_lens = MIXES[mix]
    case = make_case(contexts, q_lens, block_size, *heads, torch.float32, device, pad_tokens=3)
    before = case.kv_cache.clone()
    backend = TorchRefAttentionBackend(heads[0], heads[1], HEAD_DIM, 1.0 / math.sqrt(HEAD_DIM))
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta)
    n = case.meta.num_tokens
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out[:n].cpu().double(), case.expected, atol=1e-5, rtol=1e-5)
    assert not out[n:].any()
    # Padding slots wrote nothing: slots no sequence owns are untouched.
    flat_before = before.view(2, -1, heads[1], HEAD_DIM)[:, ~case.written.to(device)]
    flat_after = case.kv_cache.view(2, -1, heads[1], HEAD_DIM)[:, ~case.written.to(device)]
    assert torch.equal(flat_before, flat_after)


@pytest.mark.parametrize("device", DEVICES)
def test_writes_new_kv_to_slots(device: str) -> None:
    case = make_case([3, 0], [1, 4], 4, 4, 2, torch.float32, device)
    backend = TorchRefAttentionBackend(4, 2, HEAD_DIM, 0.3)
    backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta)
    flat = case.kv_cache.view(2, -1, 2, HEAD_DIM)
    torch.testing.assert_close(flat[0, case.meta.slot_mapping], case.k, rtol=0, atol=0)
    torch.testing.assert_close(flat[1, case.meta.slot_mapping], case.v, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16(device: str) -> None:
    contexts, q_lens = MIXES["mixed"]
    case = make_case(contexts, q_lens, 16, 6, 2, torch.bfloat16, device, pad_tokens=2, seed=1)
    backend = TorchRefAttentionBackend(6, 2, HEAD_DIM, 1.0 / math.sqrt(HEAD_DIM))
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta)
    assert out.dtype == torch.bfloat16
    n = case.meta.num_tokens
    # Inputs are exactly representable; only the final rounding to bf16 should show.
    torch.testing.assert_close(out[:n].cpu().double(), case.expected, atol=1e-2, rtol=1e-2)


def test_rejects_bad_gqa_ratio() -> None:
    with pytest.raises(ValueError):
        TorchRefAttentionBackend(6, 4, HEAD_DIM, 1.0)


def test_verification_chunk_equals_decoding_token_by_token_on_cpu() -> None:
    """On CPU (C kernel), a short chunk after cached context (speculative verification: 1 + k
    tokens) gets the same bits as decoding its tokens one step at a time."""
    from tokenmill.layers.attention import cpu_decode
    if not cpu_decode.available():
        skip_or_fail("the C decode-attention kernel is unavailable (no C compiler, a build error, "
                     "or TOKENMILL_NO_C_KERNELS set)")
    context, q_len = 37, 5
    case = make_case([context], [q_len], 16, 9, 3, torch.float32, "cpu", head_dim=64)
    backend = TorchRefAttentionBackend(9, 3, 64, 0.125)
    together = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta)
    for j in range(q_len):
        seq_len = torch.tensor([context + j + 1], dtype=torch.int32)
        one = torch.tensor([0, 1], dtype=torch.int32)
        meta = AttentionMetadata(num_tokens=1, max_query_len=1, max_seq_len=int(seq_len), query_start_loc=one,
                                 seq_lens=seq_len, block_table=case.meta.block_table,
                                 slot_mapping=case.meta.slot_mapping[j:j + 1], query_start_loc_cpu=one,
                                 seq_lens_cpu=seq_len)
        alone = backend.forward(case.q[j:j + 1], case.k[j:j + 1], case.v[j:j + 1], case.kv_cache, meta)
        assert torch.equal(alone[0], together[j])
