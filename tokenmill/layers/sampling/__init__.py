"""Sampling on the device: per-slot state (SamplingState), the sampler over it (Sampler), and the
verification of speculative steps (spec_verify, with the row layouts of spec_layout)."""

from tokenmill.layers.sampling.logprobs import LogprobsResult
from tokenmill.layers.sampling.plan import SamplingPlan
from tokenmill.layers.sampling.sampler import Sampler, SamplerOutput
from tokenmill.layers.sampling.seeded_noise import NoiseStream
from tokenmill.layers.sampling.spec_layout import flat_rows, flat_to_padded, padded_index
from tokenmill.layers.sampling.spec_verify import rejection_sample, verify_drafts
from tokenmill.layers.sampling.state import SamplingState

__all__ = ["LogprobsResult", "NoiseStream", "Sampler", "SamplerOutput", "SamplingPlan", "SamplingState",
           "flat_rows", "flat_to_padded", "padded_index", "rejection_sample", "verify_drafts"]
