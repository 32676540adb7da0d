"""PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`): checked
against the base model without reading the weights, then read as per-module (A, B) pairs.

Supported: LoRA on the attention (q/k/v/o_proj) and MLP (gate/up/down_proj) projections of
every decoder layer, any rank up to `max_lora_rank`, `lora_alpha` scaling (alpha / r, or
alpha / sqrt(r) with `use_rslora`). Refused, naming what: embeddings and the LM head (as targets
or as `modules_to_save`), DoRA, LoRA biases, per-module rank or alpha patterns, pickled
`adapter_model.bin`, and any tensor whose shape does not match the base model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from tokenmill.config import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection -> (tokenmill's fused module, part of it, "column" or "row" under tensor parallelism).
TARGETS: dict[str, tuple[str, int, str]] = {
    "q_proj": ("qkv_proj", 0, "column"),
    "k_proj": ("qkv_proj", 1, "column"),
    "v_proj": ("qkv_proj", 2, "column"),
    "o_proj": ("o_proj", 0, "row"),
    "gate_proj": ("gate_up_proj", 0, "column"),
    "up_proj": ("gate_up_proj", 1, "column"),
    "down_proj": ("down_proj", 0, "row"),
}
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed", "embeddings")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this model (the message names the adapter and why)."""


class LoRANotFoundError(LoRAAdapterError):
    """An adapter folder (or its files) that does not exist."""


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    rank: int
    scaling: float  # what B is multiplied by: lora_alpha / r (rsLoRA: / sqrt(r))
    modules: frozenset[tuple[int, str]]  # (layer index, HF projection) pairs the adapter changes


def projection_shape(arch: ModelArch, module: str) -> tuple[int, int]:
    """(in_features, out_features) of an HF projection of the base model."""
    q, kv, h, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def read_adapter(path: str, arch: ModelArch, max_rank: int, name: str = "") -> PeftAdapter:
    """Check the folder against the base model (shapes from the safetensors header only)."""
    label = f"LoRA adapter {name or path!r}"
    if not os.path.isdir(path):
        raise LoRANotFoundError(f"{label}: no adapter folder at {path!r}")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoRANotFoundError(f"{label}: {CONFIG_FILE} not found in {path!r}")
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRANotFoundError(f"{label}: {WEIGHTS_FILE} not found in {path!r}" +
                                (" (adapter_model.bin is pickle, which is not read: convert it to safetensors)"
                                 if pickled else ""))
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{label}: peft_type {config.get('peft_type')!r} is not LORA")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{label}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{label}: rank r={rank} exceeds max_lora_rank={max_rank}")
    if not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{label}: lora_alpha must be a number, got {alpha!r}")
    for key, why in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                     ("modules_to_save", "modules_to_save (full copies of base modules)"),
                     ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise LoRAAdapterError(f"{label}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{label}: LoRA biases (bias={config.get('bias')!r}) are not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for target in targets:
        if any(word in target for word in _REFUSED_TARGETS):
            raise LoRAAdapterError(f"{label}: target module {target!r}: LoRA on embeddings or the LM head "
                                   f"is not supported (q/k/v/o_proj and gate/up/down_proj are)")
    modules = _check_tensors(weights, arch, rank, label)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return PeftAdapter(path, rank, float(scaling), frozenset(modules))


def _check_tensors(weights: str, arch: ModelArch, rank: int, label: str) -> set[tuple[int, str]]:
    from safetensors import safe_open

    found: dict[tuple[int, str], set[str]] = {}
    try:
        handle = safe_open(weights, framework="pt")
    except Exception as exc:  # a truncated or foreign file
        raise LoRAAdapterError(f"{label}: cannot read {WEIGHTS_FILE} ({exc})") from None
    with handle as f:
        for key in f.keys():
            match = _KEY.search(key)
            if match is None or match.group(2) not in TARGETS:
                raise LoRAAdapterError(f"{label}: tensor {key!r} is not LoRA on a supported projection "
                                       f"(q/k/v/o_proj, gate/up/down_proj); embeddings and the LM head are "
                                       f"not supported")
            layer, module, part = int(match.group(1)), match.group(2), match.group(3)
            if layer >= arch.num_layers:
                raise LoRAAdapterError(f"{label}: tensor {key!r} is for layer {layer}, but the base model "
                                       f"has {arch.num_layers} layers")
            fan_in, fan_out = projection_shape(arch, module)
            expected = (rank, fan_in) if part == "A" else (fan_out, rank)
            shape = tuple(f.get_slice(key).get_shape())
            if shape != expected:
                raise LoRAAdapterError(f"{label}: tensor {key!r} has shape {list(shape)}, expected "
                                       f"{list(expected)} for the base model (rank {rank})")
            found.setdefault((layer, module), set()).add(part)
    half = [f"layer {k[0]} {k[1]}" for k, parts in found.items() if parts != {"A", "B"}]
    if half:
        raise LoRAAdapterError(f"{label}: lora_A and lora_B must come in pairs; missing one for {half[0]}")
    if not found:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} holds no LoRA tensors")
    return set(found)


def load_adapter(adapter: PeftAdapter):
    """{(layer, HF projection): (A [r, in], B [out, r])} as CPU tensors in the file's dtype, B NOT
    yet multiplied by `adapter.scaling` (the caller does it while converting to the model's dtype:
    one pass over the tensors instead of a float32 copy first)."""
    from safetensors import safe_open

    out = {}
    with safe_open(os.path.join(adapter.path, WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            match = _KEY.search(key)
            layer, module, part = int(match.group(1)), match.group(2), match.group(3)
            pair = out.setdefault((layer, module), [None, None])
            pair[0 if part == "A" else 1] = f.get_tensor(key)
    return {k: (a, b) for k, (a, b) in out.items()}
