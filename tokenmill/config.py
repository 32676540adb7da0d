"""Frozen, typed configuration: what the user asked for (`EngineArgs`) and what the engine runs with."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    path: str  # resolved: a Hugging Face directory or a .gguf file
    name: str  # what the user called it (served model name)
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    eos_token_ids: tuple[int, ...]
    hf_config: object = field(compare=False, repr=False)  # transformers.PretrainedConfig

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # set from the memory budget when the workers start
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    async_scheduling: bool = False
    debug_check_every: int = 0  # every N steps, workers check their view against a digest; 0 = off


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device = torch.device("cpu")
    kv_cache_memory_bytes: int = 0  # CPU: the KV pool's size; 0 = derive from gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    max_logprobs: int = 20
    log_stats: bool = True
    trace_steps: str | None = None  # Chrome trace file of every process's steps


@dataclass(frozen=True)
class EngineArgs:
    """The user-facing knobs, with vLLM's names. `create_engine_config` resolves them."""

    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    device: str = "auto"
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_gb: float = 1.0  # CPU KV pool size
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_logprobs: int = 20
    async_scheduling: bool = True
    disable_log_stats: bool = False
    served_model_name: str | None = None
    world_size: int = 1
    single_process: bool = False
    trace_steps: str | None = None
    debug_check_every: int = 0

    def create_engine_config(self) -> EngineConfig:
        from tokenmill.model.default_model import resolve_model_path
        from tokenmill.model.hf_config import load_eos_token_ids, load_hf_config
        from tokenmill.model.registry import get_model_class

        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               f"must be a power of two in [1, 128], got {self.block_size}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(isinstance(self.world_size, int) and self.world_size >= 1, "world_size",
               f"must be an integer >= 1, got {self.world_size!r}")
        _check(not (self.single_process and self.world_size > 1), "world_size",
               f"must be 1 with single_process, got {self.world_size}")
        _check(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", f"must be > 0, got {self.kv_cache_memory_gb}")
        _check(self.load_format in ("auto", "safetensors", "gguf", "dummy", "null"), "load_format",
               f"must be one of auto, safetensors, gguf, dummy, null; got {self.load_format!r}")
        _check(self.debug_check_every >= 0, "debug_check_every", f"must be >= 0, got {self.debug_check_every}")

        path = resolve_model_path(self.model)
        hf_config = load_hf_config(path)
        get_model_class(hf_config)  # unsupported architectures fail here, before any process starts
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        derived_len = _max_position_embeddings(hf_config)
        max_model_len = self.max_model_len or derived_len
        _check(1 <= max_model_len <= derived_len, "max_model_len",
               f"must be in [1, {derived_len}] (the model's max_position_embeddings), got {max_model_len}")
        max_batched = self.max_num_batched_tokens or max(8192, self.max_num_seqs)
        _check(max_batched >= 1, "max_num_batched_tokens", f"must be >= 1, got {max_batched}")
        model = ModelConfig(
            path=path, name=self.served_model_name or self.model, dtype=dtype,
            max_model_len=max_model_len, load_format=self.load_format, seed=self.seed,
            eos_token_ids=load_eos_token_ids(path, hf_config), hf_config=hf_config)
        cache = CacheConfig(block_size=self.block_size, num_blocks=self.num_gpu_blocks_override or 0,
                            enable_prefix_caching=self.enable_prefix_caching)
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                                    max_model_len=max_model_len, async_scheduling=self.async_scheduling,
                                    debug_check_every=self.debug_check_every)
        device_config = DeviceConfig(device=device,
                                     kv_cache_memory_bytes=int(self.kv_cache_memory_gb * (1 << 30)),
                                     gpu_memory_utilization=self.gpu_memory_utilization)
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, device=device_config,
                            max_logprobs=self.max_logprobs, log_stats=not self.disable_log_stats,
                            trace_steps=os.path.abspath(self.trace_steps) if self.trace_steps else None)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _check(name in ("cpu", "cuda") or name.startswith("cuda:"), "device",
           f"must be auto, cpu or cuda, got {name!r}")
    if name.startswith("cuda"):
        _check(torch.cuda.is_available(), "device", "is cuda but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    _check(name in _DTYPES, "dtype", f"must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    dtype = _DTYPES[name]
    _check(not (device.type == "cpu" and dtype == torch.float16), "dtype",
           "float16 is not supported on CPU; use float32 or bfloat16")
    return dtype


def cpu_has_fast_bf16() -> bool:
    """True when this CPU does bfloat16 matrix math natively (AMX-BF16 or AVX512-BF16).

    There, bfloat16 linears run about 3x faster than float32; elsewhere bfloat16 is
    emulated and slower, so "auto" picks float32.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def _max_position_embeddings(hf_config) -> int:
    return int(getattr(hf_config, "max_position_embeddings", None) or 2048)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {message}")


_FLAG_HELP = {
    "model": "Hugging Face directory, .gguf file, or the default model's alias",
    "dtype": "auto (bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else float32), float32, bfloat16 or float16",
    "max_model_len": "longest prompt + output, in tokens (default: the model's max_position_embeddings)",
    "load_format": "auto, safetensors, gguf, dummy (random weights, for benchmarks), or null (no model: "
                   "random tokens, to measure engine overhead; --model still gives the tokenizer and config)",
    "seed": "seed for dummy weights and unseeded sampling",
    "device": "auto, cpu or cuda",
    "block_size": "tokens per KV block",
    "num_gpu_blocks_override": "fix the number of KV blocks instead of deriving it from memory",
    "kv_cache_memory_gb": "KV pool size on CPU, in GiB",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV pool",
    "enable_prefix_caching": "reuse KV blocks across requests sharing a prefix",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (default max(8192, max_num_seqs))",
    "max_logprobs": "largest logprobs / prompt_logprobs a request may ask for",
    "async_scheduling": "schedule step N+1 while step N runs",
    "disable_log_stats": "do not log engine statistics",
    "served_model_name": "the model name the API reports",
    "world_size": "worker processes, one per device (until tensor parallelism lands, >1 runs replicas)",
    "single_process": "run the engine core and the worker in the caller's process (tests, debugging)",
    "trace_steps": "write a Chrome/Perfetto trace of every process's steps to this file",
    "debug_check_every": "every N steps, workers check their request state against the scheduler's digest (0 = off)",
}


def add_engine_flags(parser) -> None:
    """Add one --flag per EngineArgs field (vLLM's names), with --no-X for booleans."""
    import argparse
    from dataclasses import fields
    defaults = EngineArgs()
    for f in fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = _FLAG_HELP.get(f.name, "")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}.get(
                str(f.type).replace(" | None", "").strip("'"), str)
            parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")


def engine_args_from_flags(namespace, model: str) -> EngineArgs:
    from dataclasses import fields
    values = {f.name: getattr(namespace, f.name) for f in fields(EngineArgs) if f.name != "model"}
    return EngineArgs(model=model, **values)
