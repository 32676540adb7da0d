"""Resolves `EngineArgs` into the one `EngineConfig` every process runs with.

This is the only place that reads the model's HF config, picks the device and dtype and fills
in defaults; bad arguments fail here, naming the field and the limit, before any process starts.
"""

from __future__ import annotations

import logging
import os

from tokenmill.config import (CacheConfig, EngineArgs, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig,
                              SchedulerConfig, SpeculativeConfig, StructuredOutputConfig)
from tokenmill.distributed.layout import check_parallel, parse_layer_split
from tokenmill.model.arch import model_arch
from tokenmill.model.default_model import resolve_model_path
from tokenmill.model.hf_config import load_eos_token_ids, load_hf_config
from tokenmill.quant_config import resolve_kv_cache_dtype, resolve_quantization

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "null")


def resolve_engine_config(args: EngineArgs) -> EngineConfig:
    _check_args(args)
    # The one place a model name becomes a local path (Hub ids are downloaded here): workers
    # and the tokenizer get paths only.
    weights = args.load_format not in ("dummy", "null")
    path = resolve_model_path(args.model, revision=args.revision, download_dir=args.download_dir,
                              gguf_file=args.gguf_file, weights=weights)
    tokenizer = path if args.tokenizer is None else resolve_model_path(
        args.tokenizer, revision=args.tokenizer_revision, download_dir=args.download_dir, weights=False)
    hf_config = load_hf_config(path)
    arch = model_arch(hf_config)  # unsupported models fail here
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    max_model_len = args.max_model_len or arch.max_position
    _check(1 <= max_model_len <= arch.max_position, "max_model_len",
           f"must be in [1, {arch.max_position}] (the model's max_position_embeddings), got {max_model_len}")
    max_batched = args.max_num_batched_tokens or max(8192, args.max_num_seqs)
    _check(max_batched >= 1, "max_num_batched_tokens", f"must be >= 1, got {max_batched}")
    quantization = resolve_quantization(args.quantization, _quantization_config(hf_config), args.load_format)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    model = ModelConfig(
        path=path, name=args.served_model_name or args.model, dtype=dtype, max_model_len=max_model_len,
        load_format=args.load_format, seed=args.seed, eos_token_ids=load_eos_token_ids(path, hf_config),
        arch=arch, tokenizer=tokenizer, quantization=quantization)
    parallel = resolve_parallel(args, arch, device)
    speculative = resolve_speculative(args.speculative_config, model, device, args.enforce_eager,
                                      download_dir=args.download_dir)
    if speculative is not None:
        # The first pipeline stage cannot see the drafts (it gets only each row's first token),
        # and a draft model is not split over TP ranks: refuse rather than run a half-built mode.
        _check(parallel.pipeline_parallel_size == 1, "speculative_config",
               f"cannot be combined with pipeline_parallel_size > 1 (got {parallel.pipeline_parallel_size})")
        _check(speculative.draft is None or parallel.tensor_parallel_size == 1, "speculative_config.model",
               f"a draft model cannot be combined with tensor_parallel_size > 1 "
               f"(got {parallel.tensor_parallel_size}); method 'ngram' can")
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=args.block_size, num_blocks_override=args.num_gpu_blocks_override or 0,
                          enable_prefix_caching=args.enable_prefix_caching,
                          cpu_kv_cache_bytes=int(args.kv_cache_memory_gb * (1 << 30)),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_dtype="" if kv_dtype == dtype else kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_batched,
                                  async_scheduling=args.async_scheduling,
                                  debug_check_every=args.debug_check_every,
                                  pp_microbatches=args.pp_microbatches or 0,
                                  pp_device_tokens=args.pp_device_tokens and args.pipeline_parallel_size > 1
                                  and args.speculative_config is None),
        parallel=parallel,
        device=device, max_logprobs=args.max_logprobs, log_stats=not args.disable_log_stats,
        trace_steps=os.path.abspath(args.trace_steps) if args.trace_steps else None,
        step_timeout_s=float(args.step_timeout),
        attention_backend=resolve_attention_backend(args.attention_backend, device),
        enforce_eager=args.enforce_eager,
        speculative=speculative,
        lora=resolve_lora(args, arch),
        structured=resolve_structured(args))


_LORA_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def resolve_lora(args: EngineArgs, arch) -> LoRAConfig | None:
    """`enable_lora` and its limits into a LoRAConfig (None when off)."""
    if not args.enable_lora:
        return None
    _check(arch.architecture in _LORA_ARCHS, "enable_lora",
           f"LoRA adapters are supported for {', '.join(_LORA_ARCHS)}, not {arch.architecture}")
    _check(args.max_loras >= 1, "max_loras", f"must be >= 1, got {args.max_loras}")
    _check(1 <= args.max_lora_rank <= 512, "max_lora_rank", f"must be in [1, 512], got {args.max_lora_rank}")
    cpu = args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras
    _check(cpu >= args.max_loras, "max_cpu_loras", f"must be >= max_loras ({args.max_loras}), got {cpu}")
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=cpu)


def resolve_structured(args: EngineArgs) -> StructuredOutputConfig:
    _check(args.structured_outputs_backend == "xgrammar", "structured_outputs_backend",
           f"must be xgrammar, got {args.structured_outputs_backend!r}")
    _check(args.structured_outputs_compile_timeout > 0, "structured_outputs_compile_timeout",
           f"must be > 0 seconds, got {args.structured_outputs_compile_timeout}")
    _check(args.structured_outputs_max_schema_bytes >= 1, "structured_outputs_max_schema_bytes",
           f"must be >= 1, got {args.structured_outputs_max_schema_bytes}")
    _check(args.structured_outputs_max_whitespace >= 1, "structured_outputs_max_whitespace",
           f"must be >= 1, got {args.structured_outputs_max_whitespace}")
    return StructuredOutputConfig(backend=args.structured_outputs_backend,
                                  compile_timeout_s=float(args.structured_outputs_compile_timeout),
                                  max_schema_bytes=args.structured_outputs_max_schema_bytes,
                                  max_whitespace=args.structured_outputs_max_whitespace,
                                  mask_thread=args.structured_outputs_mask_thread)


_SPEC_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
              "max_step_tokens", "min_acceptance", "revision"}
_SPEC_METHODS = ("ngram", "draft_model")


def resolve_speculative(spec: dict | None, target: ModelConfig, device: str, enforce_eager: bool = False,
                        download_dir: str | None = None) -> SpeculativeConfig | None:
    """`speculative_config` (vLLM's dict) into a SpeculativeConfig; the draft model (a path or a Hub
    id, at its optional "revision") is resolved here."""
    if spec is None:
        return None
    field = "speculative_config"
    _check(isinstance(spec, dict), field, f"must be a dict, got {type(spec).__name__}")
    unknown = set(spec) - _SPEC_KEYS
    _check(not unknown, field, f"unknown keys {sorted(unknown)}; known: {sorted(_SPEC_KEYS)}")
    method = spec.get("method", "ngram" if "model" not in spec else "draft_model")
    _check(method in _SPEC_METHODS, f"{field}.method", f"must be one of {', '.join(_SPEC_METHODS)}; got {method!r}")
    k = spec.get("num_speculative_tokens")
    _check(isinstance(k, int) and 1 <= k <= 16, f"{field}.num_speculative_tokens",
           f"must be an integer in [1, 16], got {k!r}")
    lo, hi = spec.get("prompt_lookup_min", 1), spec.get("prompt_lookup_max", 4)
    _check(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16, f"{field}.prompt_lookup_min/max",
           f"must be integers with 1 <= min <= max <= 16, got {lo!r}, {hi!r}")
    default_budget = 128 if device.startswith("cuda") else 8
    max_step_tokens = spec.get("max_step_tokens", default_budget)
    _check(isinstance(max_step_tokens, int) and max_step_tokens >= 0, f"{field}.max_step_tokens",
           f"must be an integer >= 0, got {max_step_tokens!r}")
    min_acceptance = spec.get("min_acceptance", 0.25)
    _check(isinstance(min_acceptance, (int, float)) and 0.0 <= min_acceptance < 1.0, f"{field}.min_acceptance",
           f"must be in [0, 1), got {min_acceptance!r}")
    _check(target.load_format != "null", field, "is not supported with load_format null (no model to verify with)")
    draft = None
    if method == "draft_model":
        _check(isinstance(spec.get("model"), str), f"{field}.model", "must name the draft model (a path or Hub id)")
        _check(isinstance(spec.get("revision", ""), str), f"{field}.revision", "must be a string")
        draft = _resolve_draft(spec["model"], target, spec.get("revision"), download_dir)
    else:
        _check("model" not in spec, f"{field}.model", "is only for method draft_model")
        _check("revision" not in spec, f"{field}.revision", "is only for method draft_model")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                             draft=draft, max_step_tokens=max_step_tokens, min_acceptance=float(min_acceptance),
                             padded_verification=device.startswith("cuda") and not enforce_eager)


def _resolve_draft(name: str, target: ModelConfig, revision: str | None, download_dir: str | None) -> ModelConfig:
    """The draft runs with the target's dtype, length and tokenizer (so its vocabulary must match)."""
    path = resolve_model_path(name, revision=revision, download_dir=download_dir,
                              weights=target.load_format != "dummy")
    hf_config = load_hf_config(path)
    arch = model_arch(hf_config)
    _check(arch.vocab_size == target.arch.vocab_size, "speculative_config.model",
           f"the draft's vocabulary ({arch.vocab_size} tokens) must equal the target's ({target.arch.vocab_size})")
    _check(arch.max_position >= target.max_model_len, "speculative_config.model",
           f"the draft's max_position_embeddings ({arch.max_position}) is below max_model_len ({target.max_model_len})")
    return ModelConfig(path=path, name=name, dtype=target.dtype, max_model_len=target.max_model_len,
                       load_format="dummy" if target.load_format == "dummy" else "auto", seed=target.seed,
                       eos_token_ids=target.eos_token_ids, arch=arch)


def _check_args(args: EngineArgs) -> None:
    """The checks that need nothing but the arguments themselves."""
    _check(args.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
           f"must be a power of two in [1, 128], got {args.block_size}")
    _check(args.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {args.max_num_seqs}")
    _check(args.pp_microbatches is None or args.pp_microbatches >= args.pipeline_parallel_size, "pp_microbatches",
           f"must be at least pipeline_parallel_size ({args.pipeline_parallel_size}), got {args.pp_microbatches}")
    _check(0.0 < args.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
           f"must be in (0, 1], got {args.gpu_memory_utilization}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        _check(isinstance(value, int) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        _check(not (args.single_process and value > 1), name, f"must be 1 with single_process, got {value}")
        _check(args.load_format != "null" or value == 1, name, f"must be 1 with load_format null, got {value}")
    _check(args.distributed_executor_backend in ("mp", "ray"), "distributed_executor_backend",
           f"must be mp or ray, got {args.distributed_executor_backend!r}")
    _check(not (args.single_process and args.distributed_executor_backend == "ray"), "distributed_executor_backend",
           "must be mp with single_process")
    _check(args.kv_cache_memory_gb > 0, "kv_cache_memory_gb", f"must be > 0, got {args.kv_cache_memory_gb}")
    _check(args.load_format in _LOAD_FORMATS, "load_format",
           f"must be one of {', '.join(_LOAD_FORMATS)}; got {args.load_format!r}")
    _check(args.debug_check_every >= 0, "debug_check_every", f"must be >= 0, got {args.debug_check_every}")
    _check(args.step_timeout > 0, "step_timeout", f"must be > 0 seconds, got {args.step_timeout}")
    _check(args.num_gpu_blocks_override is None or args.num_gpu_blocks_override >= 1, "num_gpu_blocks_override",
           f"must be >= 1, got {args.num_gpu_blocks_override}")


def _quantization_config(hf_config) -> dict | None:
    """The HF config's `quantization_config` as a plain dict (transformers may keep an object)."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None or isinstance(q, dict):
        return q
    return q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))


def resolve_parallel(args: EngineArgs, arch, device: str) -> ParallelConfig:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    check_parallel(arch, tp, pp)
    measured = (args.pp_layer_partition or "").strip().lower() == "measured"
    partition, split = parse_layer_split(None if measured else args.pp_layer_partition, arch.num_layers, pp)
    _check(not any(split) or not args.enable_lora, "pp_layer_partition",
           "half layers (a boundary after a layer's attention) do not take LoRA adapters (enable_lora)")
    if device.startswith("cuda") and args.distributed_executor_backend == "mp" and tp * pp > 1:
        import torch
        _check(torch.cuda.device_count() >= tp * pp, "tensor_parallel_size",
               f"times pipeline_parallel_size needs {tp * pp} GPUs, this machine has {torch.cuda.device_count()}")
    return ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, layer_partition=partition,
                          backend=args.distributed_executor_backend, balance_stages=measured and pp > 1,
                          split_attention=split if any(split) else ())


def resolve_device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    _check(name in ("cpu", "cuda") or name.startswith("cuda:"), "device",
           f"must be auto, cpu or cuda, got {name!r}")
    if name.startswith("cuda"):
        _check(torch.cuda.is_available(), "device", "is cuda but no CUDA device is available")
    return name


def resolve_attention_backend(name: str, device: str) -> str:
    _check(name in ("auto", "torch", "triton"), "attention_backend",
           f"must be auto, torch or triton, got {name!r}")
    on_cuda = device.startswith("cuda")
    if name == "auto":
        return "triton" if on_cuda and _triton_installed() else "torch"
    _check(name != "triton" or on_cuda, "attention_backend", "triton needs a CUDA device")
    _check(name != "triton" or _triton_installed(), "attention_backend", "triton is not installed")
    return name


def _triton_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def resolve_dtype(name: str, device: str) -> str:
    """The dtype to run in; the choice and its reason go to the log (INFO)."""
    dtype, reason = choose_dtype(name, device)
    logger.info("dtype %s: %s", dtype, reason)
    return dtype


def choose_dtype(name: str, device: str) -> tuple[str, str]:
    """(dtype, why). "auto": bfloat16 on CUDA and on CPUs that do bf16 matrix math natively (AMX or
    AVX512-BF16), where it runs ~1.7-3x faster than float32 and, with float32 norms, softmax,
    residual stream and logits, answers as HF's float32 does on the README demo and stays at least
    as close to float32 as HF's bf16 (docs/bf16-numerics.md); float32 on other CPUs, where bf16 is
    emulated and slower."""
    on_cuda = device.startswith("cuda")
    if name == "auto":
        if on_cuda:
            return "bfloat16", "auto on CUDA"
        from tokenmill.layers import cpu_isa
        path = cpu_isa.kernel_path()
        if path.native_bf16:
            return "bfloat16", f"auto: this CPU does bf16 matrix math natively ({path.name})"
        return "float32", f"auto: this CPU has no native bf16 matrix math ({path.name} path), float32 is faster"
    _check(name in _DTYPES, "dtype", f"must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    dtype = _DTYPES[name]
    _check(on_cuda or dtype != "float16", "dtype", "float16 is not supported on CPU; use float32 or bfloat16")
    return dtype, f"--dtype {name}"


def cpu_has_fast_bf16() -> bool:
    """True when this CPU does bfloat16 matrix math natively (AMX-BF16 or AVX512-BF16)."""
    from tokenmill.layers import cpu_isa
    return cpu_isa.best_path(cpu_isa.cpu_flags()).native_bf16


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {message}")
