"""Speculative decoding on /metrics (vLLM's `spec_decode_*` names) and in `tokenmill bench serve`.

A server with an n-gram speculative config answers repetitive prompts; its counters must be
positive and consistent with each other (accepted <= draft tokens, the per-position series sum
to the accepted total, one series per draft position); a server without speculation exports
none of them; bench serve prints the speculative decoding block and records its figures.
"""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import TINY_ENGINE, start_server, stop_server
from tokenmill.cli import main

K = 3
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "max_step_tokens": 0})
SPEC_NAMES = ("tokenmill:spec_decode_num_drafts", "tokenmill:spec_decode_num_draft_tokens",
              "tokenmill:spec_decode_num_accepted_tokens", "tokenmill:spec_decode_num_accepted_tokens_per_pos")


@pytest.fixture(scope="module")
def spec_server(tiny_chat_model, tmp_path_factory):
    srv = start_server(tiny_chat_model, tmp_path_factory.mktemp("spec-server"), *TINY_ENGINE,
                       "--speculative-config", NGRAM, "--served-model-name", "tiny")
    yield srv
    assert stop_server(srv) == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def spec_samples(text: str) -> dict[str, list]:
    """Family name -> its `_total` samples, for the speculation families."""
    return {family.name: [s for s in family.samples if s.name == family.name + "_total"]
            for family in text_string_to_metric_families(text) if family.name in SPEC_NAMES}


def scrape(srv) -> dict[str, list]:
    response = httpx.get(f"{srv.base_url}/metrics", headers=srv.headers, timeout=10)
    assert response.status_code == 200
    return spec_samples(response.text)


def test_counters_after_repetitive_prompts(spec_server) -> None:
    before = scrape(spec_server)
    assert set(before) == set(SPEC_NAMES)  # exported from the start, zeros included
    assert sorted(s.labels["position"] for s in before[SPEC_NAMES[3]]) == [str(j) for j in range(K)]
    for prompt in ("abcabcabcabcabcabc", "the cat, the cat, the cat, the cat, "):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{spec_server.base_url}/v1/completions", json=body, headers=spec_server.headers,
                              timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 32
    after = scrape(spec_server)
    (drafts,), (draft_tokens,), (accepted,) = (after[name] for name in SPEC_NAMES[:3])
    per_position = {int(s.labels["position"]): s.value for s in after[SPEC_NAMES[3]]}
    assert all(s.labels["model_name"] for family in after.values() for s in family)
    assert drafts.value > 0 and draft_tokens.value > 0 and accepted.value > 0, after
    assert drafts.value <= draft_tokens.value <= K * drafts.value
    assert accepted.value <= draft_tokens.value
    assert sorted(per_position) == list(range(K)) and sum(per_position.values()) == accepted.value
    # A j-th draft is accepted only after the one before it.
    assert all(per_position[j] >= per_position[j + 1] for j in range(K - 1)), per_position
    assert drafts.value >= per_position[0]


def test_no_speculation_no_spec_metrics(server) -> None:
    """As in vLLM: a server without a speculative config exports no spec_decode_* series."""
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    assert "tokenmill:num_preemptions_total" in text and "spec_decode" not in text


def test_bench_serve_prints_and_records_speculation(spec_server, tmp_path, capsys) -> None:
    record_path, words = tmp_path / "record.json", tmp_path / "prompts.txt"
    words.write_text("one two one two one two one two\nabc abc abc abc abc abc\n")
    code = main(["bench", "serve", "--base-url", spec_server.base_url, "--api-key", spec_server.api_key,
                 "--dataset", "file", "--prompts-file", str(words), "--num-prompts", "4", "--output-len", "24",
                 "--ignore-eos", "--max-concurrency", "2", "--output-json", str(record_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "== speculative decoding ==" in out and "mean acceptance length" in out
    (run,) = json.loads(record_path.read_text())["runs"]
    assert run["completed"] == 4
    spec = run["speculative_decoding"]
    assert spec["num_drafts"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"], spec
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"] and len(spec["accepted_per_position"]) == K
    assert spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["num_drafts"]
