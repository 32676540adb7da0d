"""Quantized checkpoints for tests, and float64 references written from each format's spec.

`write_quantized_model` turns a tiny HF float model directory into a quantized one: every decoder
linear replaced by the format's tensors, `quantization_config` added to config.json. The packed
tensors come from tokenmill's writers (`int4_packing`), from the compressed-tensors library
(`ct-int4`, when installed), or from plain torch (fp8). `reference_weights` then decodes those
checkpoint tensors with the spec-level decoders below, which share no code with tokenmill: bit
by bit, in float64. A test loads the checkpoint in tokenmill and compares it with transformers
running the reference weights.

Specs:
- GPTQ: qweight int32 [K/8, N], input channel 8r+i in bits 4i of row r; qzeros int32 [G, N/8],
  output channel 8c+j in bits 4j of column c, stored as zero - 1 (v1); scales [G, N];
  g_idx [K]; w[n, k] = (q - z[g_idx[k], n]) * s[g_idx[k], n].
- AWQ (GEMM): qweight int32 [K, N/8] and qzeros [G, N/8]: nibble i of column c holds output
  channel 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales [G, N]; group of k is k // G.
- compressed-tensors pack-quantized: decoded by the compressed-tensors library itself.
- fp8 channel / fbgemm: weight e4m3 [N, K] times weight_scale [N, 1]; block: times
  weight_scale_inv[n // bn, k // bk].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.layers.quantization import int4_packing as packing

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_TO_CHANNEL = (0, 2, 4, 6, 1, 3, 5, 7)


def _nibble(word: int, i: int) -> int:
    return (word & 0xFFFFFFFF) >> (4 * i) & 0xF


def ref_gptq(t: dict[str, torch.Tensor], zero_offset: int = 1) -> torch.Tensor:
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].double()
    k, n = len(qweight) * 8, len(qweight[0])
    g_idx = t["g_idx"].tolist()
    w = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):
        g = g_idx[kk]
        for nn in range(n):
            q = _nibble(qweight[kk // 8][nn], kk % 8)
            z = _nibble(qzeros[g][nn // 8], nn % 8) + zero_offset
            w[nn, kk] = (q - z) * scales[g, nn].item()
    return w


def ref_awq(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].double()
    k, n = len(qweight), len(qweight[0]) * 8
    w = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):
        g = kk // group_size
        for c in range(n // 8):
            for i, j in enumerate(AWQ_NIBBLE_TO_CHANNEL):
                nn = 8 * c + j
                w[nn, kk] = (_nibble(qweight[kk][c], i) - _nibble(qzeros[g][c], i)) * scales[g, nn].item()
    return w


def ref_fp8(t: dict[str, torch.Tensor], block: tuple[int, int] | None = None) -> torch.Tensor:
    w = t["weight"].double()
    if block is None:
        return w * t["weight_scale"].double().reshape(-1, 1)
    s = t["weight_scale_inv"].double()
    rows = torch.arange(w.shape[0]) // block[0]
    cols = torch.arange(w.shape[1]) // block[1]
    return w * s[rows][:, cols]


def _fp8_rows(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    return {"weight": (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale": scale.float()}


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    bn, bk = block
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale[i, j]).clamp(-448, 448).to(q.dtype)
    return {"weight": q, "weight_scale_inv": scale}


def _ct_int4(w: torch.Tensor, group_size: int, sym: bool, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quantized and packed by the compressed-tensors library (scales from our round-to-nearest)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    codes = packing.quantize_int4(w, group_size, sym)
    scheme = ct_scheme(group_size, sym)
    state = {"weight": w, "weight_scale": codes.scales.to(scale_dtype)}
    if not sym:
        state["weight_zero_point"] = (codes.zeros - 8).to(torch.int8)
    return PackedQuantizationCompressor.compress(state, scheme)


def ct_scheme(group_size: int, sym: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    strategy = "channel" if group_size == -1 else "group"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy=strategy,
                            group_size=None if group_size == -1 else group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ref_ct_int4(t: dict[str, torch.Tensor], group_size: int, sym: bool) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    t = dict(t, weight_scale=t["weight_scale"].double())  # decoded in float64, not the scales' bf16
    return PackedQuantizationCompressor.decompress(t, ct_scheme(group_size, sym))["weight"].double()


def quantization_config(fmt: str, group_size: int = 32, sym: bool = True, desc_act: bool = False,
                        block: tuple[int, int] = (32, 32)) -> dict:
    if fmt == "fp8-channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                              "format": "float-quantized"}}}
    if fmt == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if fmt == "ct-int4":
        weights = {"num_bits": 4, "type": "int", "symmetric": sym,
                   "strategy": "channel" if group_size == -1 else "group",
                   "group_size": None if group_size == -1 else group_size}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "format": "pack-quantized"}}}
    raise ValueError(fmt)


def quantize_linear(fmt: str, w: torch.Tensor, group_size: int = 32, sym: bool = True, desc_act: bool = False,
                    block: tuple[int, int] = (32, 32), seed: int = 0, scale_dtype: torch.dtype = torch.bfloat16
                    ) -> dict[str, torch.Tensor]:
    """One linear's checkpoint tensors (names without the module prefix)."""
    if fmt in ("fp8-channel", "fbgemm"):
        out = _fp8_rows(w)
        if fmt == "fbgemm":
            out["input_scale_ub"] = torch.tensor([1200.0])
        return out
    if fmt == "fp8-block":
        return _fp8_blocks(w, block)
    if fmt == "ct-int4":
        return _ct_int4(w, group_size, sym, scale_dtype)
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed)) if desc_act else None
    codes = packing.quantize_int4(w, group_size, sym if fmt == "gptq" else False, perm=perm)
    if fmt == "gptq":
        return packing.to_gptq(codes, zero_offset=1)
    return packing.to_awq(codes)


def reference_weight(fmt: str, t: dict[str, torch.Tensor], group_size: int = 32, sym: bool = True,
                     block: tuple[int, int] = (32, 32)) -> torch.Tensor:
    if fmt in ("fp8-channel", "fbgemm"):
        return ref_fp8(t)
    if fmt == "fp8-block":
        return ref_fp8(t, block)
    if fmt == "gptq":
        return ref_gptq(t)
    if fmt == "awq":
        return ref_awq(t, group_size)
    return ref_ct_int4(t, group_size, sym)


def write_quantized_model(src: str, out: str | Path, fmt: str, *, kv_scales: dict[int, tuple[float, float]] | None = None,
                          with_refs: bool = True, **opts) -> tuple[str, dict[str, torch.Tensor]]:
    """(the quantized model directory, {HF linear weight name: float64 reference weight}; no
    references with `with_refs` False: the bit-by-bit decoders are slow for a real model)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(f))
    tensors: dict[str, torch.Tensor] = {}
    refs: dict[str, torch.Tensor] = {}
    for name, value in sorted(state.items()):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
            # Act-order: linears reading the same input (q/k/v, gate/up) share one order, as GPTQ's
            # (same inputs, same Hessian) do.
            layer = int(module.split(".")[2])
            shared = module.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            seed = layer * 10 + (0 if module.endswith(("q_proj", "k_proj", "v_proj")) else
                                 1 if shared else LINEARS.index(module.rsplit(".", 1)[-1]))
            parts = quantize_linear(fmt, value.float(), seed=seed, **opts)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            ref_opts = {k: v for k, v in opts.items() if k in ("group_size", "sym", "block")}
            if with_refs:
                refs[name] = reference_weight(fmt, parts, **ref_opts)
        else:
            tensors[name] = value
    for layer, (k_scale, v_scale) in (kv_scales or {}).items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, **{k: v for k, v in opts.items() if k != "scale_dtype"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out), refs
