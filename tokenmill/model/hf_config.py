"""Loads a model's HF config and its end-of-sequence token ids, from a HF directory or a GGUF file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from tokenmill.model import gguf_cache
from tokenmill.model.paths import check_model_path, is_gguf_file

# GGUF `general.architecture` / HF model_type -> HF architecture class name.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp marks every token that ends generation with one of these keys.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_EOS_FILE = "tokenmill_eos_token_ids.json"


def load_hf_config(path: str) -> PretrainedConfig:
    check_model_path(path)
    if not is_gguf_file(path):
        return AutoConfig.from_pretrained(path)
    entry = gguf_cache.get_or_create(path, "config", lambda d: _write_gguf_config(path, d))
    if entry is None:
        return _convert_gguf_config(path)
    return AutoConfig.from_pretrained(entry)


def load_eos_token_ids(path: str, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else the config's, else the tokenizer's.

    For a GGUF file: the eos/eot/eom ids from its tokenizer metadata.
    """
    check_model_path(path)
    if is_gguf_file(path):
        entry = gguf_cache.get_or_create(path, "config", lambda d: _write_gguf_config(path, d))
        if entry is None:
            return _read_gguf_eos_ids(path)
        return tuple(json.loads((entry / _EOS_FILE).read_text()))
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file():
        ids = _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        if ids:
            return ids
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    if ids:
        return ids
    from tokenmill.model.tokenizer import load_tokenizer  # only needed on this fallback

    return _as_ids(load_tokenizer(path).eos_token_id)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))


def _convert_gguf_config(path: str) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    if not getattr(config, "architectures", None):
        arch = _ARCHITECTURE_BY_MODEL_TYPE.get(config.model_type)
        if arch is None:
            raise ValueError(f"model {path!r}: GGUF model type {config.model_type!r} is not supported; "
                             f"supported: {', '.join(_ARCHITECTURE_BY_MODEL_TYPE)}")
        config.architectures = [arch]
    return config


def _read_gguf_eos_ids(path: str) -> tuple[int, ...]:
    import gguf

    reader = gguf.GGUFReader(path)
    ids = [int(reader.fields[k].contents()) for k in _GGUF_EOS_KEYS if k in reader.fields]
    return tuple(dict.fromkeys(ids))


def _write_gguf_config(path: str, out_dir: Path) -> None:
    _convert_gguf_config(path).save_pretrained(out_dir)
    (out_dir / _EOS_FILE).write_text(json.dumps(list(_read_gguf_eos_ids(path))))
