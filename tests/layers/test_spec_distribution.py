"""Speculative steps are lossless: the emitted tokens follow the target's distribution exactly.

A toy target on V = 8 tokens gives logits as a fixed function of the tokens emitted so far in the
step (tests/helpers/spec.py); each batch row is an independent trial of one speculative step with
k_r in 0..K drafts. The step emits a prefix of the target's chain whose length is decided along the
way; filling the rest with plain draws from the target (`complete`) must give exactly the target's
law of K + 1 tokens, which a chi-square test compares over all V ** (K + 1) sequences. Trials run
on unseeded rows (torch's generator) and on seeded rows (distinct seeds, several steps each). The
tests at the end break the rule on purpose and show the same check fails. On the CPU the logits are
float32; on CUDA (scripts/device_check.py --parts spec_sampler) bfloat16, the toy tables rounded to
bfloat16 first so that the reference sees the very logits the sampler does.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest, chisquare

from tests.helpers.sampling import Harness
from tests.helpers.spec import (PrefixModel, chain_probabilities, chi_square_pvalue, complete, draft_model_step,
                                one_hot_step)
from tokenmill.layers.sampling import spec_verify
from tokenmill.layers.sampling.seeded_noise import NoiseStream
from tokenmill.layers.sampling.spec_layout import flat_rows, flat_to_padded
from tokenmill.layers.sampling.spec_verify import verify_drafts
from tokenmill.sampling_params import SamplingParams

VOCAB, K = 8, 2
TARGET = PrefixModel(VOCAB, K, seed=1)
DRAFT = TARGET.perturbed(1.0, seed=2)  # accepts about two thirds of its drafts
# (device, logits dtype): float32 on the CPU, bfloat16 on CUDA.
SETUPS = [pytest.param("cpu", torch.float32, id="cpu-float32")] + (
    [pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16")] if torch.cuda.is_available() else [])
NUM_TRIALS = 24_000
SEEDED_SLOTS, SEEDED_STEPS = 4_000, 6  # 24,000 seeded trials: each slot takes six steps
ALPHA = 1e-3  # the draws are seeded: a pass is deterministic; the broken rules score far below 1e-12

PARAMS = {
    "plain": dict(),
    "temperature": dict(temperature=0.6),
    "top_k_temperature": dict(top_k=4, temperature=1.4),
    "top_p": dict(top_p=0.8),
    "min_p_top_k": dict(min_p=0.15, top_k=6),
}


def num_drafts_of(rows: int, max_drafts: int) -> torch.Tensor:
    """0, 1, .., K, K, ...: every k_r in one batch, half the rows at K."""
    return (torch.arange(rows) % (2 * max_drafts)).clamp(max=max_drafts)


class Setup:
    """Where a test runs: the device, the logits dtype, and the toy models rounded to that dtype."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.target, self.draft = TARGET.rounded(dtype), DRAFT.rounded(dtype)


def trials(setup: Setup, params: dict, seeded: bool, step) -> torch.Tensor:
    """Run `step(setup, h, slots, num_drafts)` over NUM_TRIALS independent rows; the completed tokens."""
    torch.manual_seed(0)
    if setup.device == "cuda":
        torch.cuda.manual_seed(0)
    target = setup.target
    if not seeded:  # one slot, every row an independent draw
        h = Harness(setup.device, VOCAB, max_slots=1)
        h.add(0, SamplingParams(**params))
        slots = h.slots([0] * NUM_TRIALS)
        num_drafts = num_drafts_of(NUM_TRIALS, K)
        emitted, num_emitted = step(setup, h, slots, num_drafts)
        return complete(target, SamplingParams(**params), emitted, num_emitted, seed=1)
    h = Harness(setup.device, VOCAB, max_slots=SEEDED_SLOTS)
    for slot in range(SEEDED_SLOTS):
        h.add(slot, SamplingParams(seed=1_000_003 * slot + 17, **params))
    slots = h.slots(range(SEEDED_SLOTS))
    num_drafts = num_drafts_of(SEEDED_SLOTS, K)
    out = []
    for i in range(SEEDED_STEPS):  # the toy target ignores earlier steps: each step is a fresh trial
        emitted, num_emitted = step(setup, h, slots, num_drafts)
        h.sampler.advance(slots, num_emitted)
        out.append(complete(target, SamplingParams(**params), emitted, num_emitted, seed=2 + i))
    return torch.cat(out)


def adversarial_drafts(target: PrefixModel, rows: int) -> torch.Tensor:
    """One-hot drafts by row: the target's least likely token, its most likely, or a random one."""
    g = torch.Generator().manual_seed(3)
    drafts = torch.zeros(rows, K, dtype=torch.int64)
    kind = torch.arange(rows) % 3
    for j in range(K):
        logits = target.logits(drafts[:, :j])
        pick = torch.stack([logits.argmin(-1), logits.argmax(-1), torch.randint(VOCAB, (rows,), generator=g)])
        drafts[:, j] = pick.gather(0, kind[None]).squeeze(0)
    return drafts


def assert_target_law(setup: Setup, tokens: torch.Tensor, params: dict) -> None:
    expected = chain_probabilities(setup.target, SamplingParams(**params), K + 1)
    pvalue = chi_square_pvalue(tokens, expected, VOCAB)
    assert pvalue > ALPHA, f"emitted tokens do not follow the target (chi-square p = {pvalue:.3g})"


def one_hot(setup, h, slots, num_drafts):
    drafts = adversarial_drafts(setup.target, len(slots))
    return one_hot_step(h, slots, setup.target, drafts, num_drafts, setup.dtype)


def draft_model(stream: int = NoiseStream.DRAFT):
    def step(setup, h, slots, num_drafts):
        return draft_model_step(h, slots, setup.target, setup.draft, num_drafts, K, stream, setup.dtype)
    return step


@pytest.mark.parametrize("device, dtype", SETUPS)
@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("name", ["plain", "top_k_temperature"])
def test_one_hot_drafts_are_lossless(name: str, seeded: bool, device, dtype) -> None:
    setup = Setup(device, dtype)
    assert_target_law(setup, trials(setup, PARAMS[name], seeded, one_hot), PARAMS[name])


@pytest.mark.parametrize("device, dtype", SETUPS)
@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_draft_model_rejection_sampling_is_lossless(name: str, seeded: bool, device, dtype) -> None:
    setup = Setup(device, dtype)
    assert_target_law(setup, trials(setup, PARAMS[name], seeded, draft_model()), PARAMS[name])


@pytest.mark.parametrize("device, dtype", SETUPS)
def test_drafts_drawn_from_the_main_stream_stay_lossless(device, dtype) -> None:
    """Seeded proposals may share the MAIN stream with the bonus token (spec_verify.py says why)."""
    setup = Setup(device, dtype)
    assert_target_law(setup, trials(setup, PARAMS["top_p"], True, draft_model(NoiseStream.MAIN)), PARAMS["top_p"])


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_one_hot_verification_is_the_rejection_rule_at_one_position(seeded: bool) -> None:
    """spec_verify.py's argument, measured: for q = onehot(d) the draft is kept with probability
    min(1, p(d) / 1) = p(d), and a rejection emits t with probability p(t) / (1 - p(d)), i.e. from
    normalized max(p - onehot(d), 0), never d itself."""
    probs, draft, rows = [0.1, 0.4, 0.2, 0.3], 3, 20_000
    h = Harness("cpu", 4, max_slots=rows if seeded else 1)
    for slot in range(rows if seeded else 1):
        h.add(slot, SamplingParams(seed=slot + 5 if seeded else None))
    slots = h.slots(range(rows)) if seeded else h.slots([0] * rows)
    torch.manual_seed(0)
    num_drafts = torch.ones(rows, dtype=torch.int64)
    request, offset = flat_rows(num_drafts, 2 * rows)
    sampled = h.sampler.sample(torch.tensor(probs).log().expand(2 * rows, -1), slots[request], offsets=offset,
                               record=False).sampled
    emitted, num_emitted = verify_drafts(flat_to_padded(sampled, num_drafts, 1, -1),
                                         torch.full((rows, 1), draft), num_drafts)
    kept = num_emitted == 2
    assert binomtest(int(kept.sum()), rows, probs[draft]).pvalue > ALPHA
    corrections = torch.bincount(emitted[~kept, 0], minlength=4)
    assert corrections[draft] == 0
    residual = torch.tensor([p for t, p in enumerate(probs) if t != draft], dtype=torch.float64) / (1 - probs[draft])
    others = corrections[[t for t in range(4) if t != draft]].double()
    assert chisquare(others.numpy(), (residual * others.sum()).numpy()).pvalue > ALPHA


# ---------------------------------------------------------------- the check fails on a broken rule

CPU = Setup("cpu", torch.float32)


def broken_pvalue(params: dict, seeded: bool, step) -> float:
    tokens = trials(CPU, params, seeded, step)
    return chi_square_pvalue(tokens, chain_probabilities(CPU.target, SamplingParams(**params), K + 1), VOCAB)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_the_check_fails_when_every_draft_is_accepted(monkeypatch, seeded: bool) -> None:
    monkeypatch.setattr(spec_verify, "_accepts", lambda u, p_d, q_d: torch.ones_like(u, dtype=torch.bool))
    assert broken_pvalue(PARAMS["plain"], seeded, draft_model()) < 1e-12


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_the_check_fails_when_a_rejection_resamples_from_p(monkeypatch, seeded: bool) -> None:
    monkeypatch.setattr(spec_verify, "_residual", lambda p_final, q_final, rejected: p_final)
    assert broken_pvalue(PARAMS["plain"], seeded, draft_model()) < 1e-12


def test_the_check_fails_when_a_one_hot_rejection_resamples_from_p() -> None:
    """The correction must be the target's own sample x_j (it differs from the draft); a fresh
    sample from p, which may be the rejected draft again, breaks the law."""
    def step(setup, h, slots, num_drafts):
        emitted, num_emitted = one_hot(setup, h, slots, num_drafts)
        fresh, _ = one_hot(setup, h, slots, torch.zeros_like(num_drafts))  # x_0 again, independently
        # Only the first position's correction is redrawn (its law does not depend on a prefix).
        redo = (num_emitted == 1) & (num_drafts > 0)
        emitted = emitted.clone()
        emitted[:, 0] = torch.where(redo, fresh[:, 0], emitted[:, 0])
        return emitted, num_emitted
    assert broken_pvalue(PARAMS["plain"], False, step) < 1e-12
