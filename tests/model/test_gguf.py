"""GGUF loading on a tiny llama written with gguf.GGUFWriter, as llama.cpp's converter would."""

from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch

from tests.helpers.paged_batch import PagedRunner
from tests.helpers.tiny_models import make_tiny_config
from tests.helpers.tiny_gguf import DEFAULT_TYPES, EOT_ID, write_tiny_llama_gguf
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.model import gguf_cache
from tokenmill.model.gguf_loader import GGUFWeights, hf_tensor_name
from tokenmill.model.hf_config import load_eos_token_ids, load_hf_config
from tokenmill.model.loader import load_model
from tokenmill.model.arch import model_arch

Q = gguf.GGMLQuantizationType


def test_tensors_round_trip(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    config, hf_model = write_tiny_llama_gguf(path)
    weights = GGUFWeights(str(path), model_arch(config))
    stored = {t.name: Q(t.tensor_type) for t in weights.reader.tensors}
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= set(stored.values())
    assert all(stored[name] == qtype for name, qtype in DEFAULT_TYPES.items())
    expected = hf_model.state_dict()
    loaded = dict(weights)
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        # Exact: quantized tensors are compared with their dequantized values, and q/k are un-permuted.
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_from_gguf_matches_hf(tmp_path, tied: bool) -> None:
    path = str(tmp_path / "tiny.gguf")
    _, hf_model = write_tiny_llama_gguf(path, tie_word_embeddings=tied)
    config = load_hf_config(path)  # through transformers' GGUF config parsing
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings == tied
    model = load_model(path, model_arch(config), "auto", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
    prompt = torch.randint(3, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    dims = model.dims
    runner = PagedRunner(model, dims.num_layers, dims.num_kv_heads, dims.head_dim, num_seqs=1, max_len=20)
    logits = runner.step([prompt], [len(prompt)])
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_eos_ids_and_config_are_cached(tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    config, _ = write_tiny_llama_gguf(path)
    assert load_eos_token_ids(path, load_hf_config(path)) == (config.eos_token_id, EOT_ID)
    assert (gguf_cache.entry_dir(path, "config") / "config.json").is_file()


def test_unsupported_type_names_tensor_and_type(tmp_path) -> None:
    path = str(tmp_path / "bad.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 64 // block_size * type_size), dtype=np.uint8),
                      raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = model_arch(make_tiny_config("llama"))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*Q8_1"):
        list(GGUFWeights(path, arch))


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_k_norm.weight") == "model.layers.12.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
