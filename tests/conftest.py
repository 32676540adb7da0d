"""Session-wide fixtures: the real default model, loaded once (skipped when its package is absent,
a failure when CI is set: tests/helpers/requirements.py); per-test timeouts by marker."""

from __future__ import annotations

import os
import shutil

# Without a GPU, Triton kernels run in Triton's interpreter. Triton reads this when it is first
# imported, and transformers may import it while any test module is collected: set it first.
if not os.path.exists("/dev/nvidia0") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test process's own torch work (HF references, in-process engines, GPTQ) as the engine's
# processes run theirs (`tokenmill.cpu_threads.set_openmp_defaults`): idle OpenMP threads sleep
# instead of spinning. With `-n 2` on two cores each worker's spinning threads took the cores from
# the other's work: the 8 tiny-family bf16 deviation tests took 89 and 142 s with libgomp's
# default, 38 and 45 s with this (a shared two-core machine). libgomp reads it when torch loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.helpers.requirements import require_smollm2

# pytest-timeout: every test has `timeout` of pyproject.toml (seconds, each of setup, call and
# teardown); the marked ones get more, unless they set their own with @pytest.mark.timeout.
SLOW_TIMEOUT_S = 1200  # the real model; its slowest test (16 prompts vs HF) took 547 s on a loaded machine


def soak_timeout_s() -> float:
    """The soak runs TOKENMILL_SOAK_S seconds (60 by default), then settles and reconciles."""
    return 600 + 2 * float(os.environ.get("TOKENMILL_SOAK_S", "60"))


# The heaviest files (test-time sums of a CI run; test_decode_fusions left the list at 26 s once its
# 16-split cases went), scheduled first: `-n 2 --dist loadfile` hands each worker the next file in
# collection order, so a heavy file collected last would run alone at the end.
HEAVY_FIRST = (
    "engine/test_quantized_smollm2.py", "layers/test_int4_norm_fold.py",
    "parallel/test_split_equals_one_process.py", "server/test_engine_faults.py", "server/test_soak.py",
    "layers/test_attention_interior.py", "engine/test_generate_vs_hf.py", "model/test_bf16_deviation.py",
    "parallel/test_ray_executor.py", "layers/test_int4_mma.py", "engine/test_smollm2_vs_hf.py",
)


def _heavy_rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return HEAVY_FIRST.index(path) if path in HEAVY_FIRST else len(HEAVY_FIRST)


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=_heavy_rank)  # stable: every file's own order is kept
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        if item.get_closest_marker("soak") is not None:
            item.add_marker(pytest.mark.timeout(soak_timeout_s()))
        elif item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def smollm2_llm():
    require_smollm2()
    from tokenmill import LLM
    # In-process, so tests can inspect the scheduler (llm.engine.scheduler).
    return LLM("smollm2", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5, single_process=True)


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """HF's SmolLM2 from its GGUF, through this run's saved copy (tests/helpers/hf_smollm2.py)."""
    from tests.helpers.hf_smollm2 import load_hf_smollm2
    return load_hf_smollm2(tmp_path_factory)


@pytest.fixture(autouse=True)
def _kv_pool_is_free_after_each_test(request):
    """Every test that used the shared engine must leave every KV block free."""
    yield
    if "smollm2_llm" in request.fixturenames:
        stats = request.getfixturevalue("smollm2_llm").kv_cache_stats()
        assert stats["num_requests"] == 0, f"{stats['num_requests']} requests left in the engine"
        assert stats["num_free_blocks"] == stats["num_blocks"], f"KV blocks leaked: {stats}"
