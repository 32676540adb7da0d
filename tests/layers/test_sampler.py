"""Sampler semantics on crafted logits: greedy, seeding, distribution, filters, adjustments, logprobs.

Requests live in slots of a SamplingState; each test points the rows of a step at slots.
State across steps (recording, preemption, scratch rows, the plan) is in test_sampling_state.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.sampling import DEVICES, Harness, reference_adjusted
from tokenmill.sampling_params import SamplingParams

NUM_DRAWS = 20_000
# Frequencies of NUM_DRAWS draws: std <= 0.0036, so 0.02 is > 5 sigma; draws are seeded anyway.
FREQ_TOL = 0.02
INF = float("inf")

pytestmark = pytest.mark.parametrize("device", DEVICES)


def frequencies(device: str, probs: list[float], seed: int = 0, neighbour: SamplingParams | None = None,
                **params) -> torch.Tensor:
    """NUM_DRAWS rows of logits log(probs), all pointing at one slot with `params`; token frequencies.
    `neighbour`: another active slot, with no row in the step, that turns on the stages it uses."""
    h = Harness(device, len(probs))
    h.add(0, SamplingParams(**params))
    if neighbour is not None:
        h.add(1, neighbour)
    torch.manual_seed(seed)
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    ids = h.run(torch.tensor(probs).log().expand(NUM_DRAWS, -1), [0] * NUM_DRAWS, record=False).sampled
    return torch.bincount(ids.cpu(), minlength=len(probs)).double() / NUM_DRAWS


def assert_distribution(freq: torch.Tensor, expected: list[float], tol: float = FREQ_TOL) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    assert torch.equal(freq > 0, exp > 0), f"support {freq.tolist()} vs {expected}"
    assert (freq - exp).abs().max() < tol, f"{freq.tolist()} vs {expected}"


def normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_ties_to_lowest_id(device, dtype) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0], [7.0, 7.0, 7.0, 7.0]], dtype=dtype)
    h = Harness(device, 4)
    for slot in range(3):
        h.add(slot, SamplingParams(temperature=0.0))
    assert h.sample(logits, [0, 1, 2]) == [1, 2, 0]
    h.add(3, SamplingParams(temperature=0.0, logit_bias={3: 0.0}))  # the adjusted (float32 copy) path
    assert h.sample(logits, [3, 1, 2]) == [1, 2, 0]


def test_greedy_below_eps_batch_is_one_argmax(device) -> None:
    h = Harness(device, 8)
    h.add(0, SamplingParams(temperature=1e-6, top_k=2, top_p=0.5, min_p=0.1, seed=3))
    h.add(1, SamplingParams(temperature=0))
    assert h.state.plan.plain_greedy and not h.state.plan.seeded and h.state.plan.top_k == 0
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    out = h.run(logits, [0, 1, h.scratch])
    assert out.logprobs is None
    assert out.sampled.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_in_mixed_batch_stay_greedy(device) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    h = Harness(device, 50)
    for slot in range(6):
        h.add(slot, SamplingParams(temperature=0.0 if slot % 2 else 1.0, top_p=0.9, seed=slot if slot > 3 else None))
    out = h.sample(logits, range(6))
    assert out[1::2] == logits[1::2].argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_logits_untouched(device, dtype) -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    before = logits.clone()
    h = Harness(device, 10, eos=[9])
    h.add(0, SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.5, seed=4,
                            logit_bias={1: 5.0}, min_tokens=3, logprobs=2), prompt=[1, 2])
    h.add(1, SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5), outputs=[3])
    h.add(2, SamplingParams(temperature=1.2))
    h.run(logits, [0, 1, 2])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeding (more in test_sampling_state.py)

def test_seeded_row_reproducible_alone_and_in_any_batch(device) -> None:
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    alone = Harness(device, vocab, max_slots=1)
    alone.add(0, target)
    expected = alone.sample(logits, [0], record=False)[0]

    crowd = Harness(device, vocab, max_slots=16)
    crowd.add(0, SamplingParams(temperature=1.0))
    crowd.add(3, SamplingParams(temperature=0.0))
    crowd.add(7, SamplingParams(temperature=0.8, seed=99, top_k=5))
    crowd.add(11, target)
    crowd.add(2, SamplingParams(temperature=1.3, min_p=0.05, presence_penalty=0.5))
    torch.manual_seed(777)  # the global generator must not matter
    for order in ([0, 3, 7, 11, 2], [11], [crowd.scratch, 11, 7, 7, 0], [2, 2, 11, 11]):
        out = crowd.sample(logits.expand(len(order), -1), order, record=False)
        assert all(t == expected for t, s in zip(out, order) if s == 11), (order, out, expected)


def test_unseeded_rows_vary_and_follow_the_global_seed(device) -> None:
    h = Harness(device, 1000)
    for slot in range(4):
        h.add(slot, SamplingParams())
    logits = torch.zeros(4, 1000)

    def draw() -> list[int]:
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.manual_seed(0)
        return h.sample(logits, range(4), record=False)

    a, b = draw(), draw()
    assert a == b and len(set(a)) > 1


# ---------------------------------------------------------------- distribution and filters

PROBS = [0.1, 0.4, 0.2, 0.3]  # sorted by probability: ids 1, 3, 2, 0


@pytest.mark.parametrize("neighbour", [None, SamplingParams(seed=5), SamplingParams(temperature=0, top_p=0.5)])
def test_plain_sampling_matches_probs(device, neighbour: SamplingParams | None) -> None:
    """Also when a seeded slot is active: unseeded rows keep drawing from torch's generator."""
    assert_distribution(frequencies(device, PROBS, neighbour=neighbour), PROBS)


def test_seeded_sampling_matches_probs(device) -> None:
    """NUM_DRAWS requests with different seeds, each at output position 0."""
    h = Harness(device, len(PROBS), max_slots=NUM_DRAWS)
    for slot in range(NUM_DRAWS):
        h.add(slot, SamplingParams(seed=slot * 7919 + 13))
    ids = h.run(torch.tensor(PROBS).log().expand(NUM_DRAWS, -1), range(NUM_DRAWS), record=False).sampled
    assert_distribution(torch.bincount(ids.cpu(), minlength=4).double() / NUM_DRAWS, PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_distribution(device, temperature: float) -> None:
    expected = normalized([p ** (1 / temperature) for p in PROBS])
    assert_distribution(frequencies(device, PROBS, temperature=temperature), expected)


@pytest.mark.parametrize("top_k, keep", [(1, [1]), (2, [1, 3]), (3, [1, 3, 2]), (4, [0, 1, 2, 3]),
                                         (9, [0, 1, 2, 3])])
def test_top_k_support(device, top_k: int, keep: list[int]) -> None:
    expected = normalized([p if i in keep else 0.0 for i, p in enumerate(PROBS)])
    assert_distribution(frequencies(device, PROBS, top_k=top_k), expected)


@pytest.mark.parametrize("top_p, keep", [(1e-9, [1]), (0.05, [1]), (0.39, [1]), (0.65, [1, 3]),
                                         (0.75, [1, 3, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_support(device, top_p: float, keep: list[int]) -> None:
    expected = normalized([p if i in keep else 0.0 for i, p in enumerate(PROBS)])
    assert_distribution(frequencies(device, PROBS, top_p=top_p), expected)


def test_top_p_applies_to_top_k_renormalized(device) -> None:
    # After top-k=3 the mass is {0.44, 0.33, 0.22}: the top two reach 0.75 (raw mass: only 0.7).
    assert_distribution(frequencies(device, PROBS, top_k=3, top_p=0.75), normalized([0.0, 0.4, 0.0, 0.3]))


def test_top_p_with_temperature_uses_scaled_probs(device) -> None:
    # At temperature 0.5 probs become {1:16, 3:9, 2:4, 0:1}/30: top two hold 0.833 >= 0.8.
    assert_distribution(frequencies(device, PROBS, temperature=0.5, top_p=0.8), normalized([0.0, 16.0, 0.0, 9.0]))


@pytest.mark.parametrize("min_p, keep", [(0.2, [0, 1, 2, 3]), (0.3, [1, 2, 3]), (0.6, [1, 3]), (0.9, [1])])
def test_min_p_support(device, min_p: float, keep: list[int]) -> None:
    expected = normalized([p if i in keep else 0.0 for i, p in enumerate(PROBS)])
    assert_distribution(frequencies(device, PROBS, min_p=min_p), expected)


@pytest.mark.parametrize("second", [SamplingParams(), SamplingParams(top_p=0.65), SamplingParams(min_p=0.6)])
def test_filters_are_per_row_in_a_mixed_batch(device, second: SamplingParams) -> None:
    # The top-k-only path (no top_p active), the sort path, and min-p, each with rows that have it off.
    n = NUM_DRAWS // 4
    h = Harness(device, 4)
    for slot, params in enumerate([SamplingParams(top_k=1), SamplingParams(), second, SamplingParams(top_k=2)]):
        h.add(slot, params)
    torch.manual_seed(0)
    ids = h.run(torch.tensor(PROBS).log().expand(4 * n, -1), [s for s in range(4) for _ in range(n)],
                record=False).sampled.cpu().view(4, n)
    assert set(ids[0].tolist()) == {1}
    assert set(ids[1].tolist()) == {0, 1, 2, 3}
    assert set(ids[2].tolist()) == ({0, 1, 2, 3} if second == SamplingParams() else {1, 3})
    assert set(ids[3].tolist()) == {1, 3}


# ---------------------------------------------------------------- logit adjustments

def test_logit_bias_added(device) -> None:
    h = Harness(device, 5)
    h.add(0, SamplingParams(logit_bias={0: 1.5, 4: -100.0}))
    h.add(1, SamplingParams())
    out = h.adjusted(torch.zeros(2, 5), [0, 1])
    assert out[0].tolist() == [1.5, 0.0, 0.0, 0.0, -100.0] and out[1].tolist() == [0.0] * 5
    h.add(2, SamplingParams(temperature=0, logit_bias={3: 2.0}))  # a strong bias steers greedy sampling
    assert h.sample(torch.zeros(1, 5), [2]) == [3]


def test_repetition_penalty_hf_definition(device) -> None:
    h = Harness(device, 6)
    h.add(0, SamplingParams(repetition_penalty=2.0), prompt=[0, 1], outputs=[3, 5])
    out = h.adjusted(torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 0.0]]), [0])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -4.0, 1.0, 0.0]


def test_frequency_and_presence_penalties_openai_definition(device) -> None:
    h = Harness(device, 4)
    h.add(0, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3, 3, 3], outputs=[0, 0, 0, 2])
    out = h.adjusted(torch.ones(1, 4), [0])
    # Prompt tokens do not count; output counts: token 0 x3, token 2 x1.
    torch.testing.assert_close(out[0], torch.tensor([1.0 - 1.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0]))


def test_penalties_only_touch_their_rows_and_compose_in_order(device) -> None:
    logits = torch.tensor([[3.0, -1.0, 0.5], [3.0, -1.0, 0.5]])
    h = Harness(device, 3)
    h.add(0, SamplingParams(logit_bias={1: 2.0}, repetition_penalty=1.5, frequency_penalty=1.0),
          prompt=[1], outputs=[0])
    h.add(1, SamplingParams(), prompt=[0, 1, 2], outputs=[0, 1, 2])
    out = h.adjusted(logits, [0, 1])
    # Row 0: bias makes token 1 -> 1.0, then repetition /1.5; token 0: 3/1.5 - 1 (frequency).
    torch.testing.assert_close(out[0], torch.tensor([3.0 / 1.5 - 1.0, 1.0 / 1.5, 0.5]))
    torch.testing.assert_close(out[1], logits[1])


def test_adjustments_match_their_definitions_on_random_requests(device) -> None:
    rng = random.Random(0)
    vocab, eos = 12, [11]
    h = Harness(device, vocab, max_slots=24, eos=eos)
    cases = []
    for slot in range(24):
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]), repetition_penalty=rng.choice([1.0, 0.7, 1.8]),
            frequency_penalty=rng.choice([0.0, 0.4, -0.3]), presence_penalty=rng.choice([0.0, 1.1, -0.5]),
            logit_bias=rng.choice([None, {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}]),
            min_tokens=rng.choice([0, 2, 5]), stop_token_ids=rng.choice([None, [3], [4, 5]]))
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        outputs = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        h.add(slot, params, prompt, outputs)
        cases.append((params, prompt, outputs))
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(7))
    order = list(range(24))
    rng.shuffle(order)
    out = h.adjusted(logits[order], order)
    for row, slot in enumerate(order):
        expected = reference_adjusted(logits[slot].tolist(), *cases[slot], eos)
        torch.testing.assert_close(out[row], torch.tensor(expected), msg=f"slot {slot}: {cases[slot]}")


def test_min_tokens_masks_eos_and_stop_ids_until_reached(device) -> None:
    h = Harness(device, 6, eos=(5, 2))
    h.add(0, SamplingParams(min_tokens=2, stop_token_ids=[4]), outputs=[1])
    h.add(1, SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True))  # EOS stays banned
    h.add(2, SamplingParams(min_tokens=2, stop_token_ids=[4]), outputs=[1, 1])
    out = h.adjusted(torch.zeros(3, 6), [0, 1, 2])
    assert out[0].tolist() == [0.0, 0.0, -INF, 0.0, -INF, -INF]
    assert out[1].tolist() == [0.0, 0.0, -INF, 0.0, -INF, -INF]
    assert out[2].tolist() == [0.0] * 6  # min_tokens reached
    # EOS is the argmax but may not be sampled until the count, kept on the device, reaches min_tokens.
    h.add(3, SamplingParams(temperature=0, min_tokens=2))
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0]])
    assert h.sample(eos_first, [3]) == [1]
    assert h.sample(eos_first, [3]) == [1]
    assert h.sample(eos_first, [3]) == [5]


# ---------------------------------------------------------------- logprobs

def test_logprobs_from_raw_logits_with_ranks(device) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(torch.bfloat16)
    h = Harness(device, 30)
    h.add(0, SamplingParams(temperature=0.0, logprobs=2))
    h.add(1, SamplingParams(temperature=2.0, logprobs=5, repetition_penalty=3.0, logit_bias={7: 50.0}),
          prompt=[1, 2])
    h.add(2, SamplingParams(temperature=0.5, top_k=3))
    h.add(3, SamplingParams(temperature=0.0, logprobs=0, logit_bias={9: 100.0}))
    torch.manual_seed(0)
    out = h.run(logits, [0, 1, 2, 3])
    lp = out.logprobs
    assert lp is not None
    ref = torch.log_softmax(logits.float(), dim=-1)
    ids = out.sampled.cpu()
    assert ids[1].item() == 7 and ids[3].item() == 9  # the bias dominates sampling, not logprobs
    torch.testing.assert_close(lp.sampled_logprobs.cpu(), ref.gather(1, ids[:, None]).squeeze(1))
    assert lp.sampled_ranks.tolist() == [int((ref[i] > ref[i, ids[i]]).sum()) + 1 for i in range(4)]
    assert lp.sampled_ranks[0].item() == 1
    assert lp.topk_token_ids.shape == (4, 5) and lp.topk_logprobs.dtype == torch.float32
    torch.testing.assert_close(lp.topk_logprobs.cpu(), ref.sort(dim=-1, descending=True).values[:, :5])
    torch.testing.assert_close(ref.gather(1, lp.topk_token_ids.cpu()), lp.topk_logprobs.cpu())


def test_logprobs_zero_gives_sampled_only(device) -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(4))
    h = Harness(device, 10)
    h.add(0, SamplingParams(temperature=0.0, logprobs=0))
    h.add(1, SamplingParams(temperature=0.0))
    lp = h.run(logits, [0, 1]).logprobs
    assert lp is not None and lp.topk_token_ids.shape == (2, 0)
    assert lp.sampled_ranks.tolist() == [1, 1]
