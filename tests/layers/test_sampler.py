"""Sampler on crafted logits: greedy, seeding, filters, temperature, penalties, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tokenmill.layers.penalties import apply_logit_adjustments
from tokenmill.layers.sampler import Sampler, SamplingMetadata, build_sampling_metadata
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
NUM_DRAWS = 20_000
# Frequencies of NUM_DRAWS draws: std <= 0.0036, so 0.02 is > 5 sigma; draws are seeded anyway.
FREQ_TOL = 0.02


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator(CPU).manual_seed(self.params.seed)


def meta_for(rows: list[Row], vocab_size: int, eos: tuple[int, ...] = ()) -> SamplingMetadata:
    return build_sampling_metadata(rows, vocab_size, eos, CPU)


def sample(logits: torch.Tensor, rows: list[Row], eos: tuple[int, ...] = ()) -> torch.Tensor:
    return Sampler()(logits, meta_for(rows, logits.shape[1], eos)).sampled_token_ids


def frequencies(probs: list[float], seed: int = 0, **params: float) -> torch.Tensor:
    """Draw NUM_DRAWS tokens from `probs` (as logits log p) with `params`; return frequencies."""
    torch.manual_seed(seed)
    logits = torch.tensor(probs).log().expand(NUM_DRAWS, -1)
    rows = [Row(SamplingParams(**params)) for _ in range(NUM_DRAWS)]
    ids = sample(logits, rows)
    return torch.bincount(ids, minlength=len(probs)).double() / NUM_DRAWS


def assert_distribution(freq: torch.Tensor, expected: list[float]) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    assert torch.equal(freq > 0, exp > 0), f"support {freq.tolist()} vs {expected}"
    assert (freq - exp).abs().max() < FREQ_TOL, f"{freq.tolist()} vs {expected}"


def normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


# Greedy

def test_greedy_argmax_ties_to_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0], [7.0, 7.0, 7.0, 7.0]])
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert sample(logits, rows).tolist() == [1, 2, 0]


def test_greedy_below_eps_and_batch_needs_nothing_else() -> None:
    rows = [Row(SamplingParams(temperature=1e-6, top_k=2, top_p=0.5, seed=3)), Row(SamplingParams(temperature=0))]
    meta = meta_for(rows, 8)
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.penalties is None and meta.logit_bias is None and meta.generators == ()
    assert meta.max_num_logprobs is None
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, meta)
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch_stay_greedy() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [Row(SamplingParams(temperature=0.0 if i % 2 else 1.0)) for i in range(6)]
    out = sample(logits, rows)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


def test_input_logits_untouched() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [Row(SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.5,
                               logit_bias={1: 5.0}), prompt_token_ids=[1, 2]),
            Row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output_token_ids=[3])]
    sample(logits, rows)
    assert torch.equal(logits, before)


# Seeding

def run_steps(logits_per_step: list[torch.Tensor], make_rows, target: int) -> list[int]:
    rows = make_rows()
    tokens = []
    for logits in logits_per_step:
        ids = sample(logits[: len(rows)], rows)
        tokens.append(int(ids[target]))
        for row, t in zip(rows, ids.tolist()):
            row.output_token_ids.append(t)
    return tokens


def test_seeded_row_reproducible_alone_and_in_any_batch() -> None:
    vocab, steps = 64, 8
    g = torch.Generator().manual_seed(5)
    step_logits = [torch.randn(1, vocab, generator=g) for _ in range(steps)]
    target = dict(temperature=0.9, top_p=0.95, seed=1234)

    def batch_logits(n: int) -> list[torch.Tensor]:
        return [l.expand(n, -1).contiguous() for l in step_logits]

    alone = run_steps(batch_logits(1), lambda: [Row(SamplingParams(**target))], 0)
    in_batch = run_steps(batch_logits(5), lambda: [
        Row(SamplingParams(temperature=1.0)),
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=0.8, seed=99, top_k=5)),
        Row(SamplingParams(**target)),
        Row(SamplingParams(temperature=1.3, min_p=0.05, presence_penalty=0.5)),
    ], 3)
    torch.manual_seed(777)  # the global generator must not matter either
    reordered = run_steps(batch_logits(3), lambda: [
        Row(SamplingParams(**target)), Row(SamplingParams(temperature=1.0, seed=1)),
        Row(SamplingParams(temperature=0.5))], 0)
    assert alone == in_batch == reordered
    other_seed = run_steps(batch_logits(1), lambda: [Row(SamplingParams(**{**target, "seed": 4321}))], 0)
    assert other_seed != alone


def test_unseeded_rows_follow_global_seed() -> None:
    logits = torch.zeros(4, 1000)
    rows = [Row(SamplingParams()) for _ in range(4)]
    torch.manual_seed(0)
    a = sample(logits, rows)
    torch.manual_seed(0)
    b = sample(logits, rows)
    assert torch.equal(a, b) and len(set(a.tolist())) > 1


# Distribution and filters

PROBS = [0.1, 0.4, 0.2, 0.3]  # sorted by probability: ids 1, 3, 2, 0


def test_plain_sampling_matches_probs() -> None:
    assert_distribution(frequencies(PROBS), PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_distribution(temperature: float) -> None:
    expected = normalized([p ** (1 / temperature) for p in PROBS])
    assert_distribution(frequencies(PROBS, temperature=temperature), expected)


@pytest.mark.parametrize("top_k, keep", [(1, [1]), (2, [1, 3]), (3, [1, 3, 2]), (4, [0, 1, 2, 3]),
                                         (9, [0, 1, 2, 3])])
def test_top_k_support(top_k: int, keep: list[int]) -> None:
    expected = normalized([p if i in keep else 0.0 for i, p in enumerate(PROBS)])
    assert_distribution(frequencies(PROBS, top_k=top_k), expected)


@pytest.mark.parametrize("top_p, keep", [(1e-9, [1]), (0.05, [1]), (0.39, [1]), (0.65, [1, 3]),
                                         (0.75, [1, 3, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_support(top_p: float, keep: list[int]) -> None:
    expected = normalized([p if i in keep else 0.0 for i, p in enumerate(PROBS)])
    assert_distribution(frequencies(PROBS, top_p=top_p), expected)


def test_top_p_applies_to_top_k_renormalized() -> None:
    # After top-k=3 the mass is {0.44, 0.33, 0.22}: the top two reach 0.75 (raw mass: only 0.7).
    expected = normalized([0.0, 0.4, 0.0, 0.3])
    assert_distribution(frequencies(PROBS, top_k=3, top_p=0.75), expected)


def test_top_p_with_temperature_uses_scaled_probs() -> None:
    # At temperature 0.5 probs become {1:16, 3:9, 2:4, 0:1}/30: top two hold 0.833 >= 0.8.
    expected = normalized([0.0, 16.0, 0.0, 9.0])
    assert_distribution(frequencies(PROBS, temperature=0.5, top_p=0.8), expected)


@pytest.mark.parametrize("min_p, keep", [(0.2, [0, 1, 2, 3]), (0.3, [1, 2, 3]), (0.6, [1, 3]), (0.9, [1])])
def test_min_p_support(min_p: float, keep: list[int]) -> None:
    expected = normalized([p if i in keep else 0.0 for i, p in enumerate(PROBS)])
    assert_distribution(frequencies(PROBS, min_p=min_p), expected)


def test_filters_are_per_row_in_a_mixed_batch() -> None:
    # Top-k-only path (no top_p in the batch) and sort path, each with rows that have it off.
    n = NUM_DRAWS // 4
    logits = torch.tensor(PROBS).log().expand(4 * n, -1)
    for second in (SamplingParams(), SamplingParams(top_p=0.65)):
        torch.manual_seed(0)
        rows = [Row(SamplingParams(top_k=1)) for _ in range(n)] + [Row(SamplingParams()) for _ in range(n)]
        rows += [Row(second) for _ in range(n)] + [Row(SamplingParams(top_k=2)) for _ in range(n)]
        ids = sample(logits, rows).view(4, n)
        assert set(ids[0].tolist()) == {1}
        assert set(ids[1].tolist()) == {0, 1, 2, 3}
        assert set(ids[2].tolist()) == ({0, 1, 2, 3} if second.top_p == 1.0 else {1, 3})
        assert set(ids[3].tolist()) == {1, 3}


# Logit adjustments

def adjusted(logits: torch.Tensor, rows: list[Row], eos: tuple[int, ...] = ()) -> torch.Tensor:
    return apply_logit_adjustments(logits.clone(), meta_for(rows, logits.shape[1], eos))


def test_logit_bias_added() -> None:
    logits = torch.zeros(2, 5)
    rows = [Row(SamplingParams(logit_bias={0: 1.5, 4: -100.0})), Row(SamplingParams())]
    out = adjusted(logits, rows)
    assert out[0].tolist() == [1.5, 0.0, 0.0, 0.0, -100.0] and out[1].tolist() == [0.0] * 5
    # A strong bias steers greedy sampling.
    assert sample(torch.zeros(1, 5), [Row(SamplingParams(temperature=0, logit_bias={3: 2.0}))]).item() == 3


def test_repetition_penalty_hf_definition() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 0.0]])
    row = Row(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[3, 5])
    out = adjusted(logits, [row])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -4.0, 1.0, 0.0]


def test_frequency_and_presence_penalties_openai_definition() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    row = Row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              prompt_token_ids=[3, 3, 3], output_token_ids=[0, 0, 0, 2])
    out = adjusted(logits, [row])
    # Prompt tokens do not count; output counts: token 0 x3, token 2 x1.
    expected = [1.0 - 1.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0]
    torch.testing.assert_close(out[0], torch.tensor(expected))


def test_penalties_only_touch_their_rows_and_compose_in_order() -> None:
    logits = torch.tensor([[3.0, -1.0, 0.5], [3.0, -1.0, 0.5]])
    rows = [Row(SamplingParams(logit_bias={1: 2.0}, repetition_penalty=1.5, frequency_penalty=1.0),
                prompt_token_ids=[1], output_token_ids=[0]),
            Row(SamplingParams(), prompt_token_ids=[0, 1, 2], output_token_ids=[0, 1, 2])]
    out = adjusted(logits, rows)
    # Row 0: bias makes token 1 -> 1.0, then repetition /1.5; token 0: 3/1.5 - 1 (frequency).
    torch.testing.assert_close(out[0], torch.tensor([3.0 / 1.5 - 1.0, 1.0 / 1.5, 0.5]))
    torch.testing.assert_close(out[1], logits[1])


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(3, 6)
    rows = [Row(SamplingParams(min_tokens=2, stop_token_ids=[4]), output_token_ids=[1]),
            Row(SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True)),
            Row(SamplingParams(min_tokens=2, stop_token_ids=[4]), output_token_ids=[1, 1])]
    out = adjusted(logits, rows, eos=(5, 2))
    inf = float("-inf")
    assert out[0].tolist() == [0.0, 0.0, inf, 0.0, inf, inf]
    assert out[1].tolist() == [0.0, 0.0, inf, 0.0, inf, inf]
    assert out[2].tolist() == [0.0] * 6  # min_tokens reached
    # EOS is the argmax but may not be sampled yet.
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0]])
    row = Row(SamplingParams(temperature=0, min_tokens=1))
    assert sample(eos_first, [row], eos=(5,)).item() == 1
    row.output_token_ids.append(1)
    assert sample(eos_first, [row], eos=(5,)).item() == 5


# Logprobs

def test_logprobs_from_raw_logits_with_ranks() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g, dtype=torch.float64).to(torch.bfloat16)
    rows = [Row(SamplingParams(temperature=0.0, logprobs=2)),
            Row(SamplingParams(temperature=2.0, logprobs=5, repetition_penalty=3.0, logit_bias={7: 50.0}),
                prompt_token_ids=[1, 2]),
            Row(SamplingParams(temperature=0.5, top_k=3)),
            Row(SamplingParams(temperature=0.0, logprobs=0, logit_bias={9: 100.0}))]
    torch.manual_seed(0)
    out = Sampler()(logits, meta_for(rows, 30))
    lp = out.logprobs
    assert lp is not None
    ref = torch.log_softmax(logits.float(), dim=-1)
    ids = out.sampled_token_ids
    assert ids[1].item() == 7 and ids[3].item() == 9  # the bias dominates sampling, not logprobs
    torch.testing.assert_close(lp.sampled_logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    expected_ranks = [int((ref[i] > ref[i, ids[i]]).sum()) + 1 for i in range(4)]
    assert lp.sampled_ranks.tolist() == expected_ranks
    assert lp.sampled_ranks[0].item() == 1
    assert lp.topk_token_ids.shape == (4, 5) and lp.topk_logprobs.dtype == torch.float32
    top = ref.sort(dim=-1, descending=True)
    torch.testing.assert_close(lp.topk_logprobs, top.values[:, :5])
    torch.testing.assert_close(ref.gather(1, lp.topk_token_ids), lp.topk_logprobs)


def test_logprobs_zero_gives_sampled_only() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(4))
    rows = [Row(SamplingParams(temperature=0.0, logprobs=0)), Row(SamplingParams(temperature=0.0))]
    lp = Sampler()(logits, meta_for(rows, 10)).logprobs
    assert lp is not None and lp.topk_token_ids.shape == (2, 0)
    assert lp.sampled_ranks.tolist() == [1, 1]


# Device

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (CI has no GPU)")
def test_cuda_mixed_batch_and_seeding() -> None:
    dev = torch.device("cuda")
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(6)).to(dev, torch.bfloat16)
    every = dict(top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2, frequency_penalty=0.3,
                 presence_penalty=0.2, logit_bias={3: 1.0}, min_tokens=4, logprobs=3)

    def row(params: SamplingParams) -> Row:
        r = Row(params, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 4])
        if params.seed is not None:
            r.generator = torch.Generator(dev).manual_seed(params.seed)
        return r

    target = SamplingParams(temperature=0.8, seed=11, **every)
    batch = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0, **every)),
             row(target), row(SamplingParams(temperature=0.7, seed=5)), row(SamplingParams(temperature=0.0, **every))]
    alone = [row(target)]
    for _ in range(3):
        out = Sampler()(logits, build_sampling_metadata(batch, 100, [0], dev))
        solo = Sampler()(logits[2:3], build_sampling_metadata(alone, 100, [0], dev))
        assert out.sampled_token_ids.device.type == "cuda"
        assert out.sampled_token_ids[2].item() == solo.sampled_token_ids[0].item()
        assert out.sampled_token_ids[0].item() == logits[0].float().argmax().item()
        assert out.logprobs is not None and out.logprobs.topk_token_ids.shape == (5, 3)
