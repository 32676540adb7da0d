"""Hugging Face Hub ids, downloaded for real by huggingface_hub from a local Hub (tests/helpers/local_hub.py):
only the files the engine reads, generation equal to HF on the same folder, revisions by branch,
offline from the cache, the one-line errors (missing, gated, no network), GGUF files in a repo,
and Hub ids for the tokenizer and a draft model."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.hf_reference import assert_greedy_matches_hf, hf_greedy
from tests.helpers.local_hub import LocalHub
from tests.helpers.tiny_gguf import write_tiny_llama_gguf
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM, SamplingParams, cli
from tokenmill.config import EngineArgs
from tokenmill.frontend.engine_config import resolve_engine_config
from tokenmill.model.default_model import resolve_model_path
from tokenmill.model.hf_config import load_hf_config
from tokenmill.model.hub import HubModelError

REPO_ROOT = str(Path(__file__).resolve().parents[2])
REPO, GATED, GGUF_REPO, TOKEN = "tiny-org/llama", "tiny-org/gated", "tiny-org/llama-gguf", "secret-token"
ENGINE_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
# What a real repo also holds, that the engine must never fetch.
EXTRA_FILES = {"pytorch_model.bin": b"pickled twin", "original/consolidated.pth": b"pth twin",
               "onnx/model.safetensors": b"onnx export", "README.md": b"# tiny", "tiny-F16.gguf": b"a gguf twin"}


def files_of(folder: str | Path) -> dict[str, bytes]:
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Local folders: the tiny llama (branch main), another one (branch v2: other weights and
    config), and GGUF files."""
    tmp = tmp_path_factory.mktemp("hub-sources")
    main = make_tiny_model_dir("llama", tmp / "main", seed=0)
    v2 = make_tiny_model_dir("llama", tmp / "v2", seed=1, intermediate_size=96)
    write_tiny_llama_gguf(tmp / "q8.gguf", seed=2)
    write_tiny_llama_gguf(tmp / "q4.gguf", seed=3)
    return {"main": main, "v2": v2, "q8": str(tmp / "q8.gguf"), "q4": str(tmp / "q4.gguf")}


@pytest.fixture(scope="module")
def local_hub(sources):
    hub = LocalHub().start()
    hub.add(REPO, {**files_of(sources["main"]), **EXTRA_FILES})
    hub.add(REPO, files_of(sources["v2"]), branch="v2")
    hub.add(GATED, files_of(sources["main"]), gated_token=TOKEN)
    q8, q4 = Path(sources["q8"]).read_bytes(), Path(sources["q4"]).read_bytes()
    hub.add(GGUF_REPO, {"tiny-Q8_0.gguf": q8, "tiny-Q4_K_M.gguf": q4, "tiny-Q4_K_M_L.gguf": b"not this one",
                        "README.md": b"# gguf"})
    hub.add("tiny-org/two-gguf", {"a-Q8_0.gguf": q8, "b.Q8_0.gguf": q8})
    yield hub
    hub.stop()


@pytest.fixture
def hub(local_hub, monkeypatch, tmp_path) -> LocalHub:
    """The local Hub as HF_ENDPOINT, no token, online; its request log cleared."""
    monkeypatch.setenv("HF_ENDPOINT", local_hub.url)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    local_hub.requests.clear()
    return local_hub


def one_line_error(call, *args, **kwargs) -> str:
    start = time.monotonic()
    with pytest.raises(HubModelError) as err:
        call(*args, **kwargs)
    assert time.monotonic() - start < 10, "an error must come in seconds"
    message = str(err.value)
    assert "\n" not in message
    return message


def test_hub_id_downloads_only_what_the_engine_reads_and_generates_as_hf(hub, sources, tmp_path) -> None:
    cache = str(tmp_path / "cache")
    with LLM(REPO, download_dir=cache, dtype="float32", kv_cache_memory_gb=0.01, single_process=True) as llm:
        path = llm.config.model.path
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (3, 20)]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.config.model.name == REPO
    assert path.startswith(cache) and files_of(path) == files_of(sources["main"])
    assert hub.fetched() == hub.touched() == ENGINE_FILES  # no .bin/.pth twin, no subfolder, no gguf
    hf = AutoModelForCausalLM.from_pretrained(sources["main"], dtype="float32").eval()
    refs = [hf_greedy(hf, p, 8, eos_token_ids=[]) for p in prompts]
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, "hub")


def test_revision_by_branch_then_offline_from_the_cache(hub, sources, tmp_path, monkeypatch) -> None:
    cache = str(tmp_path / "cache")
    main = resolve_model_path(REPO, download_dir=cache)
    v2 = resolve_model_path(REPO, revision="v2", download_dir=cache)
    assert main != v2
    assert files_of(main) == files_of(sources["main"]) and files_of(v2) == files_of(sources["v2"])
    assert load_hf_config(v2).intermediate_size == 96 != load_hf_config(main).intermediate_size
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone: each branch finds its own snapshot
    assert resolve_model_path(REPO, download_dir=cache) == main
    assert resolve_model_path(REPO, revision="v2", download_dir=cache) == v2
    assert hub.requests == []
    message = one_line_error(resolve_model_path, GGUF_REPO + ":Q8_0", download_dir=cache)
    assert GGUF_REPO in message and "HF_HUB_OFFLINE" in message
    message = one_line_error(resolve_model_path, REPO, revision="v3", download_dir=cache)
    assert REPO in message and "'v3'" in message and "HF_HUB_OFFLINE" in message


def test_no_network_uses_the_cache_or_says_so(sources, tmp_path, monkeypatch) -> None:
    hub = LocalHub().start()
    hub.add(REPO, files_of(sources["main"]))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache = str(tmp_path / "cache")
    path = resolve_model_path(REPO, download_dir=cache)
    hub.stop()  # connection refused from now on
    assert resolve_model_path(REPO, download_dir=cache) == path
    message = one_line_error(resolve_model_path, "tiny-org/other", download_dir=cache)
    assert "'tiny-org/other'" in message and "cannot reach the Hugging Face Hub" in message


def test_missing_id_and_gated_repo_are_one_line_errors(hub, tmp_path, monkeypatch) -> None:
    cache = str(tmp_path / "cache")
    message = one_line_error(resolve_model_path, "tiny-org/missing", download_dir=cache)
    assert "'tiny-org/missing'" in message and "HF_TOKEN" in message
    with pytest.raises(HubModelError, match="tiny-org/missing"):  # a ValueError, before any process starts
        LLM("tiny-org/missing", download_dir=cache)
    message = one_line_error(resolve_model_path, REPO, revision="nope", download_dir=cache)
    assert REPO in message and "'nope'" in message and "--revision" in message
    message = one_line_error(resolve_model_path, GATED, download_dir=cache)  # 401: no token
    assert GATED in message and "gated" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", "wrong-token")  # 403: a token without access
    assert "gated" in one_line_error(resolve_model_path, GATED, download_dir=cache)
    assert hub.touched() == set()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert set(files_of(resolve_model_path(GATED, download_dir=cache))) == ENGINE_FILES


def test_sharded_weights_follow_the_index_and_bin_only_repos_are_refused(hub, tmp_path) -> None:
    sharded = make_tiny_model_dir("llama", tmp_path / "src", max_shard_size="40KB")
    shards = {n for n in files_of(sharded) if n.endswith(".safetensors")}
    assert len(shards) > 1
    hub.add("tiny-org/sharded", {**files_of(sharded), "consolidated.safetensors": b"a consolidated twin"})
    cache = str(tmp_path / "cache")
    assert files_of(resolve_model_path("tiny-org/sharded", download_dir=cache)) == files_of(sharded)
    assert "consolidated.safetensors" not in hub.touched()
    bin_only = {k: v for k, v in files_of(sharded).items() if not k.startswith("model")}
    hub.add("tiny-org/bin-only", {**bin_only, "pytorch_model.bin": b"pickle"})
    message = one_line_error(resolve_model_path, "tiny-org/bin-only", download_dir=cache)
    assert "'tiny-org/bin-only'" in message and "pytorch_model.bin" in message and "safetensors" in message
    assert "pytorch_model.bin" not in hub.touched()


def test_gguf_in_a_repo_by_quant_or_file(hub, sources, tmp_path) -> None:
    cache = str(tmp_path / "cache")
    q8 = resolve_model_path(GGUF_REPO + ":Q8_0", download_dir=cache)
    assert q8.endswith("tiny-Q8_0.gguf") and Path(q8).read_bytes() == Path(sources["q8"]).read_bytes()
    assert hub.touched() == {"tiny-Q8_0.gguf"}
    q4 = resolve_model_path(GGUF_REPO + ":q4_k_m", download_dir=cache)  # any case; not Q4_K_M_L
    assert Path(q4).read_bytes() == Path(sources["q4"]).read_bytes()
    assert resolve_model_path(GGUF_REPO, gguf_file="tiny-Q4_K_M.gguf", download_dir=cache) == q4
    assert load_hf_config(q8).architectures == ["LlamaForCausalLM"]
    assert hub.touched() == {"tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"}
    message = one_line_error(resolve_model_path, GGUF_REPO + ":Q5_K_M", download_dir=cache)
    assert "Q5_K_M" in message and "tiny-Q8_0.gguf" in message
    message = one_line_error(resolve_model_path, "tiny-org/two-gguf:Q8_0", download_dir=cache)
    assert "a-Q8_0.gguf" in message and "b.Q8_0.gguf" in message and "--gguf-file" in message
    message = one_line_error(resolve_model_path, GGUF_REPO)  # no config.json: say how to pick a GGUF
    assert ":QUANT" in message and "tiny-Q8_0.gguf" in message


def test_tokenizer_draft_and_dummy_weights_by_hub_id(hub, sources, tmp_path) -> None:
    cache = str(tmp_path / "cache")
    config = resolve_engine_config(EngineArgs(model=REPO, load_format="dummy", tokenizer=REPO, download_dir=cache,
                                              device="cpu"))
    assert config.model.tokenizer == config.model.path
    assert hub.touched() == ENGINE_FILES - {"model.safetensors"}  # dummy weights: config and tokenizer only
    spec = {"method": "draft_model", "model": REPO, "revision": "v2", "num_speculative_tokens": 2}
    config = resolve_engine_config(EngineArgs(model=sources["main"], tokenizer=REPO, speculative_config=spec,
                                              download_dir=cache, device="cpu"))
    assert config.model.path == sources["main"]
    assert files_of(config.model.tokenizer) == {k: v for k, v in files_of(sources["main"]).items()
                                                if k != "model.safetensors"}
    assert files_of(config.speculative.draft.path) == files_of(sources["v2"])


# ---------------------------------------------------------------- through `python -m tokenmill`

def run_tokenmill(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def cli_env(endpoint: str, hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home), **extra}


def test_cli_missing_id_is_one_line_and_exit_status_2(hub, tmp_path) -> None:
    proc = run_tokenmill(["generate", "--model", "tiny-org/missing", "--prompt", "hi"], cli_env(hub.url, tmp_path))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "'tiny-org/missing'" in lines[0] and "Traceback" not in proc.stderr


def test_cli_offline_from_hf_home_with_the_hub_stopped(sources, tmp_path, capsys, monkeypatch) -> None:
    """Downloaded into HF_HOME's cache, then `HF_HUB_OFFLINE=1 python -m tokenmill generate ORG/NAME`
    with the Hub gone prints what the local folder gives."""
    hub = LocalHub().start()
    hub.add(REPO, {**files_of(sources["main"]), **EXTRA_FILES})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    home = tmp_path / "hf-home"
    resolve_model_path(REPO, download_dir=str(home / "hub"))  # HF_HOME/hub: the cache HF_HOME names
    hub.stop()
    flags = ["--prompt", "hello hub", "--max-tokens", "6", "--single-process", "--dtype", "float32",
             "--kv-cache-memory-gb", "0.01"]
    proc = run_tokenmill(["--log-level", "WARNING", "generate", "--model", REPO, *flags],
                         cli_env(hub_url_gone(), home, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert cli.main(["--log-level", "WARNING", "generate", "--model", sources["main"], *flags]) == 0
    assert proc.stdout == capsys.readouterr().out and proc.stdout.strip()


def hub_url_gone() -> str:
    """An endpoint nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
