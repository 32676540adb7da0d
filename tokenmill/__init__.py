"""tokenmill: a high-throughput, memory-efficient LLM inference and serving engine."""

from tokenmill.no_pickle import forbid_pickle_if_requested

forbid_pickle_if_requested()  # before anything else is imported: see no_pickle.py

from tokenmill.config import EngineArgs  # noqa: E402
from tokenmill.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tokenmill.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it on first use only.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "RequestOutputKind"]
