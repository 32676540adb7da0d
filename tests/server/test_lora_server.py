"""LoRA adapters through a real `tokenmill serve` and the official openai client: `model` picks
the adapter (tokens equal HF + PEFT's), adapters are listed in /v1/models, loaded and unloaded
at run time (--allow-runtime-lora-updating), and a bad adapter is a 400/404 while the server
keeps serving."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.lora_adapters import PeftAdapters
from tests.helpers.tiny_models import make_tiny_model_dir
from tests.server.conftest import API_KEY, TINY_ENGINE, start_server, stop_server

NEW = 8
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    path = make_tiny_model_dir("llama", root)
    peft = PeftAdapters(AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval())
    folders = {"a1": peft.add("a1", root / "adapters", rank=8, seed=1, std=0.3),
               "a2": peft.add("a2", root / "adapters", rank=4, targets=("q_proj", "down_proj"), seed=2, std=0.5),
               "big": peft.add("big", root / "adapters", rank=32, alpha=32, seed=3)}
    other = make_tiny_model_dir("qwen3", root / "other")  # head_dim 32: q/k/v shapes differ from llama's
    folders["other"] = PeftAdapters(AutoModelForCausalLM.from_pretrained(other, dtype="float32").eval()).add(
        "x", root / "other-adapters", seed=4)
    srv = start_server(path, root, *TINY_ENGINE, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "16", "--lora-modules", f"a1={folders['a1']}",
                       "--allow-runtime-lora-updating")
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    yield srv, client, peft, folders, tokenizer
    assert stop_server(srv) == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def expected(peft, tokenizer, name: str | None) -> str:
    return tokenizer.decode(peft.greedy(name, PROMPT, NEW).token_ids)


def test_model_picks_the_adapter(lora_server) -> None:
    _, client, peft, _, tokenizer = lora_server
    assert [m.id for m in client.models.list().data] == ["base", "a1"]
    assert complete(client, "a1") == expected(peft, tokenizer, "a1")
    assert complete(client, "base") == expected(peft, tokenizer, None)
    assert expected(peft, tokenizer, "a1") != expected(peft, tokenizer, None)
    with pytest.raises(openai.NotFoundError, match="a2"):
        complete(client, "a2")


def test_load_and_unload_at_run_time(lora_server) -> None:
    srv, client, peft, folders, tokenizer = lora_server
    client.post("/load_lora_adapter", body={"lora_name": "a2", "lora_path": folders["a2"]}, cast_to=str)
    assert "a2" in [m.id for m in client.models.list().data]
    assert complete(client, "a2") == expected(peft, tokenizer, "a2")
    client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=str)
    assert "a2" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        complete(client, "a2")
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=str)


@pytest.mark.parametrize("folder,error,words", [
    ("missing", openai.NotFoundError, "no adapter folder"),
    ("big", openai.BadRequestError, "exceeds max_lora_rank=16"),
    ("other", openai.BadRequestError, "expected"),
])
def test_bad_adapters_are_refused_and_the_server_keeps_serving(lora_server, tmp_path, folder, error, words) -> None:
    _, client, peft, folders, tokenizer = lora_server
    path = str(tmp_path / "nowhere") if folder == "missing" else folders[folder]
    with pytest.raises(error, match=words):
        client.post("/load_lora_adapter", body={"lora_name": "bad", "lora_path": path}, cast_to=str)
    assert "bad" not in [m.id for m in client.models.list().data]
    assert complete(client, "a1") == expected(peft, tokenizer, "a1")


def test_runtime_updating_routes_need_the_flag(server) -> None:
    """The shared server runs without --allow-runtime-lora-updating (and without --enable-lora)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "/tmp"}, cast_to=str)
