"""The sampler's speculative-decoding surface: position offsets, advance, probs, draw, uniforms and
the noise streams, against definitions written in the test or the plain path's own results."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import kstest

from tests.helpers.sampling import DEVICES, Harness, reference_adjusted
from tests.helpers.spec import reference_probs
from tokenmill.layers.sampling import seeded_noise
from tokenmill.layers.sampling.seeded_noise import NoiseStream
from tokenmill.layers.sampling.slot_table import IntCol
from tokenmill.sampling_params import SamplingParams

VOCAB = 32
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=5)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def num_outputs(h: Harness, slot: int) -> int:
    h.state.flush()
    return int(h.state.table.ints[slot, IntCol.NUM_OUTPUTS])


# ---------------------------------------------------------------- offsets and advance

@pytest.mark.parametrize("device", DEVICES)
def test_an_offset_row_samples_as_the_later_position_would(device) -> None:
    """Row i at offset j of a slot with n outputs samples exactly what a slot with n + j outputs
    samples at offset 0 (seeded noise), and bans EOS while n + j < min_tokens."""
    n, offsets = 3, list(range(8))
    logits = random_logits(len(offsets), seed=1)
    h = Harness(device, VOCAB, max_slots=2, eos=[0])
    h.add(0, SEEDED, outputs=[1] * n)
    h.add(1, SamplingParams(temperature=0.0, min_tokens=6), outputs=[1] * n)
    got = h.sampler.sample(logits.to(device), h.slots([0] * len(offsets)), offsets=h.slots(offsets),
                           record=False).sampled.tolist()
    for j in offsets:
        later = Harness(device, VOCAB, max_slots=1)
        later.add(0, SEEDED, outputs=[1] * (n + j))
        assert got[j] == later.sample(logits[j:j + 1], [0], record=False)[0], f"offset {j}"
    assert len(set(got)) > 3  # the positions really differ
    eos_first = torch.zeros(len(offsets), VOCAB)
    eos_first[:, 0], eos_first[:, 5] = 9.0, 1.0
    banned = h.sampler.sample(eos_first.to(device), h.slots([1] * len(offsets)), offsets=h.slots(offsets),
                              record=False).sampled.tolist()
    assert banned == [5 if n + j < 6 else 0 for j in offsets]


@pytest.mark.parametrize("device", DEVICES)
def test_zero_offsets_equal_the_plain_path(device) -> None:
    h = Harness(device, VOCAB, max_slots=4, eos=[0])
    for slot, p in enumerate([SEEDED, SamplingParams(), SamplingParams(temperature=0.0, min_tokens=3),
                              SamplingParams(min_p=0.1, seed=9, logprobs=2)]):
        h.add(slot, p, outputs=[2] * slot)
    logits, order = random_logits(6, seed=2), [3, 0, 1, 2, 0, 3]
    torch.manual_seed(0)
    plain = h.run(logits, order, record=False)
    torch.manual_seed(0)
    zero = h.sampler.sample(logits.to(device), h.slots(order), offsets=torch.zeros(6, dtype=torch.int64, device=device),
                            record=False)
    assert torch.equal(plain.sampled, zero.sampled)
    assert torch.equal(plain.logprobs.sampled_logprobs, zero.logprobs.sampled_logprobs)


def test_recording_rows_with_offsets_is_refused() -> None:
    h = Harness("cpu", VOCAB)
    h.add(0, SEEDED)
    with pytest.raises(AssertionError, match="advance"):
        h.sampler.sample(random_logits(1), h.slots([0]), offsets=h.slots([1]))


@pytest.mark.parametrize("device", DEVICES)
def test_advance_moves_each_slot_past_its_emitted_tokens(device) -> None:
    """Output counts grow by num_emitted (seeds and min_tokens read them), and penalty slots count
    the emitted tokens, so the next step equals that of a request added with those outputs."""
    penalized = SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4)
    h = Harness(device, VOCAB, max_slots=3, eos=[0])
    h.add(0, SEEDED)
    h.add(1, penalized, prompt=[4])
    h.add(2, SamplingParams(temperature=0.0, min_tokens=4))
    slots = h.slots([0, 1, 2])
    emitted = torch.tensor([[7, 8, 9, -1, -1], [3, 3, 5, 6, 12], [1, -1, -1, -1, -1]], device=device)  # 12: past n
    num_emitted = torch.tensor([3, 4, 1], device=device)
    with pytest.raises(AssertionError, match="penalties"):
        h.sampler.advance(slots, num_emitted)  # penalty slots need the tokens
    h.sampler.advance(slots, num_emitted, emitted)
    h.sampler.advance(slots[2:], torch.tensor([2], device=device), torch.tensor([[5, 5]], device=device))
    assert [num_outputs(h, s) for s in range(3)] == [3, 4, 1 + 2]
    eos_first = torch.zeros(2, VOCAB)
    eos_first[:, 0], eos_first[:, 5] = 9.0, 1.0  # min_tokens = 4 after 3 outputs: banned at offset 0 only
    assert h.sampler.sample(eos_first.to(device), h.slots([2, 2]), offsets=h.slots([0, 1]),
                            record=False).sampled.tolist() == [5, 0]
    logits = random_logits(3, seed=3)
    expected = reference_adjusted(logits[1].tolist(), penalized, [4], [3, 3, 5, 6], [0])
    torch.testing.assert_close(h.adjusted(logits, [0, 1, 2])[1], torch.tensor(expected))
    resumed = Harness(device, VOCAB, max_slots=1)
    resumed.add(0, SEEDED, outputs=[7, 8, 9])
    assert h.sample(logits[:1], [0], record=False) == resumed.sample(logits[:1], [0], record=False)


# ---------------------------------------------------------------- probs, draw, uniforms

PROBS_CASES = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
               SamplingParams(top_k=5, temperature=1.3), SamplingParams(top_p=0.7), SamplingParams(min_p=0.1, seed=2),
               SamplingParams(top_k=10, top_p=0.9, min_p=0.05, temperature=0.8),
               SamplingParams(temperature=0.9, logit_bias={3: 2.5, 4: -1.0}, min_tokens=2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", ["all", "greedy_only", "greedy_with_bias"])
def test_probs_are_the_distribution_sample_draws_from(device, mix) -> None:
    cases = {"all": PROBS_CASES, "greedy_only": PROBS_CASES[:1],
             "greedy_with_bias": [SamplingParams(temperature=0.0, logit_bias={7: 3.0})]}[mix]
    h = Harness(device, VOCAB, max_slots=len(cases), eos=[0])
    for slot, p in enumerate(cases):
        h.add(slot, p, outputs=[9])
    rows = 3 * len(cases)
    slots = [r % len(cases) for r in range(rows)]
    offsets = [r // len(cases) for r in range(rows)]  # min_tokens = 2 bans EOS at offset 0 only (one output)
    logits = random_logits(rows, seed=4)
    got = h.sampler.probs(logits.to(device), h.slots(slots), h.slots(offsets)).cpu()
    for r, (slot, j) in enumerate(zip(slots, offsets)):
        p = cases[slot]
        adjusted = torch.tensor(reference_adjusted(logits[r].tolist(), p, [], [9] * (1 + j), [0]))
        torch.testing.assert_close(got[r], reference_probs(adjusted[None], p)[0].float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_draw_from_probs_equals_sample_on_seeded_and_greedy_rows(device) -> None:
    """The MAIN stream of `draw` is the plain path's noise: drawing from `probs` is `sample`."""
    h = Harness(device, VOCAB, max_slots=4, eos=[0])
    for slot, p in enumerate([SEEDED, SamplingParams(temperature=0.0), SamplingParams(seed=8, min_p=0.05),
                              SamplingParams(seed=9, top_k=3, min_tokens=5)]):
        h.add(slot, p, outputs=[1] * slot)
    rows = 64
    slots, offsets = h.slots([r % 4 for r in range(rows)]), h.slots([r // 4 for r in range(rows)])
    logits = random_logits(rows, seed=5).to(device)
    sampled = h.sampler.sample(logits, slots, offsets=offsets, record=False).sampled
    drawn = h.sampler.draw(h.sampler.probs(logits, slots, offsets), slots, offsets)
    assert torch.equal(sampled, drawn)
    other = h.sampler.draw(h.sampler.probs(logits, slots, offsets), slots, offsets, NoiseStream.DRAFT)
    random_rows = (torch.arange(rows) % 4 != 1).to(device)
    assert (other != drawn)[random_rows].any() and torch.equal(other[~random_rows], drawn[~random_rows])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seeded", [False, True])
def test_draw_follows_unnormalized_weights(device, seeded) -> None:
    rows = 16_000
    weights = torch.tensor([0.2, 0.8, 0.0, 2.0, 1.0], device=device)  # sum 4
    h = Harness(device, 5, max_slots=rows if seeded else 1)
    for slot in range(rows if seeded else 1):
        h.add(slot, SamplingParams(seed=slot * 31 + 1 if seeded else None))
    slots = h.slots(range(rows)) if seeded else h.slots([0] * rows)
    torch.manual_seed(0)
    ids = h.sampler.draw(weights.expand(rows, -1), slots, stream=NoiseStream.RESIDUAL).cpu()
    freq = torch.bincount(ids, minlength=5).double() / rows
    assert (freq - torch.tensor([0.05, 0.2, 0.0, 0.5, 0.25], dtype=torch.float64)).abs().max() < 0.02  # > 5 sigma
    assert freq[2] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_uniforms_are_uniform_reproducible_and_distinct_per_stream(device) -> None:
    width = 4000
    h = Harness(device, VOCAB, max_slots=3)
    h.add(0, SamplingParams(seed=21))
    h.add(1, SamplingParams(seed=22))
    h.add(2, SamplingParams())
    offsets = torch.arange(width, device=device).expand(3, -1)
    tokens = torch.randint(VOCAB, (3, width), generator=torch.Generator().manual_seed(6)).to(device)
    u = h.sampler.uniforms(h.slots([0, 1, 2]), offsets, tokens).cpu().double()
    assert ((u > 0) & (u < 1)).all()
    for row in u:
        assert kstest(row.numpy(), "uniform").pvalue > 1e-3
    # A seeded row's uniforms do not depend on the batch; another stream gives other numbers.
    again = h.sampler.uniforms(h.slots([2, 0]), offsets[:2], tokens[[2, 0]]).cpu().double()
    assert torch.equal(again[1], u[0])
    residual = h.sampler.uniforms(h.slots([0]), offsets[:1], tokens[:1], NoiseStream.RESIDUAL).cpu().double()
    assert abs(torch.corrcoef(torch.stack([residual[0], u[0]]))[0, 1].item()) < 5 / width ** 0.5


def documented_noise(seed: int, position: int, token: int) -> float:
    """E(seed, position, token) of stream MAIN written out with Python ints, independently of the
    tensor code: seed -> key, (key, position) -> row key, row ^ token key -> 23-bit uniform -> -log."""
    mix, m32 = seeded_noise.mix32_int, seeded_noise.MASK32
    key = mix(mix((seed >> 32) ^ seeded_noise.SEED_SALT) ^ (seed & m32))
    row = mix((key + (position & m32) * seeded_noise.POSITION_MULT) & m32)
    h = mix(row ^ mix((token + seeded_noise.TOKEN_SALT) & m32))
    return -math.log(((h >> 9) + 0.5) / 2**23)


def test_streams_are_the_documented_positions() -> None:
    """Stream s at position p hashes like MAIN at p + s * 2**30; MAIN keys are unchanged."""
    keys = torch.tensor([seeded_noise.seed_key(s) for s in (0, 5, 2**62)])
    positions = torch.tensor([0, 17, 2**29])
    tokens = seeded_noise.token_keys(8, torch.device("cpu"))
    assert seeded_noise.stream_positions(positions, NoiseStream.MAIN) is positions
    for stream in NoiseStream:
        moved = seeded_noise.stream_positions(positions, stream)
        assert moved.tolist() == [p + stream * 2**30 for p in positions.tolist()]
        noise = seeded_noise.seeded_exponential(seeded_noise.row_keys(keys, moved), tokens)
        for i, (seed, pos) in enumerate(zip((0, 5, 2**62), positions.tolist())):
            want = [documented_noise(seed, pos + stream * 2**30, t) for t in range(8)]
            assert noise[i].tolist() == pytest.approx(want, rel=1e-6), (stream, seed, pos)
    # Per request, (position, stream) pairs below 2**30 never share a row key.
    p = torch.arange(0, 2**30, 2**30 // 4096)
    both = torch.cat([seeded_noise.row_keys(keys[1].expand(len(p)), seeded_noise.stream_positions(p, s))
                      for s in NoiseStream])
    assert len(torch.unique(both)) == len(both)
