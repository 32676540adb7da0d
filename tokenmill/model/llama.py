"""The Llama family as one module: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Tokens arrive flat ([T]); attention over the paged KV cache is delegated to an
`AttentionBackend`. q/k/v and gate/up are fused projections; `load_weights` maps
HF tensor names onto their slices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.layers import triton_ops
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.linear import Linear, PackedWeight, linear, linear_add, silu_mul_linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, RotaryStep


class LlamaAttention(nn.Module):
    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.q_size = dims.num_heads * dims.head_dim
        self.kv_size = dims.num_kv_heads * dims.head_dim
        self.qkv_proj = Linear(dims.hidden_size, self.q_size + 2 * self.kv_size, bias=dims.qkv_bias)
        self.o_proj = Linear(self.q_size, dims.hidden_size, bias=dims.o_bias)
        if dims.qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
        self.qk_norm = dims.qk_norm
        self.attn = attn_backend_cls(dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output, plus `residual` when given (added inside the o_proj matmul where it can)."""
        qkv = self.qkv_proj(hidden)
        num_tokens = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rope.rotate_pair(q, k)
        else:
            # q and k sit side by side in qkv: rotate all their heads in one pass.
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                          self.head_dim)
            q, k = rope.rotate(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn.forward(q, k, v, kv_cache, meta).reshape(-1, self.q_size)
        if residual is None:
            return self.o_proj(out)
        return linear_add(out, self.o_proj.weight, self.o_proj.bias, residual, self.o_proj._packed)


class LlamaMLP(nn.Module):
    def __init__(self, dims: ModelArch) -> None:
        super().__init__()
        self.gate_up_proj = Linear(dims.hidden_size, 2 * dims.intermediate_size, bias=dims.mlp_bias)
        self.down_proj = Linear(dims.intermediate_size, dims.hidden_size, bias=dims.mlp_bias)
        self.act = SiluAndMul()
        self._gate_up_packed = (PackedWeight(), PackedWeight())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """MLP output, plus `residual` when given (added inside the down_proj matmul where it can)."""
        act = silu_mul_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias, self._gate_up_packed)
        if act is None:
            act = self.act(self.gate_up_proj(x))
        if residual is None:
            return self.down_proj(act)
        return linear_add(act, self.down_proj.weight, self.down_proj.bias, residual, self.down_proj._packed)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(dims, attn_backend_cls)
        self.mlp = LlamaMLP(dims)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream is `hidden + residual` (residual None: just `hidden`), so pipeline
        stages can hand both over. Where the fused kernels run (CUDA), each residual add happens in
        the RMSNorm kernel after it, which updates `residual` in place, and the layer returns
        (mlp output, residual). Elsewhere each add runs in the epilogue of the matmul before it
        (o_proj, down_proj: oneDNN on CPU), and the layer returns the whole stream as `hidden`."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        if triton_ops.enabled(hidden):
            attn = self.self_attn(hidden, rope, kv_cache, meta)
            hidden, residual = self.post_attention_layernorm.forward_with_residual(attn, residual)
            return self.mlp(hidden), residual
        residual = self.self_attn(hidden, rope, kv_cache, meta, residual=residual)
        hidden = self.post_attention_layernorm(residual)
        return self.mlp(hidden, residual=residual), None


class LlamaModel(nn.Module):
    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.rotary_emb = RotaryEmbedding(dims.head_dim, dims.max_position, dims.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(dims, attn_backend_cls) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, rope, kv_caches[i], meta)
        if residual is None:
            return self.norm(hidden)
        return self.norm.forward_with_residual(hidden, residual)[0]


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
    def __init__(self, arch: ModelArch, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.dims = arch
        self.model = LlamaModel(arch, attn_backend_cls)
        # Tied: the LM head reads embed_tokens.weight directly, so no tie can break on device moves.
        self.lm_head = None if self.dims.tie_word_embeddings else nn.Linear(
            self.dims.hidden_size, self.dims.vocab_size, bias=False)
        self._lm_head_packed = PackedWeight()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self._lm_head_packed).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        d = self.dims
        if fused == "qkv_proj":
            return [d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim]
        return [d.intermediate_size, d.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors in; raises ValueError naming unexpected, misshapen or missing ones."""
        params = dict(self.named_parameters())
        # Every (parameter, shard) that must be filled; unfused parameters have shard None.
        pending: set[tuple[str, int | None]] = set()
        for name in params:
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f"{f}." in name), None)
            if fused is None:
                pending.add((name, None))
            else:
                pending.update((name, i) for i in range(len(self._shard_sizes(fused))))
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and self.lm_head is None):
                continue
            name, shard = self._map_name(hf_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            target = param.data
            if shard is not None:
                sizes = self._shard_sizes(name.split(".")[-2])
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            pending.discard((name, shard))
        if pending:
            missing = sorted(self._hf_name(name, shard) for name, shard in pending)
            raise ValueError(f"missing weights: {', '.join(missing)}")

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
