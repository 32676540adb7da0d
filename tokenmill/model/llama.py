"""The Llama family as one module: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Tokens arrive flat ([T]); attention over the paged KV cache is delegated to an
`AttentionBackend`. q/k/v and gate/up are fused projections; `load_weights` maps
HF tensor names onto their slices.

Model parallelism (`ParallelContext`, see `tokenmill.distributed.layout`): a rank builds only
its pipeline stage's layers (the embedding on the first stage, the final norm and LM head on
the last) and, within them, only its tensor-parallel shard; `load_weights` reads just that
slice of each checkpoint tensor. A stage that is not the last returns `IntermediateTensors`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.distributed.layout import RankLayout
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers import qk_norm, triton_ops
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm, add_in_matmul, residual_stream, stage_handover
from tokenmill.layers.parallel_linear import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tokenmill.layers.rotary import RotaryEmbedding, RotaryStep
from tokenmill.model import tp_overlap
from tokenmill.model.intermediate import IntermediateTensors
from tokenmill.model.quant_loading import load_quantized_param, quantized_layout
from tokenmill.model.weight_source import LazyTensor, read_slice, tensor_shape


class LlamaAttention(nn.Module):
    """This rank's query and KV heads (`RankLayout`); o_proj sums the ranks' outputs. Layer
    `layer`'s `AttentionSpec` (window, soft-cap) goes to its backend; `norm_cls` makes the q/k
    norms where the model has them."""

    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend], parallel: ParallelContext,
                 layer: int = 0, norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        layout = parallel.layout
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, dims.head_dim
        self.q_size = self.num_heads * dims.head_dim
        self.kv_size = self.num_kv_heads * dims.head_dim
        self.qkv_proj = Linear(dims.hidden_size, self.q_size + 2 * self.kv_size, bias=dims.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, dims.hidden_size, dims.o_bias, parallel)
        if dims.qk_norm:
            self.q_norm = norm_cls(dims.head_dim, dims.rms_norm_eps)
            self.k_norm = norm_cls(dims.head_dim, dims.rms_norm_eps)
        self.qk_norm = dims.qk_norm
        # q/k from a float32 qkv, rounded once (qk_norm.qkv_float32): measured closer to float32 than HF
        # for Qwen3's plain RMSNorm on the GPU; Gemma's offset norms measured worse there, so they keep
        # the bf16 projection.
        self.qk_norm_f32 = dims.qk_norm and norm_cls is RMSNorm
        spec = dims.layer_spec(layer)
        self.attn = attn_backend_cls(self.num_heads, self.num_kv_heads, dims.head_dim, dims.attention_scale,
                                     spec.sliding_window, spec.logit_softcap)

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None, lora_into: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output, plus `residual` when given (added inside the o_proj matmul where it can);
        `lora_into`: the stream the output is added to next (o_proj's LoRA delta may go there)."""
        qkv32 = qk_norm.qkv_float32(self.qkv_proj, hidden) if self.qk_norm_f32 else None
        qkv = qkv32 if qkv32 is not None else self.qkv_proj(hidden)  # (its LoRA deltas included: `Linear.rebind`)
        out = self.attend(qkv, rope, kv_cache, meta, hidden.dtype, o_proj_reads=True)
        if residual is None:
            return self.o_proj(out, lora_into)
        return self.o_proj.forward_add(out, residual)

    def o_proj_reads_attend_output(self) -> bool:
        """Whether this attention's own forward hands `attend`'s output to o_proj alone (`attend(...,
        o_proj_reads=True)`) over the Triton backend, whose kernels can store it permuted
        (`quantization.int4_kperm` links such an attention to an INT4 o_proj)."""
        from tokenmill.layers.attention.triton_backend import TritonAttentionBackend

        return (type(self).forward is LlamaAttention.forward and type(self).attend is LlamaAttention.attend
                and type(getattr(self, "attn", None)).forward is TritonAttentionBackend.forward)

    def attend(self, qkv: torch.Tensor, rope: RotaryStep, kv_cache: torch.Tensor, meta: AttentionMetadata,
               act_dtype: torch.dtype | None = None, o_proj_reads: bool = False) -> torch.Tensor:
        """From the qkv projection's output to the input of o_proj ([tokens, q_size]): q/k norms,
        rotary, the KV-cache write and attention. A float32 `qkv` of a half-precision model
        (`act_dtype`; q/k-norm families on CUDA, `qk_norm.qkv_float32`) is rounded once, after them.
        `o_proj_reads`: the caller hands the result, as it is, to o_proj alone (`forward`), so an INT4
        o_proj may get it in its swapped GEMM's K order (`quantization.int4_kperm`, marked)."""
        qkv32 = qkv if self.qk_norm and act_dtype is not None and qkv.dtype != act_dtype else None
        num_tokens = qkv.shape[0]
        fused = False  # rotary and the KV-cache write in one kernel (the attention backend's)
        if qkv32 is not None:  # half precision: q/k norm and rotary from the float32 projection, one rounding
            q, k, v = qk_norm.norm_rope(qkv32, self.q_size, self.kv_size, self.head_dim, self.q_norm, self.k_norm,
                                        rope, act_dtype)
        elif self.qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rope.rotate_pair(q, k)
        elif self.attn.fuses_rope(rope, kv_cache):  # q, k and v as views of qkv's heads (two ops)
            fused = True
            q, k, v = qkv.view(num_tokens, -1, self.head_dim).split(
                [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        else:
            # q and k sit side by side in qkv: rotate all their heads in one pass.
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                          self.head_dim)
            q, k = rope.rotate(qk).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary = {"rope": rope} if fused else {}
        if o_proj_reads and "_int4_kperm_reader" in self.__dict__:
            from tokenmill.layers.quantization import int4_kperm
            if int4_kperm.wanted(self, q, num_tokens, self.q_size, q.dtype):
                out = self.attn.forward(q, k, v, kv_cache, meta, **rotary, kperm=True).reshape(-1, self.q_size)
                return int4_kperm.mark(out, True)
        return self.attn.forward(q, k, v, kv_cache, meta, **rotary).reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    """This rank's rows of the intermediate size: gate_up holds [gate shard | up shard]."""

    def __init__(self, dims: ModelArch, parallel: ParallelContext) -> None:
        super().__init__()
        size = parallel.layout.intermediate_size
        self.gate_up_proj = Linear(dims.hidden_size, 2 * size, bias=dims.mlp_bias)
        self.down_proj = RowParallelLinear(size, dims.hidden_size, dims.mlp_bias, parallel)
        self.silu = dims.hidden_act == "silu"
        # The activation's output has one reader, down_proj (this forward's contract; a subclass with
        # its own forward does not inherit it): fp8 may leave it unwritten when down_proj reads its
        # codes alone (`quantization.fp8.mark_fused_producers`).
        self.act_feeds_only_down = type(self).forward is LlamaMLP.forward
        self.act = SiluAndMul() if self.silu else GeluTanhAndMul()
        # gate_up's output is [gate | up] halves read through `run_silu_mul`: an INT4 method may keep
        # its channels paired so that its GEMV writes the product (`int4.pair_gate_up`)
        self.gate_up_proj.silu_halves = self.silu

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora_into: torch.Tensor | None = None) -> torch.Tensor:
        """MLP output, plus `residual` when given (added inside the down_proj matmul where it can);
        `lora_into`: the stream the output is added to next (down_proj's LoRA delta may go there)."""
        if self.silu:  # (fused where it can: packed matmuls, or LoRA's expand with the activation on CUDA)
            act = self.gate_up_proj.run_silu_mul(x, self.act, self.down_proj)
        else:
            act = self.act(self.gate_up_proj(x))
        if residual is None:
            return self.down_proj(act, lora_into)
        return self.down_proj.forward_add(act, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend], parallel: ParallelContext,
                 layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(dims, attn_backend_cls, parallel, layer)
        self.mlp = LlamaMLP(dims, parallel)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        # The sublayers' outputs join the float32 stream unrounded (CPU bf16: `wide_linear`).
        self.self_attn.o_proj.wide_output = self.mlp.down_proj.wide_output = True
        # Both feed `forward_with_residual` directly: with TP on CUDA their all-reduce runs fused
        # with the residual add and the next RMSNorm (`PendingAllReduce`).
        self.self_attn.o_proj.defer_reduce = self.mlp.down_proj.defer_reduce = True
        # Each norm's output has one reader, the linear after it (qkv_proj, gate_up_proj: this class's
        # forwards and LlamaAttention's / LlamaMLP's own, as `tp_overlap` redoes them): fp8 may leave
        # it unwritten when that linear reads its codes alone (`quantization.fp8.mark_fused_producers`).
        self.norms_feed_only_linears = (
            all(getattr(type(self), f) is getattr(LlamaDecoderLayer, f) for f in ("forward", "forward_attention",
                                                                                  "forward_mlp"))
            and type(self.self_attn).forward is LlamaAttention.forward and type(self.mlp).forward is LlamaMLP.forward)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream is `hidden + residual` (residual None: just `hidden`), so pipeline
        stages can hand both over. The stream is float32 (`norm.residual_stream`); each residual add
        happens in the RMSNorm after it (one fused kernel on CUDA), and the layer returns
        (mlp output, residual). Where the activations are float32 on CPU, each add runs in the
        epilogue of the matmul before it instead (o_proj, down_proj: oneDNN), and the layer
        returns the whole stream as `hidden`. The two halves may run on two pipeline stages
        (`layout.py`'s half layers): what `forward_attention` returns is a stream like any other."""
        if self._int4_fold is not False and self._folds(hidden):
            return self._forward_folded(hidden, residual, rope, kv_cache, meta)
        hidden, residual = self.forward_attention(hidden, residual, rope, kv_cache, meta)
        return self.forward_mlp(hidden, residual)

    _int4_fold: bool | None = None  # whether `int4_norm_fold` fits this layer (None: not asked yet)
    _next_input_norm: nn.Module | None = None  # the next layer's on this stage (set by LlamaModel, unregistered)

    def _folds(self, hidden: torch.Tensor) -> bool:
        """INT4 at up to 8 rows: norms and residual adds in the GEMVs (`quantization.int4_norm_fold`)."""
        if not hidden.is_cuda or hidden.dim() != 2 or hidden.shape[0] > 8 or not triton_ops.enabled(hidden):
            return False
        if self._int4_fold is None:
            from tokenmill.layers.quantization import int4_norm_fold

            self._int4_fold = (type(self).forward is LlamaDecoderLayer.forward and self.norms_feed_only_linears
                               and int4_norm_fold.layer_fits(self))
        return self._int4_fold

    def _forward_folded(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep,
                        kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        """`forward` in four GEMV launches and attention: returns the stream (float32, updated in place)."""
        from tokenmill.layers.quantization import int4_norm_fold as fold

        carry = fold.take_carry(residual if residual is not None else hidden)  # (another layer's, if any)
        if residual is None:  # the stream itself (a folded layer's: with what its last add made)
            stream = residual_stream(hidden)
            carry = carry if stream is hidden else None
        else:
            stream, carry = residual.add_(hidden), None
        attn, mlp = self.self_attn, self.mlp
        qkv = fold.input_gemv(attn.qkv_proj, stream, self.input_layernorm, carry)
        out = attn.attend(qkv, rope, kv_cache, meta, self.input_layernorm.weight.dtype)
        carry = fold.add_gemv(attn.o_proj, out, stream, self.post_attention_layernorm)
        act = fold.input_gemv(mlp.gate_up_proj, stream, self.post_attention_layernorm, carry, silu=True)
        fold.keep_carry(stream, fold.add_gemv(mlp.down_proj, act, stream, self._next_input_norm))
        return stream, None

    def forward_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep,
                          kv_cache: torch.Tensor, meta: AttentionMetadata
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The input norm and attention: (attention output, residual), or (the stream with the
        attention output added in o_proj's matmul, None)."""
        act_dtype = self.input_layernorm.weight.dtype  # the model's (a sublayer output may be float32)
        if residual is None:
            residual, hidden = residual_stream(hidden), self.input_layernorm(hidden, out_dtype=act_dtype)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual, act_dtype)
        if add_in_matmul(hidden, residual) or self._wide_adds(hidden, residual):
            return self.self_attn(hidden, rope, kv_cache, meta, residual=residual), None
        # o_proj's and down_proj's LoRA deltas may go straight into the stream (off the critical
        # path: beside their GEMMs); families with other sublayers pass nothing.
        if type(self.self_attn).forward is LlamaAttention.forward:
            return self.self_attn(hidden, rope, kv_cache, meta, lora_into=residual), residual
        return self.self_attn(hidden, rope, kv_cache, meta), residual

    def forward_mlp(self, hidden: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The post-attention norm and MLP, from what `forward_attention` returned."""
        act_dtype = self.post_attention_layernorm.weight.dtype
        if residual is None:  # the stream: the MLP's output is added in down_proj's matmul
            normed = self.post_attention_layernorm(hidden, out_dtype=act_dtype)
            return self.mlp(normed, residual=hidden), None
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual, act_dtype)
        if type(self.mlp).forward is LlamaMLP.forward:
            return self.mlp(hidden, lora_into=residual), residual
        return self.mlp(hidden), residual

    def _wide_adds(self, hidden: torch.Tensor, residual: torch.Tensor) -> bool:
        """CPU bf16: o_proj and down_proj write float32 (`wide_linear`), so each residual add runs in
        their GEMM's epilogue (one pass over the stream, no separate add)."""
        mlp = getattr(self, "mlp", None)  # (None: a half layer's attention, whose MLP runs on the next stage)
        return residual.dtype == torch.float32 and hidden.dtype != residual.dtype \
            and self.self_attn.o_proj.wide(hidden) and isinstance(mlp, LlamaMLP) and mlp.down_proj.wide(hidden)


class LlamaModel(nn.Module):
    """This stage's decoder layers (the others are empty placeholders, so names keep their HF
    layer index), with the embedding on the first stage and the final norm on the last.

    Families with other layers or norms set `layer_cls` / `norm_cls` (e.g. `model/gemma2.py`,
    `model/moe_decoder.py`).
    Layers whose `AttentionSpec` has its own rope get their own rotary tables (one per distinct
    setting, prepared once per step)."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend], parallel: ParallelContext) -> None:
        super().__init__()
        layout = parallel.layout
        self.layout = layout
        self.parallel = parallel
        self.embed_tokens = (VocabParallelEmbedding(layout.vocab_per_rank, dims.hidden_size, parallel)
                             if layout.is_first_stage else None)
        self.rotary_emb = RotaryEmbedding(dims.head_dim, dims.max_position, dims.rope)
        ropes = [dims.rope]
        self._rope_of_layer = []
        for i in range(dims.num_layers):
            rope = dims.layer_spec(i).rope or dims.rope
            if rope not in ropes:
                ropes.append(rope)
            self._rope_of_layer.append(ropes.index(rope))
        self.extra_rotary_embs = nn.ModuleList(RotaryEmbedding(dims.head_dim, dims.max_position, r)
                                               for r in ropes[1:])
        if layout.has_split_layers and self.layer_cls is not LlamaDecoderLayer:
            raise ValueError(f"pp_layer_partition: half layers (a stage boundary after a layer's attention) need "
                             f"the plain Llama decoder layer; {dims.architecture} has {self.layer_cls.__name__}")
        self.layers = nn.ModuleList(
            _stage_part(self.layer_cls(dims, attn_backend_cls, parallel, i), layout.layer_part(i))
            if layout.has_layer(i) else nn.Identity()
            for i in range(dims.num_layers))
        self.norm = self.norm_cls(dims.hidden_size, dims.rms_norm_eps) if layout.is_last_stage else None
        for a, b in zip(self.layers, self.layers[1:]):  # a folded INT4 layer's last add prepares the next's norm
            if isinstance(a, LlamaDecoderLayer) and isinstance(b, LlamaDecoderLayer) and b.input_layernorm is not None:
                object.__setattr__(a, "_next_input_norm", b.input_layernorm)  # (not a submodule: no second name)
        # What each of this stage's layers runs, fixed by the layout (asked once, not every step):
        # (layer, part, its rotary table, its KV cache's index in the stage's list).
        self._stage_plan = [(self.layers[i], layout.layer_part(i), self._rope_of_layer[i], i - layout.kv_layer_start)
                            for i in range(layout.layer_start, layout.layers_end)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """`kv_caches`: this stage's layers' caches. Stages after the first start from `intermediate`."""
        if self.embed_tokens is not None:
            hidden, residual = self.embed(input_ids), None
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous stage's activations"
            hidden = intermediate.hidden
            residual = None if intermediate.residual is None else residual_stream(intermediate.residual)
        act_dtype = hidden.dtype
        ropes = [r.prepare(positions, hidden.dtype, meta) for r in (self.rotary_emb, *self.extra_rotary_embs)]
        if tp_overlap.applies(self, hidden):  # TP: each half's all-reduces under the other half's GEMMs
            hidden, residual = tp_overlap.run_layers(self, hidden, residual, ropes, kv_caches, meta)
        else:
            for layer, part, rope, kv in self._stage_plan:
                if part == "mlp":  # the previous stage ran this layer's attention
                    hidden, residual = layer.forward_mlp(hidden, residual)
                    continue
                run = layer.forward_attention if part == "attention" else layer
                hidden, residual = run(hidden, residual, ropes[rope], kv_caches[kv], meta)
        if self.norm is None:
            return IntermediateTensors(*stage_handover(hidden, residual, act_dtype))
        if residual is None:  # (the stream itself: float32 where the layers add in their matmuls)
            return self.norm(hidden) if hidden.dtype == act_dtype else self.norm(hidden, out_dtype=act_dtype)
        return self.norm.forward_with_residual(hidden, residual, act_dtype)[0]


def splits_at_attention(model_cls: type[nn.Module]) -> bool:
    """Whether a causal-LM class's pipeline stages can split a layer after its attention (half
    layers: the plain Llama decoder layer)."""
    return getattr(getattr(model_cls, "model_cls", None), "layer_cls", None) is LlamaDecoderLayer


def _stage_part(layer: nn.Module, part: str) -> nn.Module:
    """`layer` keeping only what this stage runs of it: all, or a half layer's attention (input
    norm + attention) or MLP (post-attention norm + MLP)."""
    drop = {"attention": _MLP_HALF, "mlp": _ATTENTION_HALF}.get(part, ())
    for name in drop:
        setattr(layer, name, None)
    return layer


# A decoder layer's halves, by submodule (and checkpoint name: model.layers.N.<submodule>.*).
_ATTENTION_HALF = ("input_layernorm", "self_attn")
_MLP_HALF = ("post_attention_layernorm", "mlp")

# HF per-projection names -> (our fused parameter, shard index) in stacking order.
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Checkpoint tensors that carry nothing we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, arch: ModelArch, attn_backend_cls: type[AttentionBackend],
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.dims = arch
        self.parallel = parallel or ParallelContext.single(arch)
        self.layout: RankLayout = self.parallel.layout
        self.model = self.model_cls(arch, attn_backend_cls, self.parallel)
        # Tied: the LM head reads embed_tokens.weight directly, so no tie can break on device moves;
        # a last pipeline stage without the embedding holds its own copy, loaded from it.
        layout = self.layout
        own_head = layout.is_last_stage and (not arch.tie_word_embeddings or not layout.is_first_stage)
        self.lm_head = VocabParallelEmbedding(layout.vocab_per_rank, arch.hidden_size, self.parallel) \
            if own_head else None
        self._lm_head = ParallelLMHead(self.parallel)

    def _loaded_elsewhere(self, name: str) -> bool:
        """A parameter a family's own loader fills (never in the generic pending set)."""
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None, gather: bool = True
                       ) -> torch.Tensor:
        """float32 logits [rows, V]; in `out` when given. `gather=False`: this TP rank's vocab
        columns only (`logits_head.gather` / `.argmax` finish them)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self._lm_head.logits(hidden, weight, out, gather)
        cap = self.dims.final_logit_softcap
        if cap is not None:  # HF: logits / c, tanh, * c
            logits = torch.tanh(logits.div_(cap), out=logits).mul_(cap)
        return logits

    @property
    def logits_head(self) -> ParallelLMHead:
        return self._lm_head

    def intermediate_shapes(self, num_tokens: int) -> list[tuple[int, ...]]:
        """What a stage hands the next: the hidden state, plus the residual where the fused
        kernels keep it apart (CUDA)."""
        hidden = (num_tokens, self.dims.hidden_size)
        probe = next(self.parameters())
        return [hidden, hidden] if triton_ops.enabled(probe) else [hidden]

    def _shard_sizes(self, fused: str) -> list[int]:
        """The local sizes of a fused parameter's parts, in stacking order."""
        d, layout = self.dims, self.layout
        if fused == "qkv_proj":
            return [layout.num_heads * d.head_dim, layout.num_kv_heads * d.head_dim, layout.num_kv_heads * d.head_dim]
        return [layout.intermediate_size, layout.intermediate_size]

    def _source_slice(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """(dim, start, length) of the checkpoint tensor this rank holds for parameter `name`
        (part `shard` of a fused one); None: the whole tensor (replicated)."""
        layout, d = self.layout, self.dims
        if layout.tp_size == 1:
            return None
        kind = name.split(".")[-2]
        suffix = name.rsplit(".", 1)[-1]
        if kind == "qkv_proj":
            if shard == 0:
                return 0, layout.tp_rank * layout.num_heads * d.head_dim, layout.num_heads * d.head_dim
            return 0, layout.kv_head_start * d.head_dim, layout.num_kv_heads * d.head_dim
        if kind == "gate_up_proj":
            return 0, layout.tp_rank * layout.intermediate_size, layout.intermediate_size
        if kind in ("o_proj", "down_proj") and suffix != "bias":  # weight, or a quantized format's tensor
            size = layout.num_heads * d.head_dim if kind == "o_proj" else layout.intermediate_size
            return 1, layout.tp_rank * size, size
        if kind in ("embed_tokens", "lm_head"):
            return (0, *layout.vocab_rows())
        return None

    def _on_other_stage(self, hf_name: str) -> bool:
        """A checkpoint tensor another pipeline stage holds (never read here)."""
        layout = self.layout
        parts = hf_name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            index = int(parts[2])
            if index < self.dims.num_layers and layout.has_layer(index) and len(parts) > 3:
                other = {"attention": _MLP_HALF, "mlp": _ATTENTION_HALF}.get(layout.layer_part(index), ())
                return parts[3] in other  # the other half of a layer split between two stages
            return index < self.dims.num_layers and not layout.has_layer(index)
        if hf_name.startswith("model.embed_tokens."):
            tied_head = self.dims.tie_word_embeddings and self.lm_head is not None
            return self.model.embed_tokens is None and not tied_head
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return not layout.is_last_stage
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        """Copies HF-named tensors in (this rank's slice of each); raises ValueError naming
        unexpected, misshapen or missing ones."""
        params = dict(self.named_parameters())
        # Every (parameter, shard) that must be filled; unfused parameters have shard None.
        pending: set[tuple[str, int | None]] = set()
        for name in params:
            if self._loaded_elsewhere(name):
                continue
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f"{f}." in name), None)
            if fused is None:
                pending.add((name, None))
            else:
                pending.update((name, i) for i in range(len(self._shard_sizes(fused))))
        tied = self.dims.tie_word_embeddings
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and tied):
                continue
            if self._on_other_stage(hf_name):
                continue
            name, shard = self._map_name(hf_name)
            targets = [name] if name in params else []
            if tied and name == "model.embed_tokens.weight" and "lm_head.weight" in params:
                targets.append("lm_head.weight")  # a last stage's own copy of the tied embedding
            for target_name in targets or [name]:
                self._load_one(hf_name, tensor, target_name, shard, params)
                pending.discard((target_name, shard))
        if pending:
            missing = sorted(self._hf_name(name, shard) for name, shard in pending)
            raise ValueError(f"missing weights: {', '.join(missing)}")

    def _load_one(self, hf_name: str, tensor: torch.Tensor | LazyTensor, name: str, shard: int | None,
                  params: dict[str, nn.Parameter]) -> None:
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
        layout = quantized_layout(self, name)
        if layout is not None:  # a quantized linear's tensor: its layout says where features sit
            layer = self.get_submodule(name.rsplit(".", 1)[0])
            sizes = self._shard_sizes(name.split(".")[-2]) if shard is not None else [layer.out_features]
            part = None if shard is None else (sum(sizes[:shard]), sizes[shard])
            local = (sizes[shard if shard is not None else 0], layer.in_features)
            full = self._checkpoint_shape(name.rsplit(".", 1)[0] + ".weight", shard, local)
            load_quantized_param(param, layout, hf_name, tensor, part, full, self._source_slice(name, shard))
            return
        target = param.data
        if shard is not None:
            sizes = self._shard_sizes(name.split(".")[-2])
            target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
        expected = self._checkpoint_shape(name, shard, tuple(target.shape))
        if tensor_shape(tensor) != expected:
            raise ValueError(f"weight {hf_name!r} has shape {tensor_shape(tensor)}, expected {expected}")
        part = self._source_slice(name, shard)
        value = read_slice(tensor) if part is None else read_slice(tensor, *part)
        with torch.no_grad():
            if value.shape[0] < target.shape[0]:  # the padded last vocab shard
                target[value.shape[0]:].zero_()
                target = target[:value.shape[0]]
            target.copy_(value)

    def _checkpoint_shape(self, name: str, shard: int | None, local: tuple[int, ...]) -> tuple[int, ...]:
        """The full checkpoint tensor's shape for a local (sharded) parameter of shape `local`."""
        layout, d = self.layout, self.dims
        if layout.tp_size == 1:
            return local
        kind = name.split(".")[-2]
        suffix = name.rsplit(".", 1)[-1]
        full = list(local)
        if kind == "qkv_proj":
            full[0] = (d.num_heads if shard == 0 else d.num_kv_heads) * d.head_dim
        elif kind == "gate_up_proj":
            full[0] = d.intermediate_size
        elif kind in ("o_proj", "down_proj") and suffix == "weight":
            full[1] = d.num_heads * d.head_dim if kind == "o_proj" else d.intermediate_size
        elif kind in ("embed_tokens", "lm_head"):
            full[0] = d.vocab_size
        return tuple(full)

    @staticmethod
    def _map_name(hf_name: str) -> tuple[str, int | None]:
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return hf_name, None

    @staticmethod
    def _hf_name(name: str, shard: int | None) -> str:
        if shard is None:
            return name
        parts = name.split(".")
        hf_proj = next(k for k, v in _FUSED_SHARDS.items() if v == (parts[-2], shard))
        return ".".join(parts[:-2] + [hf_proj, parts[-1]])
