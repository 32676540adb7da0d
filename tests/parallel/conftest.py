"""Tiny models of several families for the model-parallel tests, and the comparison they share:
greedy tokens of a split model against the same model in one process (`helpers/invariance.py`:
a divergence only where the one-process run's top-2 logprobs are a near tie)."""

from __future__ import annotations

import pytest

from tests.helpers.invariance import assert_same_greedy, greedy_params
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=48)
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "tokenmill " * 9, "zz"]
NEW_TOKENS = 16

# family -> config overrides. Three layers: two stages split them unevenly. qwen2 with one KV
# head: fewer KV heads than TP ranks (replicated), q/k/v biases, tied embeddings (a last pipeline
# stage holds its own copy of the embedding). qwen3: q/k norms, head_dim != hidden / heads.
FAMILIES = {
    "llama": dict(arch="llama", num_hidden_layers=3),
    "qwen2-mqa-tied": dict(arch="qwen2", tie_word_embeddings=True, num_key_value_heads=1, num_hidden_layers=3),
    "qwen3": dict(arch="qwen3", num_hidden_layers=3),
    # Per-layer attention kinds (tests/helpers/tiny_models.py): Phi-3's fused q/k/v and gate/up
    # split per TP rank under a window and LongRoPE; Gemma 2's local/global soft-capped layers and
    # whole-residual stages; Gemma 3's local rope base and q/k norms.
    "phi3": dict(arch="phi3", num_hidden_layers=3),
    "gemma2": dict(arch="gemma2"),
    "gemma3": dict(arch="gemma3"),
}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel-models")
    dirs = {}
    for name, spec in FAMILIES.items():
        spec = dict(spec)
        arch = spec.pop("arch")
        dirs[name] = make_tiny_model_dir(arch, root / name, **spec)
    return dirs


@pytest.fixture(scope="session")
def one_process_reference(family_dirs):
    """family -> greedy outputs of one process, sync scheduling (logprobs=2: the near-tie rule)."""
    cache: dict[str, list] = {}

    def get(family: str):
        if family not in cache:
            with LLM(family_dirs[family], single_process=True, async_scheduling=False, **ENGINE) as llm:
                cache[family] = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        return cache[family]

    return get


def assert_matches_one_process(reference, outputs, label: str) -> None:
    assert_same_greedy(reference, outputs, label, NEW_TOKENS)


def assert_idle(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
    assert llm.scheduler_stats()["num_running"] == 0


@pytest.fixture(scope="session")
def tiny_model(family_dirs) -> str:
    return family_dirs["llama"]
