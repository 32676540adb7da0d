"""Sampling on the device: per-slot state (SamplingState) and the sampler over it (Sampler)."""

from tokenmill.layers.sampling.logprobs import LogprobsResult
from tokenmill.layers.sampling.plan import SamplingPlan
from tokenmill.layers.sampling.sampler import Sampler, SamplerOutput
from tokenmill.layers.sampling.state import SamplingState

__all__ = ["LogprobsResult", "Sampler", "SamplerOutput", "SamplingPlan", "SamplingState"]
