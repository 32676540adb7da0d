"""tokenmill: a high-throughput, memory-efficient LLM inference and serving engine."""

from tokenmill.config import EngineArgs
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it on first use only.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "RequestOutputKind"]
