"""Quantized models that cannot run are refused at start, naming what is wrong and what is
supported; a checkpoint with a missing or mis-shaped scale names the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers.quant_formats import write_quantized_model
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM
from tokenmill.quant_config import resolve_kv_cache_dtype, resolve_quantization


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("float"))


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_gb=0.01, single_process=True, **kwargs)


@pytest.mark.parametrize("config,words", [
    ({"quant_method": "bitsandbytes"}, ["quant_method 'bitsandbytes'", "supported: fp8, fbgemm_fp8"]),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, ["bits 8", "supported: 4"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, ["group_size 48", "supported: -1, 32, 64, 128, 256"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, ["version 'gemv'", "supported: gemm"]),
    ({"quant_method": "fp8", "weight_block_size": [100, 128]}, ["weight_block_size [100, 128]"]),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized",
      "weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128}}}},
     ["bits 3", "supported: 4"]),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "float-quantized",
      "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, ["strategy 'block'", "channel, tensor"]),
])
def test_unsupported_quantization_config_is_refused(config, words):
    with pytest.raises(ValueError) as info:
        resolve_quantization(None, config)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_bad_engine_arguments_are_refused(float_dir, tmp_path):
    with pytest.raises(ValueError, match=r"quantization 'int8' is not supported; supported: fp8, fbgemm_fp8"):
        _llm(float_dir, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization 'gptq' needs a checkpoint quantized that way"):
        _llm(float_dir, quantization="gptq")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int8' is not supported; supported: auto, fp8, fp8_e4m3"):
        resolve_kv_cache_dtype("int8", "float32")
    path, _ = write_quantized_model(float_dir, tmp_path / "awq", "awq", group_size=32, with_refs=False)
    with pytest.raises(ValueError, match=r"quantization 'fp8' does not match the checkpoint's quant_method 'awq'"):
        _llm(path, quantization="fp8")


def _rewrite(path: str, edit) -> None:
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_scale_names_the_tensor(float_dir, tmp_path):
    path, _ = write_quantized_model(float_dir, tmp_path / "fp8", "fp8-channel", with_refs=False)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        _llm(path)


def test_misshapen_scale_names_the_tensor(float_dir, tmp_path):
    path, _ = write_quantized_model(float_dir, tmp_path / "gptq", "gptq", group_size=32, with_refs=False)
    name = "model.layers.0.mlp.down_proj.scales"

    def cut(t):
        t[name] = t[name][:-1].contiguous()
    _rewrite(path, cut)
    with pytest.raises(ValueError, match=rf"weight '{name}' has shape \(3, 64\), expected \(4, 64\)"):
        _llm(path)


def test_group_size_that_does_not_divide_a_layer_is_refused(float_dir, tmp_path):
    path, _ = write_quantized_model(float_dir, tmp_path / "gptq", "gptq", group_size=32, with_refs=False)
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"]["group_size"] = 256  # the tiny model's linears have 64 or 128 inputs
    (Path(path) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"64 inputs .* does not fit group size 256"):
        _llm(path)


def test_fp8_kv_cache_doubles_the_blocks(float_dir):
    plain = _llm(float_dir).kv_cache_stats()["num_blocks"]
    fp8 = _llm(float_dir, kv_cache_dtype="fp8").kv_cache_stats()["num_blocks"]
    # float32 -> one byte per element: four times the blocks in the same memory (bf16 -> fp8: twice)
    assert 4 * plain <= fp8 < 4 * (plain + 1)


def test_weight_bytes_and_kv_blocks_are_reported(float_dir, tmp_path):
    """The engine's stats (and /metrics) give the weights' real bytes and the KV pool's blocks."""
    from tokenmill.entrypoints.openai.metrics import ServerMetrics

    plain = _llm(float_dir).scheduler_stats()
    path, _ = write_quantized_model(float_dir, tmp_path / "gptq", "gptq", group_size=32, with_refs=False)
    int4 = _llm(path).scheduler_stats()
    assert plain["num_kv_blocks"] > 0 and plain["weight_bytes"] > 0
    # The linears shrink from 4 bytes per weight to about half a byte (embeddings and norms stay float32).
    assert int4["weight_bytes"] < 0.75 * plain["weight_bytes"]
    metrics = ServerMetrics("m")
    metrics.update_engine(int4)
    text = metrics.render().decode()
    assert f'tokenmill:model_weight_bytes{{model_name="m"}} {float(int4["weight_bytes"])}' in text
    assert f'tokenmill:num_kv_cache_blocks{{model_name="m"}} {float(int4["num_kv_blocks"])}' in text
