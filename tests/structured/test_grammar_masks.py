"""The engine's grammar masks are XGrammar's: for random prefixes of valid outputs (SmolLM2's real
tokenizer), the tokens the engine core's mask leaves finite after the device-side unpacking equal
the tokens XGrammar's own matcher allows; and a mask made one token late differs."""

from __future__ import annotations

import json
import random

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.requirements import require_smollm2
from tokenmill.config import StructuredOutputConfig
from tokenmill.core.grammar_masks import GrammarMasks, RequestGrammar, distinct_rows
from tokenmill.core.request import Request
from tokenmill.layers.sampling.token_bitmask import apply_bitmask_by_row, unpack_bitmask
from tokenmill.protocol import GrammarBitmask, SchedulerOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.backend import GrammarBackend
from tokenmill.structured_output.grammar_spec import grammar_spec
from tokenmill.worker.mask_upload import MaskUpload

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "score": {"type": "integer", "minimum": -5, "maximum": 500}}, "required": ["name", "tags", "score"]}
CASES = [
    (StructuredOutputsParams(json=json.dumps(SCHEMA)),
     ['{"name": "Ada Lovelace", "tags": ["a", "c"], "score": 42}', '{"name":"x","tags":["b"],"score":-5}']),
    (StructuredOutputsParams(regex=r"\d{3}-[a-z]+"), ["123-abc", "999-zzzzzz"]),
    (StructuredOutputsParams(choice=["yes", "no way", "maybe"]), ["no way", "maybe"]),
    (StructuredOutputsParams(grammar='root ::= "(" ("x" | "yy")* ")"'), ["(xyyx)", "()"]),
]


@pytest.fixture(scope="module")
def setup():
    require_smollm2()
    from tokenmill.model.default_model import resolve_model_path
    from tokenmill.model.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    config = StructuredOutputConfig()
    backend = GrammarBackend.from_tokenizer(tokenizer, 49152, (2,), config)
    return tokenizer, backend, config


class _Config:  # what GrammarMasks reads of an EngineConfig
    def __init__(self, structured, vocab):
        self.structured = structured
        self.model = type("M", (), {"arch": type("A", (), {"vocab_size": vocab})()})()


def engine_masks(backend, config, so, prefixes, late=False):
    """The allowed tokens (bool [rows, V]) the engine makes for each prefix: core matchers advanced
    through GrammarMasks.advance, the mask packed as the wire's GrammarBitmask, unpacked and applied
    to logits on the device as the worker does. `late`: the planted defect, a mask made before the
    last token is applied."""
    masks = GrammarMasks(_Config(config, 49152))
    masks.compiles._backend = _done(backend)
    compiled = backend.compile(grammar_spec(so, config.max_schema_bytes))
    requests = {}
    for handle, prefix in enumerate(prefixes):
        request = Request(handle, [1, 2, 3], SamplingParams(structured_outputs=so), (2,), 4096)
        request.grammar = RequestGrammar(backend.matcher(compiled))
        request.token_ids = np.array([1, 2, 3, *prefix[:-1]] if late and prefix else [1, 2, 3, *prefix], np.int32)
        requests[handle] = request
    so_step = SchedulerOutput(step_id=1)
    so_step.structured_handles = np.arange(len(prefixes))
    so_step.structured_rows = np.arange(len(prefixes))
    complete, broken = masks.advance(so_step, requests, None)
    assert not broken
    mask = masks.bitmask(so_step, requests, None)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(mask), type=GrammarBitmask)  # as the ring carries it
    rows, which, bits = wire.arrays()
    assert len(bits) <= len(rows)
    logits = torch.zeros(len(prefixes), 49152)
    which_of_row = np.full(len(prefixes), -1, np.int32)
    which_of_row[rows] = which
    device_bits, device_which = MaskUpload(torch.device("cpu"))(bits, which_of_row)
    apply_bitmask_by_row(logits, device_bits, device_which)
    return torch.isfinite(logits).numpy()


def reference_masks(backend, so, prefixes):
    """XGrammar's own matcher, fed each prefix, and its own bitmask reading."""
    import xgrammar as xgr
    compiled = backend.compile(grammar_spec(so, 65536))
    out = []
    for prefix in prefixes:
        matcher = xgr.GrammarMatcher(compiled)
        for token in prefix:
            assert matcher.accept_token(token)
        bitmask = xgr.allocate_token_bitmask(1, 49152)
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, 49152)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        out.append(torch.isfinite(logits)[0].numpy())
    return np.stack(out)


def _done(value):
    from concurrent.futures import Future
    future = Future()
    future.set_result(value)
    return future


def random_prefixes(tokenizer, outputs, rng, count=6):
    prefixes = []
    for _ in range(count):
        ids = tokenizer(rng.choice(outputs), add_special_tokens=False).input_ids
        prefixes.append(ids[:rng.randrange(len(ids) + 1)])
    return prefixes


@pytest.mark.parametrize("case", range(len(CASES)))
def test_engine_mask_equals_xgrammar_matcher(setup, case) -> None:
    tokenizer, backend, config = setup
    so, outputs = CASES[case]
    prefixes = random_prefixes(tokenizer, outputs, random.Random(case))
    prefixes.append(tokenizer(outputs[0], add_special_tokens=False).input_ids)  # complete: EOS allowed
    ours = engine_masks(backend, config, so, prefixes)
    assert (ours == reference_masks(backend, so, prefixes)).all()
    assert ours[-1, 2] and not ours[:-1, 2].all()  # the stop token once the output is complete
    assert ours.any(axis=1).all()


def test_a_mask_one_token_late_differs(setup) -> None:
    """The check above catches a mask made before the step's last token is applied."""
    tokenizer, backend, config = setup
    so, outputs = CASES[0]
    ids = tokenizer(outputs[0], add_special_tokens=False).input_ids
    prefixes = [ids[:n] for n in range(1, len(ids))]
    late = engine_masks(backend, config, so, prefixes, late=True)
    assert (late != reference_masks(backend, so, prefixes)).any(axis=1).mean() > 0.5


def test_unpack_matches_bit_arithmetic() -> None:
    """The device unpacking (bytes, little-endian) against plain bit arithmetic, odd vocab size."""
    rng = np.random.default_rng(0)
    bits = rng.integers(-2**31, 2**31 - 1, size=(3, 5), dtype=np.int64).astype(np.int32)
    vocab = 150
    expected = np.array([[(int(bits[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)], bool)
    assert (unpack_bitmask(torch.from_numpy(bits), vocab).numpy() == expected).all()
    logits = torch.randn(5, vocab, dtype=torch.float16)
    before = logits.clone()
    apply_bitmask_by_row(logits, torch.from_numpy(bits), torch.tensor([1, -1, 2, -1, 0], dtype=torch.int32))
    assert torch.equal(logits[[1, 3]], before[[1, 3]])  # rows with -1 are untouched
    for row, mask_row in ((4, 0), (0, 1), (2, 2)):
        assert torch.equal(torch.isfinite(logits[row]), torch.from_numpy(expected[mask_row]))


def test_rows_in_one_grammar_state_share_one_mask_on_the_wire(setup) -> None:
    """Requests in the same state (every row inside a JSON string, say) send one mask, and each row
    still gets exactly XGrammar's."""
    tokenizer, backend, config = setup
    so, outputs = CASES[0]
    ids = tokenizer(outputs[0], add_special_tokens=False).input_ids
    prefixes = [ids[:5], ids[:9], ids[:5], ids[:5], ids[:9], []]
    ours = engine_masks(backend, config, so, prefixes)
    assert (ours == reference_masks(backend, so, prefixes)).all()
    distinct, which = distinct_rows(np.array([[1, 2], [3, 4], [1, 2], [1, 2]], np.int32))
    assert distinct.tolist() == [[1, 2], [3, 4]] and which.tolist() == [0, 1, 0, 0]


def draft_masks(backend, config, so, prefix, row_drafts, shift=0):
    """Speculative decoding: allowed tokens (bool [sum(1 + k), V]) at every position the rows
    sample, each row at `prefix` with its drafts, through the core's GrammarMasks and the
    worker's own mapping of mask entries to logits rows (worker/mask_entries.py). `shift`: the
    planted defect, each entry applied `shift` positions later in its row."""
    from tokenmill.worker.mask_entries import mask_entries

    masks = GrammarMasks(_Config(config, 49152))
    masks.compiles._backend = _done(backend)
    compiled = backend.compile(grammar_spec(so, config.max_schema_bytes))
    requests = {}
    for handle, drafts in enumerate(row_drafts):
        request = Request(handle, [1, 2, 3], SamplingParams(structured_outputs=so), (2,), 4096)
        request.grammar = RequestGrammar(backend.matcher(compiled))
        request.grammar.drafts, request.grammar.drafts_step = list(drafts) + [7] * 2, 0  # proposed K > k
        request.token_ids = np.array([1, 2, 3, *prefix], np.int32)
        requests[handle] = request
    num_drafts = np.array([len(d) for d in row_drafts])
    so_step = SchedulerOutput(step_id=1)
    so_step.structured_handles = so_step.structured_rows = np.arange(len(row_drafts))
    so_step.num_drafts = num_drafts
    assert masks.advance(so_step, requests, None) == ([], [])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(masks.bitmask(so_step, requests, None)), type=GrammarBitmask)
    if shift:
        wire.positions = (wire.position_array() + shift).clip(0, num_drafts[wire.arrays()[0]]).astype("<i4").tobytes()
    bits, which = mask_entries(49152, wire, np.arange(len(row_drafts)), num_drafts)
    logits = torch.zeros(int((num_drafts + 1).sum()), 49152)
    apply_bitmask_by_row(logits, *MaskUpload(torch.device("cpu"))(bits, which))
    return torch.isfinite(logits).numpy(), masks, requests


def test_draft_position_masks_equal_xgrammar(setup) -> None:
    """Position j of a row is masked as XGrammar masks the prefix plus the row's first j drafts, up
    to the first draft the grammar forbids (its position excludes it; later ones are unmasked);
    the matchers are rolled back to the prefix afterwards. A mask applied one position late fails."""
    tokenizer, backend, config = setup
    so, outputs = CASES[0]
    ids = tokenizer(outputs[0], add_special_tokens=False).input_ids
    prefix, rest = ids[:4], ids[4:]
    allowed = reference_masks(backend, so, [prefix + rest[:1]])[0]
    forbidden = int(np.flatnonzero(~allowed[3:])[0]) + 3  # a token the grammar refuses after rest[0]
    row_drafts = [rest[:3], [rest[0], forbidden, rest[2]], [], rest[:1]]
    ours, masks, requests = draft_masks(backend, config, so, prefix, row_drafts)
    want, everything = [], np.ones(49152, bool)
    for drafts in row_drafts:
        for j in range(len(drafts) + 1):  # positions up to the first forbidden draft are masked
            want.append(reference_masks(backend, so, [prefix + list(drafts[:j])])[0])
            if j < len(drafts) and not want[-1][drafts[j]]:
                want += [everything] * (len(drafts) - j)  # never emitted: unmasked
                break
    assert (ours == np.stack(want)).all()
    assert not ours[5, forbidden] and ours[6].all() and ours[7].all()  # row 1: cut at its forbidden draft
    assert masks.num_drafts_forbidden == 1 and masks.num_draft_positions == 3 + 2 + 1
    # Rolled back: each matcher takes the next true token as it would at the prefix.
    for request in requests.values():
        assert request.grammar.num_accepted == len(prefix) and request.grammar.matcher.accept_token(rest[0])
    late, _, _ = draft_masks(backend, config, so, prefix, row_drafts, shift=1)
    assert (late != np.stack(want)).any(axis=1).sum() >= 3


def test_a_job_asks_no_matcher_per_row(setup, monkeypatch) -> None:
    """A step's job makes batched library calls only: each call gives up the GIL and waits to take
    it back, so per-row calls cost milliseconds beside a busy thread. A matcher is asked whether it
    terminated only after a stop token (the only way it can), and the mask skips the rows that did."""
    import xgrammar as xgr

    from tokenmill.core.grammar_job import GrammarJob, GrammarJobRunner
    tokenizer, backend, config = setup
    so, outputs = CASES[0]
    compiled = backend.compile(grammar_spec(so, config.max_schema_bytes))
    ids = tokenizer(outputs[0], add_special_tokens=False).input_ids
    grammars = [RequestGrammar(backend.matcher(compiled)) for _ in range(20)]
    for token in ids:  # the last row has its whole output already: EOS completes it
        assert grammars[-1].matcher.accept_token(token)
    asked = []
    real = xgr.GrammarMatcher.is_terminated
    monkeypatch.setattr(xgr.GrammarMatcher, "is_terminated", lambda self: asked.append(self) or real(self))
    feed = [(i, g, [ids[0]]) for i, g in enumerate(grammars[:-1])] + [(19, grammars[-1], [2])]
    runner = GrammarJobRunner(lambda: backend, (49152 + 31) // 32)
    result = runner.run(GrammarJob(feed, 1, list(range(20)), grammars, [() for _ in grammars]))
    assert result.complete == [19] and not result.broken and grammars[-1].terminated
    assert len(asked) == 1  # the row that took EOS, once
    assert len(result.mask.rows) // 4 == 19  # the completed row samples unmasked
