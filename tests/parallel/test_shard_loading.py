"""Each rank builds and loads only its part of the model (no processes, no collectives: loading
never communicates): its pipeline stage's layers and its tensor-parallel slice of each tensor,
from safetensors, GGUF (q/k rows un-permuted per head) and dummy weights, the same values a
one-rank model holds there. Tensors of other stages are never read. Plus the layout arithmetic
and the bad splits it refuses, naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_gguf import write_tiny_llama_gguf
from tests.helpers.tiny_models import make_tiny_config, make_tiny_model_dir
from tokenmill.config import ParallelConfig
from tokenmill.distributed.layout import RankLayout, check_parallel, even_partition, parse_partition
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.model.arch import model_arch
from tokenmill.model.loader import SafetensorsWeights, load_model
from tokenmill.model.llama import LlamaForCausalLM


def _context(arch, tp: int, pp: int, rank: int) -> ParallelContext:
    return ParallelContext(RankLayout.of(arch, ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                              layer_partition=even_partition(arch.num_layers, pp)),
                                         rank))


def _load(path: str, arch, fmt: str, tp: int = 1, pp: int = 1, rank: int = 0):
    return load_model(path, arch, fmt, torch.float32, torch.device("cpu"), TorchRefAttentionBackend,
                      parallel=_context(arch, tp, pp, rank))


def _assert_shard_of(full: dict, part: dict, arch, layout: RankLayout) -> None:
    """Every local tensor is the slice of the one-rank model's tensor that the layout says."""
    d, r = arch.head_dim, layout.tp_rank
    q, kv = layout.num_heads * d, layout.num_kv_heads * d
    inter = layout.intermediate_size
    for name, value in part.items():
        whole = full[name]
        if "qkv_proj" in name:
            q_all, kv_all = arch.num_heads * d, arch.num_kv_heads * d
            k0, v0 = q_all + layout.kv_head_start * d, q_all + kv_all + layout.kv_head_start * d
            expected = torch.cat([whole[r * q:(r + 1) * q], whole[k0:k0 + kv], whole[v0:v0 + kv]])
        elif "gate_up_proj" in name:
            half = arch.intermediate_size
            expected = torch.cat([whole[r * inter:(r + 1) * inter], whole[half + r * inter:half + (r + 1) * inter]])
        elif "o_proj.weight" in name:
            expected = whole[:, r * q:(r + 1) * q]
        elif "down_proj.weight" in name:
            expected = whole[:, r * inter:(r + 1) * inter]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, count = layout.vocab_rows()
            expected = torch.zeros_like(value)
            expected[:count] = whole[start:start + count]
        else:
            expected = whole
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tp_ranks_hold_their_slices_from_safetensors(tmp_path, kv_heads: int) -> None:
    path = make_tiny_model_dir("qwen2", tmp_path, num_key_value_heads=kv_heads)  # qkv biases too
    arch = model_arch(make_tiny_config("qwen2", num_key_value_heads=kv_heads))
    full = dict(_load(path, arch, "safetensors").named_parameters())
    for rank in range(2):
        model = _load(path, arch, "safetensors", tp=2, rank=rank)
        layout = model.layout
        assert layout.num_kv_heads == max(1, kv_heads // 2)
        assert layout.kv_head_start == (rank if kv_heads == 2 else 0)
        _assert_shard_of(full, dict(model.named_parameters()), arch, layout)


def test_tp_and_pp_slices_from_gguf(tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    config, _ = write_tiny_llama_gguf(path)
    arch = model_arch(config)
    full = dict(_load(path, arch, "gguf").named_parameters())
    for rank in range(4):  # TP=2 x PP=2
        model = _load(path, arch, "gguf", tp=2, pp=2, rank=rank)
        params = dict(model.named_parameters())
        stage = rank // 2
        assert all(f"layers.{1 - stage}." not in name for name in params)  # one layer per stage
        assert ("model.embed_tokens.weight" in params) == (stage == 0)
        assert ("lm_head.weight" in params) == ("model.norm.weight" in params) == (stage == 1)
        _assert_shard_of(full, params, arch, model.layout)


def test_dummy_weights_are_one_model_in_every_layout(tmp_path) -> None:
    arch = model_arch(make_tiny_config("llama", tie_word_embeddings=True))
    full = dict(_load("", arch, "dummy").named_parameters())
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        for rank in range(tp * pp):
            model = _load("", arch, "dummy", tp=tp, pp=pp, rank=rank)
            params = dict(model.named_parameters())
            if "lm_head.weight" in params and "model.embed_tokens.weight" not in params:
                full_head = {"lm_head.weight": full["model.embed_tokens.weight"]}  # tied: a copy of the embedding
                _assert_shard_of(full | full_head, params, arch, model.layout)
            else:
                _assert_shard_of(full, params, arch, model.layout)


class _Recorder:
    def __init__(self, name: str, tensor, reads: list[str]) -> None:
        self.name, self.tensor, self.reads, self.shape = name, tensor, reads, tensor.shape

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.reads.append(self.name)
        return self.tensor.read(dim, start, length)


def test_a_stage_reads_only_its_tensors(tmp_path) -> None:
    path = make_tiny_model_dir("llama", tmp_path)
    arch = model_arch(make_tiny_config("llama"))
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, TorchRefAttentionBackend, _context(arch, 1, 2, 1))
    model.to_empty(device="cpu")
    reads: list[str] = []
    model.load_weights((name, _Recorder(name, t, reads)) for name, t in SafetensorsWeights(path).lazy())
    assert reads and all(not n.startswith(("model.layers.0.", "model.embed_tokens")) for n in reads), reads


def test_layout_and_bad_splits() -> None:
    arch = model_arch(make_tiny_config("llama", num_hidden_layers=5))  # 4 heads, 2 KV heads
    assert even_partition(5, 2) == (3, 2) and parse_partition("1,4", 5, 2) == (1, 4)
    layout = RankLayout.of(arch, ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=1,
                                                layer_partition=(5,)), 3)
    assert (layout.num_heads, layout.num_kv_heads, layout.kv_head_start) == (1, 1, 1)  # KV head 1 on ranks 2, 3
    assert layout.vocab_rows() == (195, 64) and layout.vocab_per_rank == 65  # 259 rows: the last shard padded
    with pytest.raises(ValueError, match="pp_layer_partition"):
        parse_partition("2,2", 5, 2)
    with pytest.raises(ValueError, match="pp_layer_partition"):
        parse_partition("5,0", 5, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's num_attention_heads"):
        check_parallel(arch, 3, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size 6"):
        check_parallel(arch, 1, 6)


def test_half_layers_split_a_layer_after_its_attention(tmp_path) -> None:
    """`16.5,15.5`-style partitions: the earlier stage holds the split layer's input norm,
    attention and KV cache, the later its post-attention norm and MLP, each loaded from the
    checkpoint (and only its half read), the same values as in one rank."""
    from tokenmill.distributed.layout import parse_layer_split
    from tokenmill.model.llama import splits_at_attention
    from tokenmill.model.registry import get_model_class

    arch = model_arch(make_tiny_config("llama", num_hidden_layers=3))
    partition, split = parse_layer_split("1.5,1.5", 3, 2)
    assert (partition, split) == ((1, 2), (True,))
    parallel = ParallelConfig(pipeline_parallel_size=2, layer_partition=partition, split_attention=split)
    first, last = (RankLayout.of(arch, parallel, r) for r in range(2))
    assert (first.layer_start, first.layer_end, first.layers_end, first.kv_layer_start, first.num_kv_layers) \
        == (0, 1, 2, 0, 2)
    assert (last.layer_start, last.layers_end, last.kv_layer_start, last.num_kv_layers) == (1, 3, 2, 1)
    assert [first.layer_part(i) for i in (0, 1)] == ["layer", "attention"]
    assert [last.layer_part(i) for i in (1, 2)] == ["mlp", "layer"]
    path = make_tiny_model_dir("llama", tmp_path, num_hidden_layers=3)
    full = dict(_load(path, arch, "safetensors").named_parameters())
    halves = {"model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.qkv_proj.weight",
              "model.layers.1.self_attn.o_proj.weight"}
    for rank, layout in enumerate((first, last)):
        reads: list[str] = []
        model = load_model(path, arch, "safetensors", torch.float32, torch.device("cpu"), TorchRefAttentionBackend,
                           parallel=ParallelContext(layout))
        params = dict(model.named_parameters())
        layer1 = {n for n in params if n.startswith("model.layers.1.")}
        assert layer1 and (layer1 == halves) == (rank == 0), layer1
        _assert_shard_of(full, params, arch, layout)
        with torch.device("meta"):
            lazy = LlamaForCausalLM(arch, TorchRefAttentionBackend, ParallelContext(layout))
        lazy.to_empty(device="cpu")
        lazy.load_weights((name, _Recorder(name, t, reads)) for name, t in SafetensorsWeights(path).lazy())
        read1 = {n for n in reads if n.startswith("model.layers.1.")}
        attention_read = {n for n in read1 if ".self_attn." in n or "input_layernorm" in n}
        assert read1 and (attention_read == read1) == (rank == 0), read1
    assert splits_at_attention(get_model_class("LlamaForCausalLM"))
    assert not splits_at_attention(get_model_class("Gemma2ForCausalLM"))
    assert not splits_at_attention(get_model_class("Qwen3MoeForCausalLM"))
    with pytest.raises(ValueError, match="pp_layer_partition must give each"):
        parse_layer_split("2.5,0.5", 3, 2)  # a stage of half a layer: no attention, no KV cache
