"""tokenmill: a high-throughput, memory-efficient LLM inference and serving engine.

Importing it changes nothing in the caller's process; the engine's own child processes set
themselves up in their entry points (`tokenmill.child_process.init_child_process`).
"""

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and EngineArgs pull in torch (and LLM the model code): load them on first use only,
    # so that child processes can start their own children before paying for torch.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    if name == "LoRARequest":
        from tokenmill.lora.request import LoRARequest
        return LoRARequest
    if name == "EngineArgs":
        from tokenmill.config import EngineArgs
        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "RequestOutputKind",
           "LoRARequest", "StructuredOutputsParams"]
