"""tokenmill: a high-throughput, memory-efficient LLM inference and serving engine."""

from tokenmill.no_pickle import forbid_pickle_if_requested

forbid_pickle_if_requested()  # before anything else is imported: see no_pickle.py

from tokenmill.cpu_threads import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # before torch loads OpenMP: see cpu_threads.py

from tokenmill.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tokenmill.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and EngineArgs pull in torch (and LLM the model code): load them on first use only,
    # so that child processes can start their own children before paying for torch.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    if name == "EngineArgs":
        from tokenmill.config import EngineArgs
        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "RequestOutputKind"]
