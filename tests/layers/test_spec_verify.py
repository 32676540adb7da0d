"""Speculative verification on crafted inputs and toy models: the layouts, the one-hot rule's known
answers, greedy rows emitting the target's argmax chain, seeded and greedy speculation equal to
plain sampling token for token over whole generations, batch invariance, and a step without host
syncs or [R, K, V] temporaries. (The distribution tests are in test_spec_distribution.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.sampling import DEVICES, SYNCING_OPS, Harness, OpLog, no_host_sync
from tests.helpers.spec import ChainModel
from tokenmill.layers.sampling import spec_verify
from tokenmill.layers.sampling.seeded_noise import NoiseStream
from tokenmill.layers.sampling.spec_layout import flat_rows, flat_to_padded, padded_index
from tokenmill.layers.sampling.spec_verify import rejection_sample, verify_drafts
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.parametrize("device", DEVICES)

VOCAB, K = 16, 4


def tensor(device, values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


# ---------------------------------------------------------------- layouts and the one-hot rule

def test_flat_rows_and_the_padded_layout(device) -> None:
    num_drafts = tensor(device, [2, 0, 3, 0, 1])  # T = 3 + 1 + 4 + 1 + 2 = 11
    request, offset = flat_rows(num_drafts, 11)
    assert request.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 4, 4]
    assert offset.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 1]
    flat = torch.arange(11, device=device) * 10
    assert flat_to_padded(flat, num_drafts, 3, -1).tolist() == [
        [0, 10, 20, -1], [30, -1, -1, -1], [40, 50, 60, 70], [80, -1, -1, -1], [90, 100, -1, -1]]
    wide = flat_to_padded(torch.stack([flat, -flat], dim=1).float(), num_drafts, 4, 0.5)  # K above every k_r
    assert wide.shape == (5, 5, 2) and wide[2, 3].tolist() == [70.0, -70.0] and wide[4, 2].tolist() == [0.5, 0.5]
    # Groups of k_r rows (flat drafts, an empty group last): indices stay inside the flat rows.
    index, valid = padded_index(num_drafts, 3)
    assert valid.tolist() == [[True, True, False], [False] * 3, [True] * 3, [False] * 3, [True, False, False]]
    assert index[valid].tolist() == [0, 1, 2, 3, 4, 5] and int(index.max()) == 5 and int(index.min()) == 0


def test_one_hot_rule_known_answers(device) -> None:
    sampled = tensor(device, [[5, 6, 7, 8]] * 4 + [[5, -1, -1, -1]])
    drafts = tensor(device, [[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7], [5, 5, 5]])
    num_drafts = tensor(device, [3, 3, 3, 2, 0])
    emitted, num_emitted = verify_drafts(sampled, drafts, num_drafts)
    assert num_emitted.tolist() == [4, 2, 1, 3, 1]
    assert emitted.tolist() == [[5, 6, 7, 8],  # every draft accepted, then the bonus token
                                [5, 6, -1, -1],  # 9 != 6: the target's own token corrects it
                                [5, -1, -1, -1],
                                [5, 6, 7, -1],  # k = 2: the third draft is padding, even when it matches
                                [5, -1, -1, -1]]  # no drafts: the plain sample


def test_rejection_rule_known_answers(device) -> None:
    """Crafted p and q whose outcomes are certain (p(d) is 0 or 1 = q(d)), on random rows."""
    h = Harness(device, 4, max_slots=2)
    h.add(0, SamplingParams(temperature=1.0))
    h.add(1, SamplingParams(temperature=1.0, seed=3))
    hot = torch.eye(4, device=device)
    p = hot[0].expand(5, K + 1, 4)  # the target always says token 0
    drafts = tensor(device, [[0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [3, 0, 0, 0]])
    q = hot[drafts]  # each draft drawn from a one-hot q
    num_drafts = tensor(device, [4, 3, 1, 0, 2])
    for slot in (0, 1):
        emitted, num_emitted = rejection_sample(h.sampler, h.slots([slot] * 5), p, q, drafts, num_drafts)
        assert num_emitted.tolist() == [5, 2, 2, 1, 1]
        assert emitted.tolist() == [[0, 0, 0, 0, 0],  # all accepted, then the bonus token
                                    [0, 0, -1, -1, -1],  # 2 rejected (p = 0): the residual is token 0
                                    [0, 0, -1, -1, -1],  # padding drafts are never accepted
                                    [0, -1, -1, -1, -1],
                                    [0, -1, -1, -1, -1]]


def test_a_rejection_emits_from_the_residual_only(device) -> None:
    """p = (1/2, 1/2, 0, 0), q = onehot(0): token 0 is kept half the time; a rejection must emit
    token 1 (max(p - q, 0)), never token 0 again."""
    rows = 2000
    h = Harness(device, 4, max_slots=1)
    h.add(0, SamplingParams(temperature=1.0))
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], device=device).expand(rows, 2, 4)
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], device=device).expand(rows, 1, 4)
    drafts = torch.zeros(rows, 1, dtype=torch.int64, device=device)
    torch.manual_seed(0)
    emitted, num_emitted = rejection_sample(h.sampler, h.slots([0] * rows), p, q, drafts,
                                            torch.ones(rows, dtype=torch.int64, device=device))
    rejected = num_emitted == 1
    assert (emitted[rejected, 0] == 1).all() and (emitted[~rejected, 0] == 0).all()
    assert abs(rejected.double().mean().item() - 0.5) < 0.05  # 4.5 sigma
    # p <= q everywhere leaves an all-zero residual: fall back to p.
    same = torch.tensor([[0.25, 0.75]], device=device)
    assert spec_verify._residual(same, same.clone(), torch.tensor([True], device=device)).tolist() == [[0.25, 0.75]]


# ---------------------------------------------------------------- greedy rows emit the argmax chain

def requests_with_greedy_and_random(h: Harness, count: int) -> list[SamplingParams]:
    params = [SamplingParams(temperature=0.0) if r % 2 == 0 else SamplingParams(temperature=0.8, top_k=5)
              for r in range(count)]
    for slot, p in enumerate(params):
        h.add(slot, p, outputs=[3] * slot)  # NUM_OUTPUTS = slot: the rows stand at different positions
    return params


def argmax_chain(logits_along: torch.Tensor) -> torch.Tensor:
    """[R, K + 1] argmax at each position of logits already conditioned on the drafts."""
    return logits_along.argmax(-1)


def corrupted(tokens: torch.Tensor, rate: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(VOCAB, tokens.shape, generator=g)
    return torch.where(torch.rand(tokens.shape, generator=g) < rate, noise, tokens)


def greedy_drafts(model: ChainModel, start: torch.Tensor, last: torch.Tensor, seed: int) -> torch.Tensor:
    """The model's greedy chain of K tokens, some of them replaced by random tokens."""
    chain = torch.zeros(len(start), K, dtype=torch.int64)
    for j in range(K):
        previous = last if j == 0 else chain[:, j - 1]
        chain[:, j] = model.logits(start + j, previous).argmax(-1)
    return corrupted(chain, 0.25, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_hot_verification_of_greedy_rows_emits_the_argmax_chain(device, dtype) -> None:
    rows = 24
    model = ChainModel(VOCAB, 40, seed=1)
    h = Harness(device, VOCAB, max_slots=rows)
    params = requests_with_greedy_and_random(h, rows)
    start, last = torch.arange(rows), torch.full((rows,), 3)
    drafts = greedy_drafts(model, start, last, seed=2)
    num_drafts = torch.arange(rows) % (K + 1)
    along = model.along(start, last, drafts).to(dtype)  # the logits the target computes at each position
    request, offset = flat_rows(num_drafts, int((num_drafts + 1).sum()))
    sampled = h.sampler.sample(along[request, offset].to(device), h.slots(range(rows))[request.to(device)],
                               offsets=offset.to(device), record=False).sampled
    emitted, num_emitted = verify_drafts(flat_to_padded(sampled, num_drafts.to(device), K, -1),
                                         drafts.to(device), num_drafts.to(device))
    check_greedy_rows(params, argmax_chain(along.float()), drafts, num_drafts, emitted.cpu(), num_emitted.cpu())


def check_greedy_rows(params, chain, drafts, num_drafts, emitted, num_emitted) -> None:
    accepted = rejected = 0
    for r, p in enumerate(params):
        if not p.greedy:
            continue
        k = int(num_drafts[r])
        a = next((j for j in range(k) if drafts[r, j] != chain[r, j]), k)
        assert int(num_emitted[r]) == a + 1, (r, drafts[r], chain[r])
        assert emitted[r, :a + 1].tolist() == chain[r, :a + 1].tolist()
        assert (emitted[r, a + 1:] == -1).all()
        accepted += a
        rejected += a < k
    assert accepted > 5 and rejected > 3  # both outcomes happened


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rejection_sampling_of_greedy_rows_emits_the_argmax_chain(device, dtype) -> None:
    """Greedy rows through the draft-model rule: p and q are one-hot (Sampler.probs), so a draft is
    kept iff it is the target's argmax, and a rejection emits the argmax."""
    rows = 24
    target = ChainModel(VOCAB, 40, seed=3)
    draft = ChainModel(VOCAB, 40, seed=3)
    draft.table += torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    h = Harness(device, VOCAB, max_slots=rows)
    params = requests_with_greedy_and_random(h, rows)
    slots = h.slots(range(rows))
    start, last = torch.arange(rows), torch.full((rows,), 3)
    num_drafts = torch.arange(rows) % (K + 1)
    drafts = torch.zeros(rows, K, dtype=torch.int64)
    q = torch.empty(rows, K, VOCAB, device=device)
    for j in range(K):  # the draft model proposes one position at a time
        offsets = torch.full((rows,), j, device=device)
        q[:, j] = h.sampler.probs(draft.along(start, last, drafts)[:, j].to(device, dtype), slots, offsets)
        drafts[:, j] = h.sampler.draw(q[:, j], slots, offsets, NoiseStream.DRAFT).cpu()
    along = target.along(start, last, drafts).to(dtype)
    p = torch.stack([h.sampler.probs(along[:, j].to(device), slots, torch.full((rows,), j, device=device))
                     for j in range(K + 1)], dim=1)
    emitted, num_emitted = rejection_sample(h.sampler, slots, p, q, drafts.to(device), num_drafts.to(device))
    check_greedy_rows(params, argmax_chain(along.float()), drafts, num_drafts, emitted.cpu(), num_emitted.cpu())


# ---------------------------------------------------------------- speculation changes no seeded or greedy token

LENGTH = 28
REQUESTS = [SamplingParams(temperature=0.8, top_p=0.9, seed=7),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.1, top_k=6, min_p=0.02, seed=11, min_tokens=9),
            SamplingParams(temperature=1.0),  # unseeded: in the batch, not compared
            SamplingParams(temperature=0.0, min_tokens=5)]
COMPARED = [0, 1, 2, 4]
EOS = 0


def plain_run(device, model: ChainModel) -> list[list[int]]:
    """Token by token without speculation: `sample` with `record`."""
    h = Harness(device, VOCAB, max_slots=len(REQUESTS), eos=[EOS])
    for slot, p in enumerate(REQUESTS):
        h.add(slot, p)
    seqs: list[list[int]] = [[] for _ in REQUESTS]
    torch.manual_seed(0)
    for step in range(LENGTH):
        last = torch.tensor([s[-1] if s else -1 for s in seqs])
        logits = model.logits(torch.full((len(REQUESTS),), step), last).float()
        for s, t in zip(seqs, h.sample(logits, range(len(REQUESTS)))):
            s.append(t)
    return seqs


def speculative_run(device, model: ChainModel, propose) -> tuple[list[list[int]], int, int]:
    """Requests in other slots, only the unfinished ones in each step, k_r drafts from `propose`;
    returns the sequences and how many drafts were accepted / rejected."""
    h = Harness(device, VOCAB, max_slots=8, eos=[EOS])
    slot_of = [7 - i for i in range(len(REQUESTS))]
    for i, p in enumerate(REQUESTS):
        h.add(slot_of[i], p)
    rng = random.Random(5)
    seqs: list[list[int]] = [[] for _ in REQUESTS]
    accepted = rejected = 0
    while any(len(s) < LENGTH for s in seqs):
        live = [i for i, s in enumerate(seqs) if len(s) < LENGTH]
        rng.shuffle(live)
        num_drafts = torch.tensor([rng.randint(0, K) for _ in live])
        drafts = torch.stack([propose(i, seqs[i], rng) for i in live])
        slots = h.slots([slot_of[i] for i in live])
        emitted, num_emitted = propose.verify(h, model, slots, [seqs[i] for i in live], drafts, num_drafts)
        h.sampler.advance(slots, num_emitted.to(device), emitted.to(device))
        for row, i in enumerate(live):
            n = int(num_emitted[row])
            seqs[i] += emitted[row, :n].tolist()
            accepted += n - 1
            rejected += n - 1 < int(num_drafts[row])
    return seqs, accepted, rejected


class ChainProposer:
    """One-hot drafts: the plain run's continuation with some tokens replaced (random requests that
    are not compared get random drafts)."""

    def __init__(self, plain: list[list[int]]) -> None:
        self.plain = plain

    def __call__(self, i: int, seq: list[int], rng: random.Random) -> torch.Tensor:
        n = len(seq)
        truth = self.plain[i][n:n + K] + [EOS] * K
        return torch.tensor([t if rng.random() < 0.7 else rng.randrange(VOCAB) for t in truth[:K]])

    @staticmethod
    def verify(h, model, slots, seqs, drafts, num_drafts):
        start = torch.tensor([len(s) for s in seqs])
        last = torch.tensor([s[-1] if s else -1 for s in seqs])
        along = model.along(start, last, drafts).float()
        request, offset = flat_rows(num_drafts, int((num_drafts + 1).sum()))
        sampled = h.sampler.sample(along[request, offset].to(h.device), slots[request.to(h.device)],
                                   offsets=offset.to(h.device), record=False).sampled
        return verify_drafts(flat_to_padded(sampled, num_drafts.to(h.device), K, -1), drafts.to(h.device),
                             num_drafts.to(h.device))


def test_seeded_and_greedy_speculation_equals_plain_sampling(device) -> None:
    """Whole generations, one-hot drafts: every seeded and greedy request emits the plain run's
    tokens, min_tokens included (EOS is boosted: banned too long or too short, a token differs)."""
    model = ChainModel(VOCAB, LENGTH + K + 1, seed=6, eos=EOS)
    plain = plain_run(device, model)
    assert EOS not in plain[2][:9] and EOS in plain[2][9:] and EOS in plain[4][5:]  # min_tokens in play
    seqs, accepted, rejected = speculative_run(device, model, ChainProposer(plain))
    for i in COMPARED:
        assert seqs[i][:LENGTH] == plain[i], f"request {i}"
    assert accepted > 20 and rejected > 10


class TargetAsDraft:
    """The draft model is the target itself, drafts drawn from the MAIN stream; rejection sampling."""

    def __init__(self) -> None:
        self.pending: dict[int, torch.Tensor] = {}

    def __call__(self, i: int, seq: list[int], rng: random.Random) -> torch.Tensor:
        return torch.zeros(K, dtype=torch.int64)  # drawn in verify, where the sampler is

    @staticmethod
    def verify(h, model, slots, seqs, drafts, num_drafts):
        rows = len(seqs)
        start = torch.tensor([len(s) for s in seqs])
        last = torch.tensor([s[-1] if s else -1 for s in seqs])
        drafts = drafts.clone()
        q = torch.empty(rows, K, VOCAB, device=h.device)
        for j in range(K):
            offsets = torch.full((rows,), j, device=h.device)
            q[:, j] = h.sampler.probs(model.along(start, last, drafts)[:, j].float().to(h.device), slots, offsets)
            drafts[:, j] = h.sampler.draw(q[:, j], slots, offsets, NoiseStream.MAIN).cpu()
        along = model.along(start, last, drafts).float().to(h.device)
        p = torch.stack([h.sampler.probs(along[:, j], slots, torch.full((rows,), j, device=h.device))
                         for j in range(K + 1)], dim=1)
        emitted, num_emitted = rejection_sample(h.sampler, slots, p, q, drafts.to(h.device), num_drafts.to(h.device))
        assert torch.equal(num_emitted.cpu(), num_drafts + 1)  # q == p: every draft is accepted
        return emitted, num_emitted


def test_target_as_draft_emits_the_plain_tokens(device) -> None:
    """q == p and drafts from the MAIN stream: seeded and greedy requests emit exactly the plain
    run's tokens, drafts and bonus tokens alike."""
    model = ChainModel(VOCAB, LENGTH + K + 1, seed=8, eos=EOS)
    plain = plain_run(device, model)
    seqs, accepted, _ = speculative_run(device, model, TargetAsDraft())
    for i in COMPARED:
        assert seqs[i][:LENGTH] == plain[i], f"request {i}"
    assert accepted > 20


# ---------------------------------------------------------------- batch invariance, layouts

def test_seeded_rejection_sampling_does_not_depend_on_the_batch(device) -> None:
    rows = 6
    target, draft = ChainModel(VOCAB, 20, seed=9), ChainModel(VOCAB, 20, seed=10)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + r) for r in range(rows)]

    def run(order: list[int], slot_of: list[int], company: int):
        h = Harness(device, VOCAB, max_slots=16)
        for r in order:
            h.add(slot_of[r], params[r], outputs=[1] * r)
        for c in range(company):  # other requests in other slots, with rows in the step
            h.add(15 - c, SamplingParams(temperature=1.0, seed=None if c % 2 else c))
        slots = h.slots([slot_of[r] for r in order] + [15 - c for c in range(company)])
        n = len(slots)
        start = torch.tensor([r for r in order] + [0] * company)
        last = torch.full((n,), 2)
        num_drafts = torch.tensor([r % (K + 1) for r in order] + [K] * company)
        drafts = torch.zeros(n, K, dtype=torch.int64)
        q = torch.empty(n, K, VOCAB, device=device)
        for j in range(K):
            offsets = torch.full((n,), j, device=device)
            q[:, j] = h.sampler.probs(draft.along(start, last, drafts)[:, j].float().to(device), slots, offsets)
            drafts[:, j] = h.sampler.draw(q[:, j], slots, offsets, NoiseStream.DRAFT).cpu()
        along = target.along(start, last, drafts).float().to(device)
        p = torch.stack([h.sampler.probs(along[:, j], slots, torch.full((n,), j, device=device))
                         for j in range(K + 1)], dim=1)
        emitted, num_emitted = rejection_sample(h.sampler, slots, p, q, drafts.to(device), num_drafts.to(device))
        by_request = {r: emitted[i, :num_emitted[i]].tolist() for i, r in enumerate(order)}
        return [by_request[r] for r in range(rows)]

    torch.manual_seed(0)
    alone = run(list(range(rows)), list(range(rows)), company=0)
    torch.manual_seed(1)
    crowded = run([4, 1, 5, 0, 3, 2], [9, 3, 0, 10, 6, 1], company=5)
    assert alone == crowded
    assert any(len(e) < (r % (K + 1)) + 1 for r, e in enumerate(alone)), "no rejection: a weak test"


def test_flat_and_padded_probabilities_give_the_same_tokens(device) -> None:
    rows = 10
    g = torch.Generator().manual_seed(11)
    h = Harness(device, VOCAB, max_slots=rows)
    for r in range(rows):
        h.add(r, SamplingParams(temperature=0.0) if r % 3 == 0 else SamplingParams(seed=r, top_k=8))
    slots = h.slots(range(rows))
    num_drafts = torch.tensor([r % (K + 1) for r in range(rows)], device=device)
    p = torch.softmax(torch.randn(rows, K + 1, VOCAB, generator=g), -1).to(device)
    q = torch.softmax(torch.randn(rows, K, VOCAB, generator=g), -1).to(device)
    drafts = torch.randint(VOCAB, (rows, K), generator=g).to(device)
    padded = rejection_sample(h.sampler, slots, p, q, drafts, num_drafts)
    positions = torch.arange(K + 1, device=device)[None, :]
    flat_p = p[positions <= num_drafts[:, None]]
    flat_q = q[positions[:, :K] < num_drafts[:, None]]
    flat = rejection_sample(h.sampler, slots, flat_p, flat_q, drafts, num_drafts)
    assert padded[0].tolist() == flat[0].tolist() and padded[1].tolist() == flat[1].tolist()


# ---------------------------------------------------------------- no host sync, no [R, K, V] temporary

def test_a_speculative_step_never_syncs_and_allocates_no_rkv_tensor(device) -> None:
    rows, vocab = 16, 512
    g = torch.Generator().manual_seed(12)
    h = Harness(device, vocab, max_slots=rows, eos=[0])
    for r in range(rows):
        h.add(r, [SamplingParams(temperature=0.0), SamplingParams(seed=r, top_p=0.9, min_tokens=3),
                  SamplingParams(top_k=20, min_p=0.05)][r % 3])
    slots = h.slots(range(rows))
    num_drafts = torch.tensor([r % (K + 1) for r in range(rows)], device=device)
    num_tokens = rows + int(num_drafts.sum())
    logits = torch.randn(num_tokens, vocab, generator=g).to(device)
    drafts = torch.randint(vocab, (rows, K), generator=g).to(device)
    q = torch.softmax(torch.randn(rows, K, vocab, generator=g), -1).to(device)
    h.sampler.probs(logits[:1], slots[:1])  # flush the queued writes first
    with no_host_sync(h.device), OpLog() as one_hot:
        request, offset = flat_rows(num_drafts, num_tokens)
        sampled = h.sampler.sample(logits, slots[request], offsets=offset, record=False).sampled
        emitted, num_emitted = verify_drafts(flat_to_padded(sampled, num_drafts, K, -1), drafts, num_drafts)
        h.sampler.advance(slots, num_emitted, emitted)
    with no_host_sync(h.device), OpLog() as draft_model:
        p = h.sampler.probs(logits, slots[request], offset)  # flat target probabilities
        h.sampler.draw(p, slots[request], offset, NoiseStream.DRAFT)
    with no_host_sync(h.device), OpLog() as rejection:
        rejection_sample(h.sampler, slots, p, q, drafts, num_drafts)
    for log in (one_hot, draft_model, rejection):
        assert not SYNCING_OPS & set(log.ops), f"host syncs: {SYNCING_OPS & set(log.ops)}"
    # Beyond [R, K] gathers, only [R, V] rows of the final position (hashed noise: int64 [R, V]).
    assert rejection.largest_allocation <= rows * vocab < rows * K * vocab
