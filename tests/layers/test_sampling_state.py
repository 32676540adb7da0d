"""Sampling state across steps: tokens recorded on the device, preemption, scratch rows, the plan,
lazy allocation, and the seed hash."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.sampling import DEVICES, Harness, reference_adjusted
from tokenmill.layers.sampling import seeded_noise
from tokenmill.sampling_params import SamplingParams

EVERYTHING = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=11, repetition_penalty=1.3,
                  frequency_penalty=0.4, presence_penalty=0.3, logit_bias={3: 1.0}, min_tokens=4,
                  stop_token_ids=[6], logprobs=3)


def step_logits(steps: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, vocab, generator=g) * 3 for _ in range(steps)]


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_use_the_tokens_recorded_on_the_device(device) -> None:
    """Each step's adjusted logits match the definitions over the tokens sampled so far, which the
    state never receives from the host: the sampler records them on the device."""
    vocab, eos = 16, [15]
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.4,
                             min_tokens=5, stop_token_ids=[2]),
              SamplingParams(temperature=0.0, frequency_penalty=-0.5, seed=3),
              SamplingParams(temperature=0.7, seed=5)]  # no penalties: its counts stay untouched
    prompts = [[1, 4, 4], [7], [8, 9]]
    h = Harness(device, vocab, max_slots=4, eos=eos)
    outputs: list[list[int]] = [[], [3], []]
    for slot, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        h.add(slot, p, prompt, out)
    torch.manual_seed(0)
    for logits in step_logits(12, vocab):
        batch = logits.expand(3, -1)
        adjusted = h.adjusted(batch, [0, 1, 2])
        for slot in range(3):
            expected = reference_adjusted(logits[0].tolist(), params[slot], prompts[slot], outputs[slot], eos)
            torch.testing.assert_close(adjusted[slot], torch.tensor(expected))
        for slot, token in enumerate(h.sample(batch, [0, 1, 2])):
            outputs[slot].append(token)
    assert h.state.counts.output_counts is not None
    assert h.state.counts.output_counts[2].sum().item() == 0
    assert len(set(outputs[0])) > 3  # it really sampled


def run_request(h: Harness, slot: int, logits: list[torch.Tensor], company: list[int] = ()) -> list[int]:
    """Sample one step per logits row with the request at `slot` and `company` slots beside it."""
    tokens = []
    for step in logits:
        order = [*company, slot]
        tokens.append(h.sample(step.expand(len(order), -1), order)[-1])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_reproducible_across_steps_batches_slots_and_prefill_chunks(device) -> None:
    vocab = 64
    logits = step_logits(10, vocab, seed=5)
    target = SamplingParams(**EVERYTHING)
    alone = Harness(device, vocab, max_slots=1, eos=[0])
    alone.add(0, target, prompt=[5, 6, 7])
    expected = run_request(alone, 0, logits)

    crowd = Harness(device, vocab, max_slots=8, eos=[0])
    crowd.add(1, SamplingParams(temperature=1.0, repetition_penalty=1.5))
    crowd.add(2, SamplingParams(temperature=0.0, logprobs=7))
    crowd.add(4, SamplingParams(temperature=0.8, seed=99, top_k=5))
    crowd.add(6, target, prompt=[5, 6, 7])
    torch.manual_seed(123)
    # Two steps where the request's row holds a prompt chunk: its sample is thrown away (scratch slot).
    for _ in range(2):
        crowd.sample(logits[0].expand(4, -1), [1, crowd.scratch, 2, 4])
    got = run_request(crowd, 6, logits, company=[4, crowd.scratch, 1, 2])
    assert got == expected
    other = Harness(device, vocab, max_slots=1, eos=[0])
    other.add(0, SamplingParams(**{**EVERYTHING, "seed": 12}), prompt=[5, 6, 7])
    assert run_request(other, 0, logits) != expected


@pytest.mark.parametrize("device", DEVICES)
def test_preempted_request_resumes_identically(device) -> None:
    """Removed after some steps and added back (at another slot) with the outputs it has, a request
    with a seed, penalties and min_tokens continues exactly as if it had never left."""
    vocab, half = 48, 6
    logits = step_logits(2 * half, vocab, seed=8)
    target = SamplingParams(**EVERYTHING)
    prompt = [9, 10, 11, 9]
    straight = Harness(device, vocab, max_slots=4, eos=[0])
    straight.add(0, target, prompt)
    expected = run_request(straight, 0, logits)

    h = Harness(device, vocab, max_slots=4, eos=[0])
    h.add(0, target, prompt)
    before = run_request(h, 0, logits[:half])
    h.remove(0)
    h.add(0, SamplingParams(temperature=1.0, frequency_penalty=1.0, seed=1))  # another request reuses the slot
    run_request(h, 0, logits[:3])
    h.add(2, target, prompt, outputs=before)
    after = run_request(h, 2, logits[half:], company=[0])
    assert before + after == expected


@pytest.mark.parametrize("device", DEVICES)
def test_scratch_rows_do_not_disturb_real_rows(device) -> None:
    vocab = 32
    g = torch.Generator().manual_seed(9)
    real = torch.randn(3, vocab, generator=g)
    requests = [SamplingParams(**EVERYTHING), SamplingParams(temperature=0.0, presence_penalty=0.5),
                SamplingParams(temperature=0.6, top_k=4, seed=2)]

    def harness() -> Harness:
        h = Harness(device, vocab, max_slots=3, eos=[0])
        for slot, p in enumerate(requests):
            h.add(slot, p, prompt=[1, 2, 3])
        return h

    clean = harness()
    expected = [clean.sample(real, [0, 1, 2]) for _ in range(3)]
    padded = harness()
    garbage = torch.randn(4, vocab, generator=g) * 1e4
    garbage[1] = 0.0
    s = padded.scratch
    for step in range(3):
        logits = torch.cat([garbage[:2], real[:1], garbage[2:3], real[1:], garbage[3:]])
        out = padded.run(logits, [s, s, 0, s, 1, 2, s])
        ids = out.sampled.tolist()
        assert [ids[2], ids[4], ids[5]] == expected[step]
        assert all(0 <= t < vocab for t in ids)
        assert torch.isfinite(out.logprobs.sampled_logprobs).all()


@pytest.mark.parametrize("device", DEVICES)
def test_plan_follows_add_and_remove(device) -> None:
    h = Harness(device, 100)
    h.add(0, SamplingParams(temperature=0))
    assert h.state.plan.plain_greedy
    h.add(1, SamplingParams(**EVERYTHING))
    h.add(2, SamplingParams(top_k=50, logprobs=5))
    plan = h.state.plan
    assert plan.any_greedy and plan.any_random and plan.top_k == 50 and plan.top_p and plan.min_p
    assert plan.seeded and plan.unseeded and plan.logit_bias and plan.min_tokens and plan.penalties
    assert plan.logprobs == 5
    h.remove(2)
    assert h.state.plan.top_k == 20 and h.state.plan.logprobs == 3 and not h.state.plan.unseeded
    h.remove(1)
    assert h.state.plan.plain_greedy and h.state.plan.logprobs is None
    # Reaching min_tokens already at add time needs no ban; top_k >= V is off.
    h.add(1, SamplingParams(min_tokens=2, top_k=100), outputs=[4, 5])
    assert not h.state.plan.min_tokens and h.state.plan.top_k == 0


@pytest.mark.parametrize("device", DEVICES)
def test_state_is_allocated_lazily_and_grows(device) -> None:
    h = Harness(device, 10, max_slots=4)
    h.add(0, SamplingParams(temperature=0.5, logit_bias={1: 1.0, 2: 2.0}))
    h.state.flush()
    counts, lists = h.state.counts, h.state.logit_bias
    assert counts.output_counts is None and counts.prompt_seen is None and h.state.banned.ids is None
    assert lists.width == 2
    h.add(1, SamplingParams(frequency_penalty=0.5, logit_bias={t: float(t) for t in range(5)}))
    h.state.flush()
    assert counts.output_counts is not None and counts.prompt_seen is None and lists.width == 8
    h.add(2, SamplingParams(repetition_penalty=1.2), prompt=[3])
    h.state.flush()
    assert counts.prompt_seen is not None
    out = h.adjusted(torch.zeros(3, 10), [0, 1, 2])
    assert out[0].tolist() == [0.0, 1.0, 2.0] + [0.0] * 7  # written before the width grew
    assert out[1].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] + [0.0] * 5


def test_mix32_matches_the_host_reference() -> None:
    rng = random.Random(1)
    xs = [0, 1, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(1000)]
    got = seeded_noise.mix32_(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [seeded_noise.mix32_int(x) for x in xs]
    assert len(set(got)) == len(set(xs))  # a bijection


def test_seeded_noise_is_the_documented_function() -> None:
    """E(seed, position, token), written out with Python ints, equals the device construction."""
    mix, m32 = seeded_noise.mix32_int, seeded_noise.MASK32
    seeds, positions, vocab = [0, 7, 2**63 - 1], [0, 5, 4096], 50
    keys = torch.tensor([seeded_noise.seed_key(s) for s in seeds])
    rows = seeded_noise.row_keys(keys, torch.tensor(positions))
    noise = seeded_noise.seeded_exponential(rows, seeded_noise.token_keys(vocab, torch.device("cpu")))
    for i, (seed, pos) in enumerate(zip(seeds, positions)):
        key = mix(mix((seed >> 32) ^ seeded_noise.SEED_SALT) ^ (seed & m32))
        row = mix((key + pos * seeded_noise.POSITION_MULT) & m32)
        for t in range(vocab):
            h = mix(row ^ mix((t + seeded_noise.TOKEN_SALT) & m32))
            u = ((h >> 9) + 0.5) / 2**23
            assert noise[i, t].item() == pytest.approx(-torch.tensor(u).log().item(), rel=1e-6)


def test_seeded_noise_is_exponential_and_uncorrelated() -> None:
    keys = torch.tensor([seeded_noise.seed_key(s) for s in range(64)])
    positions = torch.arange(64)
    noise = seeded_noise.seeded_exponential(seeded_noise.row_keys(keys, positions),
                                            seeded_noise.token_keys(4096, torch.device("cpu"))).double()
    assert (noise > 0).all()
    n = noise.numel()
    assert abs(noise.mean().item() - 1.0) < 5 / n ** 0.5 and abs(noise.var().item() - 1.0) < 10 / n ** 0.5
    # Neighbouring tokens, rows (seeds) and positions of one seed are uncorrelated.
    centered = noise - 1.0
    assert abs((centered[:, 1:] * centered[:, :-1]).mean().item()) < 5 / n ** 0.5
    assert abs((centered[1:] * centered[:-1]).mean().item()) < 5 / n ** 0.5
    one_seed = seeded_noise.seeded_exponential(
        seeded_noise.row_keys(torch.full((64,), seeded_noise.seed_key(3)), positions),
        seeded_noise.token_keys(4096, torch.device("cpu"))).double() - 1.0
    assert abs((one_seed[1:] * one_seed[:-1]).mean().item()) < 5 / n ** 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_one_seeded_request_follows_the_distribution_over_its_positions(device) -> None:
    probs = [0.1, 0.4, 0.2, 0.3]
    steps = 4000
    h = Harness(device, 4, max_slots=1)
    h.add(0, SamplingParams(seed=2024))
    logits = torch.tensor([probs]).log()
    tokens = [h.sample(logits, [0])[0] for _ in range(steps)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / steps
    assert (freq - torch.tensor(probs, dtype=torch.float64)).abs().max() < 0.04  # 5 sigma at 4000 draws
