"""TEMPORARY greedy-only stand-in until the device sampler lands (not to be merged)."""
from dataclasses import dataclass

import torch


@dataclass
class SamplerOutput:
    sampled: torch.Tensor
    logprobs: object = None


class SamplingTensors:
    def __init__(self, max_slots, vocab_size, eos_token_ids, device):
        self.num_logprobs = 0
        self.num_prompt_logprobs = 0

    def add(self, slot, params, prompt, output):
        pass

    def remove(self, slot):
        pass

    def flush(self):
        pass


class Sampler:
    def __init__(self, tensors):
        self.tensors = tensors

    def sample(self, logits, slots):
        return SamplerOutput(logits.argmax(-1))
