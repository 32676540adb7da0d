"""Random PEFT LoRA adapters for tests, made with peft itself: `get_peft_model` / `add_adapter`
on one copy of an HF model, A and B drawn non-zero (B with `std`, large enough to change the
outputs), each saved as a PEFT folder. The PEFT model with that adapter active is the reference."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests.helpers.hf_reference import Reference, hf_greedy

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PeftAdapters:
    def __init__(self, base) -> None:
        self.model = copy.deepcopy(base)  # peft changes the model it wraps
        self.wrapped = False

    def add(self, name: str, out_dir: str | Path, rank: int = 8, alpha: float = 16, targets=ALL_SEVEN,
            seed: int = 0, std: float = 0.05, use_rslora: bool = False) -> str:
        """Adds adapter `name` and saves it; returns its PEFT folder."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                            use_rslora=use_rslora)
        if not self.wrapped:
            self.model = get_peft_model(self.model, config, adapter_name=name)
            self.wrapped = True
        else:
            self.model.add_adapter(name, config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in self.model.named_parameters():
                if f".lora_A.{name}." in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
                elif f".lora_B.{name}." in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
        self.model.save_pretrained(str(out_dir), selected_adapters=[name])
        self.model.eval()
        folder = Path(out_dir) / name
        return str(folder if (folder / "adapter_config.json").exists() else out_dir)

    def greedy(self, name: str | None, prompt_ids: list[int], max_new_tokens: int) -> Reference:
        """HF + PEFT greedy tokens with adapter `name` (None: the base model)."""
        if name is None:
            with self.model.disable_adapter():
                return hf_greedy(self.model, prompt_ids, max_new_tokens)
        self.model.set_adapter(name)
        return hf_greedy(self.model, prompt_ids, max_new_tokens)
