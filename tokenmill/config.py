"""Configuration: what the user asked for (`EngineArgs`) and what the engine runs with (`EngineConfig`).

`EngineArgs` holds the user-facing knobs with vLLM's names. The front-end resolves them once
(`tokenmill.frontend.engine_config.resolve_engine_config`) into an `EngineConfig`: frozen,
typed msgspec structs holding only plain values, sent as they are to the engine core and to
every worker. No process below the front-end resolves anything again, and none needs
transformers: the model's shape travels as a `ModelArch`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

import msgspec

from tokenmill.quant_config import QuantConfig


class RopeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    # LongRoPE (rope_type "longrope", HF's "su"): per-frequency divisors for short and long
    # sequences, and the cos/sin scale (None: HF's default from factor and the original length).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    # YaRN (DeepSeek): the ramp between interpolated and extrapolated frequencies, and mscale /
    # mscale_all_dim, from which an unset attention_factor is derived
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


class AttentionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one decoder layer attends (`ModelArch.layer_specs`), read from the HF config.

    `sliding_window` W: a query at position p sees keys p-W+1..p (W keys, itself included: HF's
    `kv_idx > q_idx - W`); None: every key up to p. `rope`: the layer's own rotary embedding
    (e.g. Gemma 3's local base), None: the model's. `logit_softcap` c: scores become
    c * tanh(scores / c) before the softmax (Gemma 2), None: no capping. `sinks`: each head has a
    learned logit (the attention module's `sinks` parameter, handed to the backend) that joins the
    softmax's denominator and carries no value (gpt-oss). New kinds of layer (chunked attention)
    add fields here, defaulting to "absent".
    """

    sliding_window: int | None = None
    rope: RopeConfig | None = None
    logit_softcap: float | None = None
    sinks: bool = False


class MoEArch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A mixture-of-experts MLP, normalized from each family's config (`tokenmill.model.moe_arch`).

    Routing: scores = softmax or sigmoid of the router logits (float32); with num_groups > 1 only
    the experts of the best `topk_groups` groups compete (a group's score: its best expert's score,
    or the sum of its best two with the correction bias, DeepSeek-V3); the top_k scores are
    optionally renormalized to sum to 1, then scaled by routed_scaling_factor. Renormalized
    softmax-then-top-k equals top-k-then-softmax (Mixtral), so one rule covers both."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    scoring: str = "softmax"  # softmax | sigmoid
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # max (DeepSeek-V2) | top2_sum (DeepSeek-V3)
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (choice only)
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense (ModelArch.intermediate_size)
    # gpt-oss: the router has a bias; each expert's gate/up and down have biases; the activation is
    # "swiglu_clamped": gate clamped above at swiglu_limit, up to +-swiglu_limit, then
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate) (else "silu": silu(gate) * up).
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # silu | swiglu_clamped
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class MLAArch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """DeepSeek's multi-head latent attention: the KV cache holds, per token, the compressed latent
    (kv_lora_rank) and one decoupled rope key (qk_rope_head_dim), shared by every head."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope over interleaved pairs (DeepSeek); de-interleaved at load
    softmax_scale: float = 0.0  # qk_head_dim ** -0.5 times yarn's mscale_all_dim correction squared

    @property
    def latent_dim(self) -> int:
        """Cache entries per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class ModelArch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shape of a Llama-family model, normalized from its HF config (`tokenmill.model.arch`)."""

    architecture: str  # HF class name, e.g. LlamaForCausalLM
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    # One spec per decoder layer; () means every layer is plain full attention with `rope`.
    layer_specs: tuple[AttentionSpec, ...] = ()
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (None: head_dim ** -0.5)
    final_logit_softcap: float | None = None  # logits become c * tanh(logits / c)
    moe: MoEArch | None = None  # mixture-of-experts MLP (tokenmill/layers/moe)
    mla: MLAArch | None = None  # multi-head latent attention (DeepSeek-V2/V3)
    qk_norm_full: bool = False  # OLMoE: q/k RMSNorm over the whole projection, not per head

    def layer_spec(self, layer: int) -> AttentionSpec:
        return self.layer_specs[layer] if self.layer_specs else _FULL_ATTENTION

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_window(self) -> int | None:
        """The widest sliding window when every layer slides (KV before it is never read again:
        the KV manager releases it); None when some layer attends to everything."""
        windows = [self.layer_spec(i).sliding_window for i in range(self.num_layers)]
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    def prefix_cache_seed(self, num_prompt_tokens: int) -> int | None:
        """What a prompt's KV depends on besides its tokens, mixed into the seed of its blocks'
        hash chain (`core.block_pool.HashChain`; None: nothing). LongRoPE rotates a prompt
        longer than `original_max_position_embeddings` with its long factors from position 0
        (`layers/rotary.py`), so the blocks of such prompts and of shorter ones are never shared."""
        ropes = [self.rope, *(s.rope for s in self.layer_specs if s.rope is not None)]
        if any(r.rope_type == "longrope" and num_prompt_tokens > (r.original_max_position_embeddings or
                                                                  self.max_position) for r in ropes):
            return _LONGROPE_LONG_PROMPT
        return None


_FULL_ATTENTION = AttentionSpec()
_LONGROPE_LONG_PROMPT = 1  # mixed into the hash-chain seed of LongRoPE prompts rotated with the long factors


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str  # resolved: a Hugging Face directory or a .gguf file
    name: str  # what the user called it (served model name)
    dtype: str  # float32 | bfloat16 | float16
    max_model_len: int  # longest prompt + output, in tokens
    load_format: str  # auto | safetensors | gguf | dummy | null
    seed: int
    eos_token_ids: tuple[int, ...]
    arch: ModelArch
    tokenizer: str = ""  # resolved tokenizer location (HF directory or .gguf file); "" = `path`
    quantization: QuantConfig | None = None  # quantized linears (tokenmill.quant_config); None: float

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_size: int = 16
    num_blocks_override: int = 0  # 0: derive the number of KV blocks from the memory budget
    enable_prefix_caching: bool = True
    cpu_kv_cache_bytes: int = 1 << 30  # the KV pool's size on CPU
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights, activations, KV
    kv_cache_dtype: str = ""  # torch dtype name of the KV cache (float8_e4m3fn, float8_e5m2); "": the model's

    def kv_torch_dtype(self, model_dtype):
        import torch
        return getattr(torch, self.kv_cache_dtype) if self.kv_cache_dtype else model_dtype


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    async_scheduling: bool = True
    debug_check_every: int = 0  # every N steps, workers check their view against a digest; 0 = off
    pp_microbatches: int = 0  # pipeline micro-batches in flight; 0: one per stage
    # Pipeline parallelism: the last stage sends each step's sampled tokens to the first on the
    # devices, so a row's next step may be scheduled before its token reaches the host.
    pp_device_tokens: bool = False


class ParallelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the model is split over worker processes: rank = pp_stage * tensor_parallel_size + tp_rank.
    The driver (the one rank that replies to the engine core) is TP rank 0 of the last stage."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    layer_partition: tuple[int, ...] = ()  # decoder layers per pipeline stage (resolved: sums to num_layers)
    backend: str = "mp"  # distributed executor: mp (local worker processes) | ray (actors, several nodes)
    # Replace layer_partition at start by one balanced by measured time (`distributed.stage_balance`):
    # rank 0 times a layer, the embedding and the LM head, and every rank takes its split.
    balance_stages: bool = False
    # Per stage boundary: it falls after the attention of the later stage's first layer (half
    # layers, `distributed/layout.py`); () : every boundary between whole layers.
    split_attention: tuple[bool, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding: a proposer guesses up to `num_speculative_tokens` next tokens per
    request, the target verifies them in one step and keeps the accepted ones plus one more."""

    method: str  # ngram | draft_model
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (tried first)
    draft: ModelConfig | None = None  # draft_model: the resolved draft model
    # Adaptive speculation: a step speculates only while its tokens stay under this many (where
    # a forward pass costs about the same as a one-token-per-row step); 0 = always speculate k.
    max_step_tokens: int = 0
    min_acceptance: float = 0.25  # a draft position is proposed only while its expected acceptance is above this
    # A step that verifies drafts computes 1 + k positions for every row, drafting or not (CUDA
    # verification graphs): such a step costs rows * (1 + k) tokens against max_step_tokens.
    padded_verification: bool = False


class StructuredOutputConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Structured outputs (grammar-constrained decoding, `tokenmill.structured_output`)."""

    backend: str = "xgrammar"
    compile_timeout_s: float = 10.0  # a grammar that takes longer to compile is refused (400)
    max_schema_bytes: int = 65536  # larger schemas, regexes, grammars or choice lists are refused (400)
    max_whitespace: int = 4  # most consecutive whitespace characters between JSON tokens
    vocab_file: str = ""  # the tokenizer's vocabulary for the grammar backend, written by the front-end
    mask_thread: bool = True  # matchers advanced and masks filled on a grammar thread (off: on the core's loop)


class LoRAConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Multi-LoRA serving (`enable_lora`): adapters live in `max_loras` device slots (so a step
    mixes at most that many), with up to `max_cpu_loras` more kept in host memory (LRU)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    device: str = "cpu"  # cpu | cuda | cuda:N
    max_logprobs: int = 20
    log_stats: bool = True
    trace_steps: str | None = None  # Chrome trace file of every process's steps
    step_timeout_s: float = 300.0  # a step running longer than this kills the engine (EngineDeadError)
    attention_backend: str = "torch"  # torch (reference; CPU, tests) | triton (CUDA)
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA adapters off (enable_lora=False)
    structured: StructuredOutputConfig = StructuredOutputConfig()

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def kv_window(self) -> int | None:
        """The window past which no layer reads KV (target and draft model alike: they share the
        block tables), or None when some layer attends to everything."""
        window = self.model.arch.kv_window
        draft = self.speculative.draft if self.speculative is not None else None
        if window is None or draft is None:
            return window
        draft_window = draft.arch.kv_window
        return None if draft_window is None else max(window, draft_window)

    @property
    def torch_device(self):
        import torch
        return torch.device(self.device)


@dataclass(frozen=True)
class EngineArgs:
    """The user-facing knobs, with vLLM's names (also the CLI flags: `add_engine_flags`)."""

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
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    distributed_executor_backend: str = "mp"
    single_process: bool = False
    trace_steps: str | None = None
    debug_check_every: int = 0
    step_timeout: float = 300.0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    speculative_config: dict | None = None  # vLLM's spelling, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    # Where the model comes from (Hugging Face Hub ids: tokenmill.model.hub).
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    structured_outputs_backend: str = "xgrammar"
    structured_outputs_compile_timeout: float = 10.0
    structured_outputs_max_schema_bytes: int = 65536
    structured_outputs_max_whitespace: int = 4
    structured_outputs_mask_thread: bool = True
    quantization: str | None = None  # fp8 (online), or the checkpoint's quant_method (default: from its config)
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2
    pp_microbatches: int | None = None  # pipeline micro-batches in flight (default: one per stage)
    pp_device_tokens: bool = False  # sampled tokens go from the last stage to the first on the devices


_FLAG_HELP = {
    "model": "Hugging Face directory, .gguf file, Hugging Face Hub id (ORG/NAME, ORG/NAME:QUANT for a GGUF), "
             "or the default model's alias",
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
    "tensor_parallel_size": "tensor-parallel ranks: every layer split over this many devices (-tp)",
    "pipeline_parallel_size": "pipeline stages: the layers split over this many devices in turn (-pp)",
    "pp_layer_partition": "decoder layers per pipeline stage, comma-separated; 'even' (the default: as even as "
                          "possible) or 'measured' (balanced by timing a layer, the embedding and the LM head at start); "
                          "halves (16.5,15.5: a boundary after a layer's attention) for Llama-layer families",
    "distributed_executor_backend": "mp (local worker processes) or ray (actors, across nodes; pip install "
                                    "tokenmill[ray])",
    "single_process": "run the engine core and the worker in the caller's process (tests, debugging)",
    "trace_steps": "write a Chrome/Perfetto trace of every process's steps to this file",
    "debug_check_every": "every N steps, workers check their request state against the scheduler's digest (0 = off)",
    "step_timeout": "seconds a step may run before the engine is declared dead (a hung worker)",
    "attention_backend": "auto (triton on CUDA, torch on CPU), torch (the reference) or triton",
    "enforce_eager": "CUDA: run every step eagerly, without CUDA graphs",
    "speculative_config": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "draft_model", '
                          '"model": PATH or HUB_ID, "num_speculative_tokens": 4} (optional "revision"); optional '
                          '"max_step_tokens" (adaptive speculation: 0 = always speculate) and "min_acceptance"',
    "tokenizer": "the tokenizer's folder, .gguf file or Hub id (default: the model's)",
    "revision": "the Hub model's branch, tag or commit (default: main)",
    "tokenizer_revision": "the Hub tokenizer's branch, tag or commit (default: main)",
    "download_dir": "the Hugging Face cache to download Hub models into (default: HF_HUB_CACHE or HF_HOME's)",
    "gguf_file": "the .gguf file to use in the model's Hub repo or folder (or name the model ORG/NAME:QUANT)",
    "enable_lora": "serve LoRA adapters (PEFT folders) on top of the base model, chosen per request",
    "max_loras": "LoRA adapters on the device at once: the most distinct adapters in one step",
    "max_lora_rank": "largest LoRA rank accepted (adapters of lower rank are zero-padded to it)",
    "max_cpu_loras": "LoRA adapters kept in host memory, least recently used evicted (default: max_loras)",
    "structured_outputs_backend": "grammar library for structured outputs: xgrammar",
    "structured_outputs_compile_timeout": "seconds a grammar may take to compile before its request gets a 400",
    "structured_outputs_max_schema_bytes": "largest JSON schema, regex, grammar or choice list, in bytes",
    "structured_outputs_max_whitespace": "most consecutive whitespace characters between JSON tokens "
                                         "(a weak model cannot loop in whitespace)",
    "structured_outputs_mask_thread": "advance grammar matchers and fill token masks on a thread beside the "
                                      "engine core's loop (--no-structured-outputs-mask-thread: on the loop, "
                                      "for comparison)",
    "quantization": "fp8 (quantize a float checkpoint's linears to FP8 W8A8 at load), or the checkpoint's "
                    "quant_method (fp8, fbgemm_fp8, compressed-tensors, gptq, awq); default: from its config",
    "kv_cache_dtype": "auto (the model's dtype), fp8 / fp8_e4m3 or fp8_e5m2 (twice the KV blocks; per-layer "
                      "scales from the checkpoint, else 1.0)",
    "pp_microbatches": "pipeline micro-batches in flight, at least pipeline_parallel_size (default: one per "
                       "stage); more hide the host's turn-around between a stage's batches, smaller batches "
                       "read the weights more often",
    "pp_device_tokens": "pipeline parallelism: the last stage sends each step's sampled tokens to the first "
                        "stage device to device, so a micro-batch's next step is scheduled before its tokens "
                        "reach the host (the host's turn-around leaves the pipeline's cycle; off with "
                        "speculative decoding, and for rows under a grammar)",
}


_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}  # vLLM's


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add one --flag per EngineArgs field (vLLM's names), with --no-X for booleans."""
    defaults = EngineArgs()
    for f in fields(EngineArgs):
        if f.name == "model":
            continue
        flags = ["--" + f.name.replace("_", "-")] + ([_SHORT_FLAGS[f.name]] if f.name in _SHORT_FLAGS else [])
        default = getattr(defaults, f.name)
        text = _FLAG_HELP.get(f.name, "")
        if isinstance(default, bool):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif "dict" in str(f.type):
            parser.add_argument(*flags, type=_json_object(f.name), default=default, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}.get(
                str(f.type).replace(" | None", "").strip("'"), str)
            parser.add_argument(*flags, type=kind, default=default, help=f"{text} (default: {default})")


def _json_object(name: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{name}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name}: must be a JSON object, got {text!r}")
        return value
    return parse


def engine_args_from_flags(namespace: argparse.Namespace, model: str) -> EngineArgs:
    values = {f.name: getattr(namespace, f.name) for f in fields(EngineArgs) if f.name != "model"}
    return EngineArgs(model=model, **values)
