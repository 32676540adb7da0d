"""Random PEFT LoRA adapters for tests: made with peft itself (`get_peft_model`), B drawn
non-zero so the adapter changes the outputs, saved as a PEFT folder; the PEFT model is the
reference."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base, out_dir: str | Path, rank: int = 8, alpha: float = 16, targets=ALL_SEVEN,
                 seed: int = 0, std: float = 0.05, use_rslora: bool = False):
    """Saves an adapter of `base` (an HF model, not changed) into `out_dir`; returns the PEFT
    model (float32, eval) for reference outputs."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=True)
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (std if "lora_B" in name else 0.1))
    model.save_pretrained(str(out_dir))
    return model.eval()
