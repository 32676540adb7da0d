"""The Hugging Face transformers baseline: one static batch through `generate`, same prompts, same weights."""

from __future__ import annotations

import os
import time

import torch

from tokenmill.model.hf_config import load_hf_config


def load_hf_model(model_config, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    path = model_config.path
    if model_config.load_format == "dummy":
        torch.manual_seed(model_config.seed)
        with torch.device(device):  # random init right on the device: minutes faster for 8B
            return AutoModelForCausalLM.from_config(load_hf_config(path), dtype=dtype).eval()
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def run_hf_generate(model_config, prompts: list[list[int]], output_len: int, dtype_name: str,
                    ignore_eos: bool, warmup_passes: int = 1, warmup_tokens: int | None = None) -> dict:
    """Static-batch `generate` over every prompt at once, timed after `warmup_passes` untimed passes
    over the same prompts (a cold baseline pays per-shape first-call costs the engine never does);
    `warmup_tokens` shortens those passes (the same kernels run; only the cache length differs)."""
    dtype = getattr(torch, dtype_name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_model(model_config, dtype, device).to(device)
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(max_new_tokens=output_len, do_sample=False, pad_token_id=pad)
    if ignore_eos:
        kwargs["min_new_tokens"] = output_len
    warm = dict(kwargs)
    if warmup_tokens is not None:
        warm.update(max_new_tokens=warmup_tokens, min_new_tokens=warmup_tokens if ignore_eos else 0)
    for _ in range(warmup_passes):
        model.generate(ids, attention_mask=mask, **warm)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    num_out = int((out[:, width:] != pad).sum()) if not ignore_eos else len(prompts) * output_len
    return {"elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_out + sum(len(p) for p in prompts)) / elapsed,
            "num_output_tokens": num_out, "dtype": dtype_name, "batching": "static",
            "experts_implementation": getattr(model.config, "_experts_implementation", None)}
