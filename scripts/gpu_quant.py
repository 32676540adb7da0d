"""Quantized serving on a GPU: kernel checks against the torch references, then FP8 W8A8, INT4 W4A16
and the FP8 KV cache timed against bf16 tokenmill in the same run (Llama-3.1-8B shape, dummy
weights, CUDA graphs on). Every part runs in its own subprocess (a crash or a hang loses only that
part) within one time budget (--budget, default 470 s). Prints progress and a table, writes
$OUT/gpu_quant.json, $OUT/gpu_quant.md and each part's $OUT/part-<name>.json (OUT defaults to
./gpu-out); exits non-zero when a check fails or a part crashes.

Parts (--parts, comma-separated; default all, run in this order):
  kernels  CUDA kernels vs references in bfloat16: int4 dequantize-GEMM (groups, act-order, split-K)
           and its large-batch dequantize + cuBLAS path, block fp8 GEMM, per-token(-group) fp8
           activation quantization, torch._scaled_mm row-wise, the engine's fp8 Linear (must take
           the _scaled_mm path, no slow-path fallback), fp8 KV write rounding and paged attention
           over fp8 blocks (both fp8 formats)
  bf16     the baseline engine: 256x256x128, 1000x512x256, batch 1 (512 in), batch 1 with a
           16k-token prompt; KV blocks
  fp8      FP8 W8A8 (online, per-channel weights): 256x256x128, 1000x512x256, batch 1
  int4     INT4 W4A16 (a GPTQ config, group 128; dummy weights quantized at load): batch 1, 256x256x128
  int4x1, int4x2 (not by default) INT4 engines at 256x256x128 (and 256x256x1, prefill alone, with
           --workloads) with environment settings of their own (GPU_QUANT_ENV_int4x1="TOKENMILL_INT4_KPERM=0 ...",
           whitespace-separated), for A/B runs against int4
  int4panels (not by default) the same INT4 engine with the CUDA-core panel GEMV of before the
           tensor-core one (TOKENMILL_INT4_MMA=0): batch 1, a same-run figure beside int4's
  kvfp8    bf16 weights, fp8 (e4m3) KV cache against a bf16-KV engine in the same process
           (scripts/gpu_kvfp8.py): KV blocks, batch 1 with a 16k prompt (decode ms/token from token
           timestamps, rounds interleaved; the decode step profiled per kernel group), 1000x512x256
  fp8kv    fp8 weights and fp8 KV cache together (no goal of its own): 256x256x128, 1000x512x256
  micro    each Llama-8B linear (qkv, o, gate_up, down) at 1..8192 rows: bf16 mm, fp8 (activation
           quantization + _scaled_mm), int4 fused kernel, int4 dequantize + mm (where the INT4
           path should switch: triton_int4.DEQUANT_MIN_ROWS)
  tune     (not by default) every candidate tile and split of the fp8 streaming and INT4 kernels
           (triton_fp8_stream, triton_int4_stream) on each Llama-8B linear at 1..2048 rows, with
           bf16, _scaled_mm and the old INT4 paths; the best per bucket feeds stream_tiles' table
           (TUNE_BUDGET_S caps it, default 110 s)
  sweep    (not by default) kernel variants per Llama-8B linear where the quantized paths lose:
           the int4 panel GEMV, the pipelined fp8 stream, W8A8 at 256/1024 rows (activation
           quantization, _scaled_mm row-/tensor-wise, the Triton fp8 GEMM), int4 tiles
           (scripts/gpu_quant_sweep.py; SWEEP_BUDGET_S caps it, default 120 s)
  int4sweep (not by default) INT4 kernel variants where INT4 loses: the register-prefetched one-row
           GEMV (panel, arithmetic, prefetch depth, split) against its int4 bytes at copy bandwidth,
           the swapped and fused GEMMs at 64 / 256 rows, bf16 and the engine's path beside them
           (scripts/gpu_int4_sweep.py; INT4_SWEEP_BUDGET_S caps its timing loop, default 80 s;
           INT4_SWEEP_SET=stream: the one-row access-pattern variants, read probes, PDL chains)
  int4gemm (not by default) the INT4 GEMM on the mma layout (scripts/gpu_int4_gemm.py) against the
           engine's dequantize + cuBLAS and bf16 cuBLAS per Llama-8B linear at 16-1024 rows
  int4bf16head (not by default) the int4 engine at batch 1 with the bf16 LM head (TOKENMILL_LM_HEAD_8BIT=off):
           the 8-bit head's A/B
  int4profile (not by default) the INT4 engine under `profile`'s per-kernel-group step profile: decode
           at 256 rows and at batch 1, an eager 8192-token prefill step (scripts/gpu_quant_fp8.profile_one)
  profile  (not by default) bf16 and fp8 engines: a decode step of 256 rows (graph) and an eager
           prefill step of 8192 tokens under torch.profiler, time per kernel group side by side,
           and each throughput workload's physical bound (scripts/gpu_quant_fp8.py)
  w8a8     (not by default) the W8A8 GEMMs per Llama-8B linear at 16..8192 rows: quantization,
           row-/tensor-wise _scaled_mm, the Triton fp8 GEMM's tiles and split-K (W8A8_BUDGET_S)
  w8a8tma  (not by default) the TMA-fed Triton W8A8 GEMM's tiles (plain, swapped, split-K, persistent)
           per Llama-8B linear at 256 / 8192 / 1024 / 512 / 128 / 64 rows beside row-wise _scaled_mm
           and the engine's path (scripts/gpu_fp8_gemm.py; W8A8TMA_BUDGET_S, W8A8TMA_ROWS)
  pdl      (not by default) programmatic dependent launch on / off: the batch-1 decode chain of fp8 GEMVs,
           norms and SiLU in a graph (bit-identical outputs), then batch-1 fp8 and bf16 engines
           (scripts/gpu_fp8_engines.py, one process)
  pdlplant (not by default) pdl's chain check against a planted race (no kernel waits): must fail
  siluquant (not by default) SiLU-and-mul + fp8 quantization: two kernels vs the fused one (256, 8192 rows)
  b1       (not by default) the fp8 batch-1 weight stream at kernel level: each linear and the LM head at
           one row (bf16, the engine's tiles, a one-row tile sweep) as fractions of copy bandwidth, SiLU
           in down_proj's GEMV, the fp8 LM head's time and error, the one-row chain (scripts/gpu_fp8_batch1.py)
  int4b1   (not by default) INT4 at batch 1 in one process: the tensor-core GEMV's launches per Llama-8B
           linear behind a norm (PDL on / off, splits, hints; a PDL race check and its plant), the
           layer chain, then engines INT4 (the best launches; step profile), bf16, INT4 with main's
           launches: batch-1 ms/token and ratios (scripts/gpu_int4_b1.py)
  b1profile (not by default) batch 1, fp8 beside bf16 in one process: ms/token, a profiled window of
           decode steps (kernel groups; what each kernel and GEMV slot adds to the step under PDL),
           each fp8 linear at one row against copy bandwidth (scripts/gpu_fp8_b1_profile.py)
  fp8engines (not by default) the FP8 goal figures in one process: bf16, fp8, fp8 + fp8 KV cache
           at 256x256x128 and 1000x512x256, batch 1 (bf16, fp8), every engine warmed
  tiny     tiny quantized checkpoints of every format (tests/helpers/quant_formats.py) on CUDA
           (bf16, Triton, graphs): prompt logprobs vs the same checkpoint on the CPU engine (float32)
Goals (issue 22): fp8 >= 1.5x bf16 tok/s and <= 0.6x ms/token at batch 1; int4 batch 1 <= 0.4x,
batch 256 (256x256x128) >= 1.0x; fp8 KV 2x blocks, >= 1.0x tok/s, 16k decode ms/token <= bf16's.

    python scripts/gpu_quant.py                      # everything (< 8 minutes on an H100)
    python scripts/gpu_quant.py --parts kernels,tiny # checks only
    python scripts/gpu_quant.py --smoke              # CPU: tiny shapes, a few tokens (no goals)
    QUANT_BF16_WORKLOADS=256x256x128,1000x512x256,batch1 python scripts/gpu_quant.py \
        --parts kernels,bf16,fp8,tiny,profile        # the FP8 goals, checks and the step profile
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

import torch

import triton_precompile  # scripts/: compiles a sweep's kernels in parallel processes

# On a GPU the kernels must compile; a CPU smoke run interprets them.
os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers.tiny_models import make_tiny_model_dir, make_tiny_tokenizer  # noqa: E402

OUT = os.environ.get("OUT", "./gpu-out")
LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1,
               eos_token_id=2, pad_token_id=2)
SMOKE = dict(LLAMA8B, vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"}
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILURES.append(what)


def config_dir(shape: dict, quantization_config: dict | None = None) -> str:
    from transformers import LlamaConfig
    path = tempfile.mkdtemp(prefix="quant-config-")
    config = LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    if quantization_config is not None:
        config.quantization_config = quantization_config
    config.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


# ---------------------------------------------------------------- kernel checks

def kernels(results: dict, device: str) -> None:
    from tokenmill.layers.attention.backend import quantize_kv
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_fp8 import block_fp8_gemm, quantize_row_groups
    from tokenmill.layers.quantization.triton_int4 import int4_gemm

    g = torch.Generator().manual_seed(0)
    rec = results.setdefault("kernels", {})
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for n, k, group, act_order in ((512, 1024, 128, False), (384, 512, -1, False), (256, 512, 64, True)):
        w = torch.randn(n, k, generator=g) * 0.05
        perm = torch.randperm(k, generator=g) if act_order else None
        codes = packing.quantize_int4(w, group, sym=False, perm=perm)
        wt = packing.from_codes(codes, dt, act_order)
        wt = packing.Int4Weights(*(t.to(device) if t is not None else None for t in
                                   (wt.qweight, wt.scales, wt.zeros, wt.g_idx)))
        ref_w = packing.dequantize(wt, group, torch.float32)
        for m in (1, 7, 64, 300):
            x = torch.randn(m, k, generator=g).to(device, dt)
            ref = x.float() @ ref_w
            for unpack_3d in (True, False):
                out = int4_gemm(x, wt.qweight, wt.scales, wt.zeros, wt.g_idx, group, unpack_3d=unpack_3d).float()
                err = ((out - ref).norm() / ref.norm()).item()
                how = "reshape" if unpack_3d else "row loads"
                rec[f"int4_{n}x{k}_g{group}{'_act' if act_order else ''}_m{m}_{how}"] = err
                check(err < 1e-2, f"int4 GEMM ({how}) {m}x{k}x{n} group {group}{' act-order' if act_order else ''}: "
                                  f"rel err {err:.1e}")
    from tokenmill.layers.quantization import triton_int4
    check(triton_int4.UNPACK_3D, "int4 GEMM: the reshape unpacking compiled (no fallback)")
    # The engine's fp8 Linear: on CUDA it must take the _scaled_mm path (no slow-path fallback).
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization import fp8 as fp8_method
    w = (torch.randn(384, 512, generator=g) * 0.05).to(device, dt)
    lin = Linear(512, 384, bias=False).to(device, dt)
    lin.weight.data.copy_(w)
    lin.quant_method = fp8_method.Fp8LinearMethod(online=True)
    lin.quant_method.create_weights(lin)
    lin.quant_method.process_weights_after_loading(lin)
    check(lin.use_scaled_mm == (device == "cuda") and (lin.stream_counters is not None) == (device == "cuda")
          and not fp8_method._WARNED, f"engine fp8 Linear takes torch._scaled_mm and streams small batches "
                                      f"(fallbacks: {sorted(fp8_method._WARNED) or 'none'})")
    wq_c, ws_c = lin.weight, lin.weight_scale  # the layer's own rounding (online scales are searched)
    from tokenmill.layers.quantization.stream_tiles import FP8_STREAM_MAX_ROWS
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_reference
    for m in (1, 4, 33, 300):
        xm = torch.randn(m, 512, generator=g).to(device, dt)
        out = lin(xm).float()
        if m <= FP8_STREAM_MAX_ROWS and device == "cuda":  # streaming: bf16 activations, fp8 weight
            ref = fp8_stream_reference(xm, wq_c, ws_c).float()
        else:
            xq, xs = fp8_ops.quantize_rows(xm)
            ref = fp8_ops.scaled_mm_reference(xq, xs, wq_c, ws_c, torch.float32)
        err = ((out - ref).norm() / ref.norm()).item()
        check(err < 1e-2 and not fp8_method._WARNED, f"engine fp8 Linear m={m}: rel err {err:.1e}")
    _stream_kernel_checks(device, dt, g)
    # INT4 large batches: dequantize + cuBLAS (int4_matmul from DEQUANT_MIN_ROWS rows).
    from tokenmill.layers.quantization.triton_int4 import DEQUANT_MIN_ROWS, dequantize_int4, int4_matmul
    codes = packing.quantize_int4(w, 128, sym=True)
    wt = packing.from_codes(codes, dt, act_order=False)
    wt = packing.Int4Weights(wt.qweight.to(device), wt.scales.to(device), wt.zeros.to(device), None)
    ref_w = packing.dequantize(wt, 128, torch.float32)
    check(torch.equal(dequantize_int4(wt.qweight, wt.scales, wt.zeros, None, 128, torch.float32), ref_w),
          "int4 dequantize kernel = reference")
    xm = torch.randn(DEQUANT_MIN_ROWS + 5, 512, generator=g).to(device, dt)
    ref = xm.float() @ ref_w
    err = ((int4_matmul(xm, wt.qweight, wt.scales, wt.zeros, None, 128).float() - ref).norm() / ref.norm()).item()
    check(err < 1e-2, f"int4_matmul {xm.shape[0]} rows: rel err {err:.1e}")
    if device != "cuda":
        return
    fp8 = torch.float8_e4m3fn
    x = torch.randn(33, 512, generator=g).to(device, dt) * 4
    for group in (128, 512):
        q, s = quantize_row_groups(x, group)
        rq, rs = fp8_ops.quantize_row_groups(x, group)
        mism = (q.float() != rq.float()).float().mean().item()
        check(torch.allclose(s, rs, rtol=1e-6) and mism < 1e-3, f"fp8 activation quantization, groups of {group}: "
                                                                 f"{mism:.1e} codes differ")
    w = torch.randn(384, 512, generator=g).to(device) * 0.05
    wq, ws = fp8_ops.quantize_blocks(w, (128, 128))
    for m in (1, 16, 200):
        xm = torch.randn(m, 512, generator=g).to(device, dt)
        xq, xs = quantize_row_groups(xm, 128)
        out = block_fp8_gemm(xq, xs, wq, ws, (128, 128), dt).float()
        ref = fp8_ops.block_mm_reference(xq, xs, wq, ws, (128, 128), torch.float32)
        err = ((out - ref).norm() / ref.norm()).item()
        check(err < 1e-2, f"block fp8 GEMM m={m}: rel err {err:.1e}")
    wq_c, ws_c = fp8_ops.quantize_rows(w)
    xq, xs = quantize_row_groups(x, 512)
    out = torch._scaled_mm(xq, wq_c.t(), scale_a=xs, scale_b=ws_c.reshape(1, -1).contiguous(), out_dtype=dt)
    ref = fp8_ops.scaled_mm_reference(xq, xs, wq_c, ws_c, torch.float32)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    check(err < 1e-2, f"_scaled_mm row-wise: rel err {err:.1e}")
    _fused_quant_checks(device, g, lin)
    # FP8 KV cache: the Triton write rounds like torch; attention over fp8 blocks = the torch reference's.
    from tests.layers.test_fp8_kv_cache import _fp8_case
    from tokenmill.layers.attention import triton_kv_write
    from tokenmill.layers.attention.backend import transpose_v_blocks
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
    for kv_dtype in (fp8, torch.float8_e5m2):
        case, cache8, expected = _fp8_case(kv_dtype, 0.5, 2.0)
        cache = cache8.to(device)
        k_new = case.k.to(device, dt)
        triton_kv_write.write_kv(k_new, case.v.to(device, dt), cache, case.meta.slot_mapping.to(device), 0.5, 2.0)
        slots = case.meta.slot_mapping
        real = (slots >= 0).to(device)
        flat = cache.view(2, -1, *cache.shape[3:])
        want = quantize_kv(k_new[real], 0.5, kv_dtype).float()
        got = flat[0, slots.to(device)[real]].float()
        check(torch.equal(got, want), f"fp8 KV write ({kv_dtype}): codes equal torch's rounding")
        backend = TritonAttentionBackend(4, 2, 32, 1 / math.sqrt(32))
        backend.k_scale, backend.v_scale = 0.5, 2.0
        meta = case.meta
        dev_meta = type(meta)(**{f: (getattr(meta, f).to(device) if isinstance(getattr(meta, f), torch.Tensor)
                                     and not f.endswith("_cpu") else getattr(meta, f))
                                 for f in meta.__dataclass_fields__})
        cache_in = cache8.to(device)  # in the backend's layout (fp8_v_transposed: values transposed per block)
        cache_in = transpose_v_blocks(cache_in) if backend.v_transposed(cache_in) else cache_in
        out = backend.forward(case.q.to(device), case.k_rt.to(device), case.v_rt.to(device), cache_in, dev_meta)
        n = meta.num_tokens
        err = (out[:n].float().cpu() - expected[:n]).abs().max().item()
        check(err < 2e-3, f"paged attention over {kv_dtype} blocks: max err {err:.1e}")


def _fused_quant_checks(device: str, g: torch.Generator, lin) -> None:
    """The RMSNorm kernel with the fp8 quantization fused (triton_fp8_fused) against the unfused
    kernel followed by quantize_row_groups, bit for bit in bfloat16; and the fp8 Linear
    really takes attached codes (wrong codes attached change its output, the right ones do not)."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm

    def same(out, ref) -> bool:
        q, s = fp8_ops.attached(out)
        rq, rs = quantize_row_groups(ref, ref.shape[1])
        return torch.equal(out, ref) and torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    bf = torch.bfloat16
    x = (torch.randn(300, 4096, generator=g) * 2).to(device, bf)
    w = (torch.rand(4096, generator=g) + 0.5).to(device, bf)
    res = torch.randn(300, 4096, generator=g).to(device)
    ref, ref_res = fused_add_rms_norm(x, res.clone(), w, 1e-5)
    res2 = res.clone()
    out = rms_norm_quant(x, res2, w, 1e-5, bf)
    check(same(out, ref) and torch.equal(res2, ref_res), "rms_norm_quant (residual add) = fused_add_rms_norm + quantization")
    check(same(rms_norm_quant(x, None, w, 1e-5, bf), rms_norm(x, w, 1e-5)), "rms_norm_quant = rms_norm + quantization")
    xm = torch.randn(64, 512, generator=g).to(device, bf)
    plain = lin(xm)
    xa = xm.clone()
    fp8_ops.attach(xa, *quantize_row_groups(xa, 512))
    same_codes = lin(xa)
    # the engine's W8A8 choice per (bucket, N, K): Triton tiles with split-K through the layer's counters
    from tokenmill.layers.quantization import stream_tiles
    saved = dict(stream_tiles.W8A8_MEASURED)
    for tiles in ((64, 64, 256, 1, 4, 3, 2), "tensorwise", "tma-m64n128k128g8w4st4s2-swap"):
        stream_tiles.W8A8_MEASURED[(stream_tiles.w8a8_bucket(64), 384, 512)] = tiles
        xq, xs = fp8_ops.quantize_rows(xm)
        ref = fp8_ops.scaled_mm_reference(xq, xs, lin.weight, lin.weight_scale, torch.float32)
        got = lin(xm).float()
        err = ((got - ref).norm() / ref.norm()).item()
        check(err < 1e-2 and not lin.stream_counters.tensor.any(), f"engine fp8 Linear through W8A8_MEASURED {tiles}: "
                                                                  f"rel err {err:.1e}, counters back at zero")
    stream_tiles.W8A8_MEASURED.clear()
    stream_tiles.W8A8_MEASURED.update(saved)
    xb = xm.clone()
    q, s = quantize_row_groups(xb, 512)
    fp8_ops.attach(xb, q, s * 2)
    check(torch.equal(plain, same_codes) and not torch.equal(plain, lin(xb)),
          "fp8 Linear takes the codes attached to its input (same result; doubled scales change it)")


def _stream_kernel_checks(device: str, dt: torch.dtype, g: torch.Generator) -> None:
    """The fp8 streaming and INT4 kernels at every tile bucket (with split-K) against float64
    references, the split-K counters zero afterwards, and a CUDA-graph replay on new inputs."""
    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm, fp8_stream_reference
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    n, k = 768, 1024
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
    cases = {"channel": (fp8_ops.quantize_rows(w), None), "block": (fp8_ops.quantize_blocks(w, (128, 128)), (128, 128))}
    for label, ((wq, ws), block) in cases.items():
        if device != "cuda":
            wq = wq.float()
        for m in (1, 3, 16):
            x = torch.randn(m, k, generator=g).to(device, dt)
            ref = fp8_stream_reference(x, wq, ws, block)
            out = fp8_stream_gemm(x, wq, ws, block, counters)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            check(err < 1e-2 and not counters.any(), f"fp8 stream ({label} scales) m={m} "
                  f"{stream_tiles.fp8_tiles(m, n, k, block, stream_tiles.sm_count(x.device)).label()}: rel err {err:.1e}")
    wt = packing.from_codes(packing.quantize_int4(w, 128, sym=False), dt, act_order=False)
    ref_w = packing.dequantize(wt, 128, torch.float64)
    for m in (1, 5, 16, 64, 200, 700):
        x = torch.randn(m, k, generator=g).to(device, dt)
        ref = x.double() @ ref_w
        out = int4_stream_gemm(x, wt.qweight, wt.scales, wt.zeros, 128, counters)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        check(err < 1e-2 and not counters.any(), f"int4 stream m={m} "
              f"{stream_tiles.int4_tiles(m, n, k, 128, stream_tiles.sm_count(x.device)).label()}: rel err {err:.1e}")
    # The engine's layout (`int4.for_device`: on CUDA the tensor-core GEMV's, or panels with
    # TOKENMILL_INT4_MMA=0) through int4_matmul: with panels one row takes the panel GEMV, more
    # rows the streaming kernel; with the mma layout, `triton_int4_mma.mma_matmul`.
    from tokenmill.layers.quantization.int4 import for_device
    from tokenmill.layers.quantization.triton_int4 import int4_matmul
    from tokenmill.layers.quantization.triton_int4_gemv import MODES, int4_gemv
    wd = for_device(wt, 128)
    from tokenmill.layers.quantization.int4 import mma_enabled
    want = (4 if mma_enabled() else 3) if device == "cuda" else 2
    check(wd.qweight.dim() == want, f"int4 engine layout: qweight {tuple(wd.qweight.shape)}")
    for m in (1, 3, 64, 300):
        x = torch.randn(m, k, generator=g).to(device, dt)
        ref = x.double() @ ref_w
        err = ((int4_matmul(x, wd.qweight, wd.scales, wd.zeros, None, 128, counters).double() - ref).norm()
               / ref.norm()).item()
        check(err < 1e-2 and not counters.any(), f"int4_matmul on the engine's layout m={m}: rel err {err:.1e}")
    if wd.qweight.dim() == 3:
        x = torch.randn(1, k, generator=g).to(device, dt) * 300  # fp16x2 mode: x scaled per row of 8
        ref = x.double() @ ref_w
        for mode in MODES:
            out = int4_gemv(x, wd.qweight, wd.scales, wd.zeros, 128, mode=mode, split=4, counters=counters)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            check(err < 1e-2 and not counters.any(), f"int4 GEMV mode {mode} (large x): rel err {err:.1e}")
    if device != "cuda":
        return
    # Graph replays: split-K counters must be back at zero after every replay.
    (wq, ws), _ = cases["channel"]
    x = torch.randn(2, k, device=device, dtype=dt)
    x1 = torch.randn(1, k, device=device, dtype=dt)
    counters1 = stream_tiles.SplitCounters(n, torch.device(device)).tensor
    fp8_stream_gemm(x, wq, ws, None, counters)
    int4_stream_gemm(x, wt.qweight, wt.scales, wt.zeros, 128, counters)
    int4_matmul(x1, wd.qweight, wd.scales, wd.zeros, None, 128, counters1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y8 = fp8_stream_gemm(x, wq, ws, None, counters)
        y4 = int4_stream_gemm(x, wt.qweight, wt.scales, wt.zeros, 128, counters)
        y1 = int4_matmul(x1, wd.qweight, wd.scales, wd.zeros, None, 128, counters1)
    worst = 0.0
    for _ in range(3):
        x.copy_(torch.randn(2, k, generator=g).to(device, dt))
        x1.copy_(torch.randn(1, k, generator=g).to(device, dt))
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in ((y8, fp8_stream_reference(x, wq, ws)), (y4, x.double() @ ref_w), (y1, x1.double() @ ref_w)):
            worst = max(worst, ((got.double() - ref).norm() / ref.norm()).item())
    check(worst < 1e-2 and not counters.any() and not counters1.any(),
          f"fp8 / int4 stream kernels and the int4 GEMV replayed in a CUDA graph: rel err {worst:.1e}")


# ---------------------------------------------------------------- tiny checkpoints of every format

def tiny(results: dict, device: str) -> None:
    from tests.helpers.quant_formats import write_quantized_model
    from tokenmill import LLM, SamplingParams

    root = tempfile.mkdtemp(prefix="quant-tiny-")
    float_dir = make_tiny_model_dir("llama", root, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2)
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(40)]
    cases = [("fp8-channel", {}), ("fbgemm", {}), ("fp8-block", {"block": (32, 32)}),
             ("gptq", {"group_size": 32, "sym": False, "desc_act": True}), ("awq", {"group_size": 32})]
    try:
        import compressed_tensors  # noqa: F401
        cases.append(("ct-int4", {"group_size": 32, "sym": True}))
    except ImportError:
        print("  (compressed-tensors not installed: ct-int4 skipped)")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for fmt, opts in cases:
        path, _ = write_quantized_model(float_dir, os.path.join(root, fmt), fmt, with_refs=False, **opts)
        lps = {}
        for dev in ("cpu", device):
            llm = LLM(path, dtype="float32" if dev == "cpu" else "bfloat16", device=dev, single_process=True,
                      kv_cache_memory_gb=0.01, num_gpu_blocks_override=64 if dev != "cpu" else None,
                      max_model_len=128, max_num_seqs=4)
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            lps[dev] = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
            del llm
        err = (lps["cpu"] - lps[device]).abs().max().item()
        results.setdefault("tiny", {})[fmt] = err
        check(err < 0.1, f"{fmt}: {device} bf16 vs CPU float32 prompt logprobs, max diff {err:.3f}")


# ---------------------------------------------------------------- engine timings

def _engine(path: str, max_model_len: int, **kwargs):
    from tokenmill import LLM
    start = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len, disable_log_stats=True,
              **kwargs)
    print(f"  engine {kwargs or 'bf16'} up in {time.perf_counter() - start:.0f} s; "
          f"{llm.kv_cache_stats()['num_blocks']} KV blocks", flush=True)
    return llm, time.perf_counter() - start


def _prompts(num: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(length)]} for _ in range(num)]


LAST_TOKENS: dict = {}  # `throughput`'s last run: the digest of its greedy tokens


def throughput(llm, num: int, input_len: int, output_len: int) -> float:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.generate(_prompts(min(num, 16), input_len, seed=1), params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(_prompts(num, input_len), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    digest = hashlib.sha256()  # the greedy tokens' digest: engines that must agree bit for bit compare it
    for o in outs:
        digest.update(str(list(o.outputs[0].token_ids)).encode())
    LAST_TOKENS["sha256"] = digest.hexdigest()[:16]
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def ms_per_token(llm, input_len: int, output_len: int) -> float:
    """Decode time per output token at batch 1: (time for 1 + N tokens - time for 1 token) / N,
    each the best of two runs after a warm-up (prefix caching is off: every run prefills)."""
    from tokenmill import SamplingParams

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.generate(_prompts(1, input_len, seed=2), params, use_tqdm=False)
        best = float("inf")
        for rep in range(2):
            start = time.perf_counter()
            llm.generate(_prompts(1, input_len, seed=3 + rep), params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best
    return 1000 * (timed(1 + output_len) - timed(1)) / output_len


# What each engine part runs: (engine kwargs, workloads).
ENGINES = {
    "bf16": ({}, ["256x256x128", "1000x512x256", "batch1", "batch1_16k"]),
    "fp8": ({"quantization": "fp8"}, ["256x256x128", "1000x512x256", "batch1"]),
    "int4": ({"gptq": True}, ["batch1", "256x256x128", "256x256x1"]),  # (256x256x1: only with --workloads)
    "int4panels": ({"gptq": True}, ["batch1"]),  # TOKENMILL_INT4_MMA=0: the panel GEMV (engine_part sets it)
    "int4bf16head": ({"gptq": True}, ["batch1"]),  # TOKENMILL_LM_HEAD_8BIT=off: the bf16 head (engine_part sets it)
    # session 8's INT4 engine: TOKENMILL_INT4_KPERM=0 (the GEMM permutes x), the committed GEMM table
    # (no TOKENMILL_INT4_GEMM_TABLE): the A/B of the `int4` part (engine_part sets it)
    "int4before": ({"gptq": True}, ["256x256x128"]),
    # INT4 engines with settings of a request's own (GPU_QUANT_ENV_int4x1="K=V K=V"; engine_part sets them)
    "int4x1": ({"gptq": True}, ["256x256x128", "256x256x1"]),
    "int4x2": ({"gptq": True}, ["256x256x128", "256x256x1"]),
    "kvfp8": ({"kv_cache_dtype": "fp8"}, ["attention", "1000x512x256", "batch1_16k"]),  # attention: kernels alone
    # What FP8 serving usually means (weights and KV cache): a figure beside the goals, not one of them.
    "fp8kv": ({"quantization": "fp8", "kv_cache_dtype": "fp8"}, ["256x256x128", "1000x512x256"]),
}
# (part, workload, goal, higher is better)
GOALS = [("fp8", "256x256x128", 1.5, True), ("fp8", "1000x512x256", 1.5, True), ("fp8", "batch1", 0.6, False),
         ("int4", "batch1", 0.4, False), ("int4", "256x256x128", 1.0, True),
         ("kvfp8", "kv_blocks", 2.0, True), ("kvfp8", "1000x512x256", 1.0, True),
         ("kvfp8", "batch1_16k", 1.0, False)]
INFO = [("fp8kv", "256x256x128"), ("fp8kv", "1000x512x256"), ("int4panels", "batch1")]  # ratios printed, no goal
INFO.append(("int4bf16head", "batch1"))
INFO.append(("int4before", "256x256x128"))
INFO += [("int4x1", "256x256x128"), ("int4x2", "256x256x128")]


def _int4_engine_layout_check(results: dict, device: str = "cuda", n: int = 6144, k: int = 4096) -> None:
    """int4_matmul on the layout the engine keeps (`int4.for_device`) for a Llama-8B qkv weight at
    1, 3, 8, 16, 40, 100 and 300 rows against a float32 reference (a few seconds)."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization.int4 import for_device
    from tokenmill.layers.quantization.triton_int4 import int4_matmul

    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    wt = packing.from_codes(packing.quantize_int4(w, 128, sym=False), dt, act_order=False)
    wd = for_device(wt, 128)
    ref_w = packing.dequantize(wt, 128, torch.float32)
    counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
    errs = {}
    for m in (1, 3, 8, 16, 40, 100, 300):  # 40: the tl.dot GEMM's table, 100: the Gluon GEMM's
        x = torch.randn(m, k, device=device, generator=g).to(dt)
        ref = x.float() @ ref_w
        errs[m] = ((int4_matmul(x, wd.qweight, wd.scales, wd.zeros, None, 128, counters).float() - ref).norm()
                   / ref.norm()).item()
    results.setdefault("int4_layout_check", {})[f"{tuple(wd.qweight.shape)}"] = errs
    check(max(errs.values()) < 1e-2 and not counters.any(),
          f"int4 engine layout {tuple(wd.qweight.shape)}: int4_matmul at 1..300 rows, worst rel err "
          f"{max(errs.values()):.1e}")


def engine_part(results: dict, label: str, smoke: bool) -> None:
    shape = SMOKE if smoke else LLAMA8B
    scale = (lambda n: max(1, n // 64)) if smoke else (lambda n: n)
    long_ctx = 1024 if smoke else 16384
    kwargs, workloads = ENGINES[label]
    only = os.environ.get("GPU_QUANT_WORKLOADS")  # --workloads: these only (a shorter run)
    workloads = [w for w in workloads if (w in only.split(",") if only else w != "256x256x1")]
    if label == "bf16" and os.environ.get("QUANT_BF16_WORKLOADS"):  # e.g. only what the fp8 goals compare
        workloads = [w for w in workloads if w in os.environ["QUANT_BF16_WORKLOADS"].split(",")]
    kwargs = dict(kwargs)
    if label == "int4panels":  # this part's own process (and the engine's, which inherit it)
        os.environ["TOKENMILL_INT4_MMA"] = "0"
    if label == "int4bf16head":  # the int8 head off: A/B against the int4 part's batch 1
        os.environ["TOKENMILL_LM_HEAD_8BIT"] = "off"
    if label == "int4before":  # this part's process and its engine's: x permuted by the GEMM, the committed table
        os.environ["TOKENMILL_INT4_KPERM"] = "0"
        os.environ.pop("TOKENMILL_INT4_GEMM_TABLE", None)
    for item in os.environ.get(f"GPU_QUANT_ENV_{label}", "").split():  # this part's own settings
        key, _, value = item.partition("=")
        os.environ[key.strip()] = value.strip()
        print(f"  {label}: {key.strip()}={value.strip()}", flush=True)
    if label in ("int4", "int4panels", "int4bf16head") and not smoke:  # what the engine times must be right: its layout checked first
        _int4_engine_layout_check(results)
    path = config_dir(shape, GPTQ_CONFIG if kwargs.pop("gptq", False) else None)
    extra = dict(device="cpu", enforce_eager=True, kv_cache_memory_gb=0.05) if smoke else {}
    # Prefix caching off: the batch-1 runs repeat prompts, and every run must prefill.
    llm, up_s = _engine(path, long_ctx + 256 + 16, enable_prefix_caching=False, **kwargs, **extra)
    rec = results.setdefault("timings", {}).setdefault(label, {"kv_blocks": llm.kv_cache_stats()["num_blocks"],
                                                             "engine_up_s": up_s})
    for w in workloads:
        start = time.perf_counter()
        if w in ("256x256x128", "256x256x1"):  # (256x256x1: the prefill chunks alone, 8 steps of 8,192 tokens)
            # GPU_QUANT_REPEATS: the measured run that many times, the median recorded (runs listed)
            runs = [throughput(llm, scale(256), scale(256), 1 if w.endswith("x1") else scale(128))
                    for _ in range(int(os.environ.get("GPU_QUANT_REPEATS", "1")))]
            rec[w] = sorted(runs)[len(runs) // 2]
            rec[w + "_tokens_sha256"] = LAST_TOKENS["sha256"]
            if len(runs) > 1:
                rec[w + "_runs"] = runs
        elif w == "1000x512x256":
            rec[w] = throughput(llm, scale(1000), scale(512), scale(256))
        elif w == "batch1":
            rec[w] = ms_per_token(llm, scale(512), scale(256) if not smoke else 4)
        elif w == "batch1_16k":
            rec[w] = ms_per_token(llm, long_ctx, 64 if not smoke else 4)
        print(f"  {label} {w}: {rec[w]:.2f} {'ms/token' if w.startswith('batch1') else 'output tok/s'} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    llm.shutdown()


# ---------------------------------------------------------------- per-GEMM timings

def _time_ms(fn, device: str, reps: int = 20) -> float:
    """Milliseconds per call, replayed from a CUDA graph (no launch overhead) where it captures."""
    if device != "cuda":  # smoke: wall clock
        fn()
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - eager timing then
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _check_int4_replays(x, wd, counters, w_ref) -> None:
    """int4_matmul on the engine's layout captured in a CUDA graph, replayed three times: each
    output matches x @ W (float32 reference), split-K counters are zero after each replay."""
    from tokenmill.layers.quantization import triton_int4

    triton_int4.int4_matmul(x, wd.qweight, wd.scales, wd.zeros, None, 128, counters)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_int4.int4_matmul(x, wd.qweight, wd.scales, wd.zeros, None, 128, counters)
    ref = x.float() @ w_ref
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        check(err < 1e-2 and not counters.any(), f"int4 one row from a graph {tuple(ref.shape)}: rel err {err:.1e}")


def micro(results: dict, device: str) -> None:
    """Each Llama-8B linear per row count, as the engine calls it now (fp8: streaming up to
    FP8_STREAM_MAX_ROWS, then W8A8 _scaled_mm; int4: int4_matmul) and the paths it chose between.
    Weights are cycled over copies larger than L2 together (`_cycled`): HBM-bound times."""
    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm

    cuda = device == "cuda"
    shape = LLAMA8B if cuda else SMOKE
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = 2 * h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    shapes = {"qkv": (h + kv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    rec = results.setdefault("micro", {})
    rows = (1, 4, 16, 64, 256, 1024, 2048, 8192) if cuda else (1, 16)
    dt = torch.bfloat16 if cuda else torch.float32
    totals: dict = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dt) * 0.02
        wq, ws = fp8_ops.quantize_rows(w)
        if not cuda:
            wq = wq.float()
        wt = packing.from_codes(packing.quantize_int4(w, 128, sym=True), dt, act_order=False)
        bf16_w = _cycled([w])
        fp8_w = _cycled([wq, ws, ws.reshape(1, -1).contiguous()])
        int4_w = _cycled([wt.qweight, wt.scales, wt.zeros])
        from tokenmill.layers.quantization.int4 import for_device
        wd = for_device(wt, 128)  # the engine's layout (panels on CUDA)
        int4_engine_w = _cycled([wd.qweight, wd.scales, wd.zeros])
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dt)

            def scaled_mm():
                q, _, srow = fp8_w()
                xq, xs = quantize_row_groups(x, k) if cuda else fp8_ops.quantize_rows(x)
                if not cuda:
                    xq, q = xq.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn)
                return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=srow, out_dtype=torch.bfloat16)

            def stream():
                q, sc, _ = fp8_w()
                return fp8_stream_gemm(x, q, sc, None, counters)
            r = {"bf16": _time_ms(lambda: x @ bf16_w()[0].t(), device), "fp8_scaled_mm": _time_ms(scaled_mm, device)}
            if m <= 64:
                r["fp8_stream"] = _time_ms(stream, device)
            r["int4"] = _time_ms(lambda: triton_int4.int4_matmul(x, *int4_engine_w(), None, 128, counters), device)
            if cuda and m == 1:  # the engine's one-row path replayed from a graph: right, counters back at zero
                _check_int4_replays(x, wd, counters, packing.dequantize(wt, 128, torch.float32))
            if m <= 256:
                r["int4_old_fused"] = _time_ms(lambda: triton_int4.int4_gemm(x, *int4_w(), None, 128), device)
            if m >= 256:
                r["int4_dequant_mm"] = _time_ms(
                    lambda: x @ triton_int4.dequantize_int4(*int4_w(), None, 128, dt), device)
            if cuda and m > stream_tiles.FP8_STREAM_MAX_ROWS:  # the engine's W8A8 GEMM (stream_tiles.w8a8_path)
                from types import SimpleNamespace

                from tokenmill.layers.quantization.fp8 import _w8a8_mm

                def w8a8():
                    q, sc, srow = fp8_w()
                    layer = SimpleNamespace(weight=q, weight_scale=sc, scale_row=srow, scale_one=one)
                    return _w8a8_mm(layer, *quantize_row_groups(x, k), dt)
                one = torch.ones((), device=device)
                r["fp8_w8a8"] = _time_ms(w8a8, device)
            r["fp8"] = r["fp8_stream"] if m <= stream_tiles.FP8_STREAM_MAX_ROWS else r.get("fp8_w8a8", r["fp8_scaled_mm"])
            rec[f"{name}_{n}x{k}_m{m}"] = r
            for key, v in r.items():
                totals.setdefault(m, {}).setdefault(key, 0.0)
                totals[m][key] += v
            print(f"  {name} {n}x{k} m={m}: " + ", ".join(f"{key} {v * 1000:.0f} us" for key, v in r.items()),
                  flush=True)
        del w, wq, wt, bf16_w, fp8_w, int4_w, wd, int4_engine_w
    results["micro_layer_totals_ms"] = {str(m): t for m, t in totals.items()}
    for m, t in totals.items():
        print(f"  one layer's 4 linears, m={m}: " + ", ".join(f"{key} {v * 1000:.0f} us ({v / t['bf16']:.2f}x bf16)"
                                                              for key, v in t.items()), flush=True)
    for m, t in totals.items():  # where the crossovers really are
        if "fp8_stream" in t and t["fp8_stream"] > t["fp8_scaled_mm"] and m <= stream_tiles.FP8_STREAM_MAX_ROWS:
            print(f"  NOTE fp8: _scaled_mm beats streaming at m={m} (FP8_STREAM_MAX_ROWS {stream_tiles.FP8_STREAM_MAX_ROWS})")
        if "int4_dequant_mm" in t and t["int4_dequant_mm"] < t["int4"]:
            print(f"  NOTE int4: dequantize + mm beats int4_matmul at m={m} "
                  f"(INT4_DEQUANT_MIN_ROWS {stream_tiles.INT4_DEQUANT_MIN_ROWS})")


# ---------------------------------------------------------------- tile sweep of the new kernels

# Candidate tiles (compiled variants; split-K is a launch size, not a recompile).
def _tune_candidates():
    from tokenmill.layers.quantization.stream_tiles import Tiles as T
    fp8_gemv = [T(1, 32, 256), T(1, 32, 256, flat=False), T(1, 16, 512), T(1, 64, 128), T(1, 64, 256, warps=8, flat=False),
                T(1, 16, 256, warps=2)]
    fp8_dot = [T(16, 32, 256), T(16, 64, 128), T(16, 32, 128), T(16, 64, 256, warps=8)]
    int4_gemv = [T(1, 64, 128), T(1, 32, 128), T(1, 128, 128, warps=8), T(1, 64, 64), T(1, 32, 128, warps=2)]
    int4_dot = [T(16, 64, 128), T(16, 128, 128, warps=8), T(16, 32, 128), T(16, 64, 64, nibble_dots=False)]
    int4_tc = [T(64, 64, 128), T(64, 128, 128), T(128, 128, 128, warps=8), T(128, 128, 64, warps=8, nibble_dots=False),
               T(128, 64, 128), T(64, 128, 64, stages=4, nibble_dots=False), T(128, 256, 128, warps=8)]
    return fp8_gemv, fp8_dot, int4_gemv, int4_dot, int4_tc


def _cycled(tensors: list, min_bytes: int = 120 << 20):
    """Copies of a weight (tuple of tensors) so that consecutive calls read different copies and
    the 50 MB L2 holds none of them: the times are HBM-bound, as in a model's forward."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    copies = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(min(11, -(-min_bytes // size) - 1))]
    state = {"i": 0}

    def next_copy():
        state["i"] += 1
        return copies[state["i"] % len(copies)]
    return next_copy


def _tune_calls(device: str):
    """(label, call) for every compiled variant of the sweep (each tile, with and without split-K)
    on a small problem whose specialization matches the Llama shapes (sizes multiples of 16)."""
    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm
    from dataclasses import replace

    n, k = 512, 2048
    w = torch.randn(n, k, device=device) * 0.02
    wq, ws = fp8_ops.quantize_rows(w)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    if device != "cuda":
        wq = wq.float()
    wt = packing.from_codes(packing.quantize_int4(w, 128, sym=True), dt, act_order=False)
    counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
    fp8_gemv, fp8_dot, int4_gemv, int4_dot, int4_tc = _tune_candidates()
    calls = []
    tagged = [("fp8", t) for t in fp8_gemv + fp8_dot] + [("int4", t) for t in int4_gemv + int4_dot + int4_tc]
    for kind, t in tagged:
        for sp in ((1, 2) if t.block_m < 64 else (1,)):
            tt = replace(t, split=sp)
            x = torch.randn(max(1, t.block_m // 2), k, device=device, dtype=dt)
            if kind == "fp8":
                calls.append((f"fp8:{tt.label()}", lambda x=x, tt=tt: fp8_stream_gemm(x, wq, ws, None, counters, tiles=tt)))
            else:
                calls.append((f"int4:{tt.label()}", lambda x=x, tt=tt: int4_stream_gemm(
                    x, wt.qweight, wt.scales, wt.zeros, 128, counters, tiles=tt)))
    return calls


def precompile_shard(shard: str) -> None:
    """Compile one shard of the sweep's kernels into Triton's on-disk cache (tune runs shards in
    parallel processes first: compiling, not timing, is most of the sweep's time)."""
    triton_precompile.compile_shard(_tune_calls("cuda"), shard)


def _precompile_parallel(shards: int = 8, timeout: float = 90.0) -> None:
    triton_precompile.compile_in_processes(__file__, "--precompile", shards, timeout, "tune")


def suggest_tables(rec: dict) -> list[str]:
    """From tune records: per (kind, table bucket, shape) the tile with the least time summed over
    the bucket's measured row counts (MEASURED lines for stream_tiles), each bucket's best over the
    layer, and the crossovers (stream vs _scaled_mm; int4 vs dequantize + mm and bf16)."""
    from tokenmill.layers.quantization import stream_tiles as st

    by_shape: dict = {}
    for key, r in rec.items():
        shape, m = key.rsplit("_m", 1)
        by_shape.setdefault(shape.rsplit("_", 1)[1], {})[int(m)] = r
    lines = []
    for kind, table in (("fp8", st.FP8_TABLE), ("int4", st.INT4_TABLE)):
        buckets = sorted(table)
        layer: dict = {}
        for nk, rows in by_shape.items():
            n, k = map(int, nk.split("x"))
            for bi, b in enumerate(buckets):
                lo = buckets[bi - 1] if bi else 0
                members = [m for m in rows if lo < m <= b and any(x.startswith(kind + ":") for x in rows[m])]
                if not members:
                    continue
                labels = set.intersection(*({x for x in rows[m] if x.startswith(kind + ":")} for m in members))
                if not labels:
                    continue
                cost = {x: sum(rows[m][x] for m in members) for x in labels}
                best = min(cost, key=cost.get)
                tiles = st.Tiles.parse(best.split(":", 1)[1])
                lines.append(f"    ({kind!r}, {b if b < 1 << 30 else '1 << 30'}, {n}, {k}): {tiles.code()},  "
                             f"# {cost[best] * 1000:.1f} us over rows {members}")
                for x, v in cost.items():
                    layer.setdefault(b, {}).setdefault(x.split(":", 1)[1].replace("s2", "s1").replace("s4", "s1")
                                                       .replace("s8", "s1"), []).append(v)
        for b, per in layer.items():
            full = {x: sum(v) for x, v in per.items() if len(v) == max(len(v2) for v2 in per.values())}
            if full:
                best = min(full, key=full.get)
                lines.append(f"  {kind} bucket {b}: best tile over the layer {best} ({full[best] * 1000:.1f} us)")
    return lines


def tune(results: dict, device: str) -> None:
    """Every candidate tile (and split) of the fp8 streaming and INT4 kernels on each Llama-8B
    linear per row count, against bf16 and the paths they replace; prints the best per bucket."""
    from dataclasses import replace

    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    cuda = device == "cuda"
    shape = LLAMA8B if cuda else SMOKE
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = 2 * h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    shapes = {"gate_up": (2 * i, h), "down": (h, i), "qkv": (h + kv, h), "o": (h, h)}  # most time first
    fp8_gemv, fp8_dot, int4_gemv, int4_dot, int4_tc = _tune_candidates()
    fp8_rows = (1, 2, 4, 8, 16, 32) if cuda else (1, 4)
    int4_rows = (1, 4, 16, 64, 128, 256, 512, 1024, 2048) if cuda else (1, 16, 64)
    if not cuda:  # smoke: the first two candidates of each, tiles shrunk to the tiny shapes
        shrink = lambda ts: [replace(t, block_n=min(t.block_n, 32), block_k=min(t.block_k, 64)) for t in ts[:2]]
        fp8_gemv, fp8_dot, int4_gemv, int4_dot, int4_tc = map(shrink, (fp8_gemv, fp8_dot, int4_gemv, int4_dot, int4_tc))
    dt = torch.bfloat16 if cuda else torch.float32
    sms = stream_tiles.sm_count(torch.device(device))
    deadline = time.perf_counter() + float(os.environ.get("TUNE_BUDGET_S", "110"))
    rec = results.setdefault("tune", {})
    if cuda:
        _precompile_parallel(timeout=(deadline - time.perf_counter()) / 2)

    def splits(m, n, k, t):
        tiles_mn = -(-m // t.block_m) * -(-n // t.block_n)
        return [s for s in (1, 2, 4, 8) if k // (s * t.block_k) >= 2 and (s == 1 or tiles_mn < 4 * sms)]

    for name, (n, k) in shapes.items():
        if time.perf_counter() > deadline:
            print(f"  tune: budget spent, {name} skipped", flush=True)
            break
        w = torch.randn(n, k, device=device, dtype=dt) * 0.02
        wq, ws = fp8_ops.quantize_rows(w)
        if not cuda:
            wq = wq.float()  # the interpreter computes on float32 holding fp8 values
        wt = packing.from_codes(packing.quantize_int4(w, 128, sym=True), dt, act_order=False)
        bf16_w = _cycled([w])
        fp8_w = _cycled([wq, ws, ws.reshape(1, -1).contiguous()])
        int4_w = _cycled([wt.qweight, wt.scales, wt.zeros])
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        for m in sorted(set(fp8_rows) | set(int4_rows)):
            if time.perf_counter() > deadline:
                break
            x = torch.randn(m, k, device=device, dtype=dt)
            r = {"bf16": _time_ms(lambda: x @ bf16_w()[0].t(), device)}
            if m in fp8_rows:
                def scaled_mm():
                    q, s, srow = fp8_w()
                    xq, xs = quantize_row_groups(x, k) if cuda else fp8_ops.quantize_rows(x)
                    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=srow, out_dtype=torch.bfloat16)
                if cuda:
                    r["fp8_scaled_mm"] = _time_ms(scaled_mm, device)
                for t in (fp8_gemv if m == 1 else []) + fp8_dot:
                    for sp in splits(m, n, k, t):
                        tt = replace(t, split=sp)
                        r[f"fp8:{tt.label()}"] = _time_ms(lambda: (lambda q, s_, _: fp8_stream_gemm(
                            x, q, s_, None, counters, tiles=tt))(*fp8_w()), device)
            if m in int4_rows:
                if m <= 64:
                    r["int4_old_fused"] = _time_ms(lambda: triton_int4.int4_gemm(x, *int4_w(), None, 128), device)
                if m >= 256:
                    r["int4_dequant_mm"] = _time_ms(lambda: x @ triton_int4.dequantize_int4(*int4_w(), None, 128, dt),
                                                    device)
                cands = (int4_gemv if m == 1 else []) + (int4_dot if m <= 64 else []) + (int4_tc if m >= 16 else [])
                for t in cands:
                    for sp in (splits(m, n, k, t) if m <= 64 else [1]):
                        tt = replace(t, split=sp)
                        r[f"int4:{tt.label()}"] = _time_ms(
                            lambda: int4_stream_gemm(x, *int4_w(), 128, counters, tiles=tt), device)
            rec[f"{name}_{n}x{k}_m{m}"] = r
            best = {kind: min(((v, key) for key, v in r.items() if key.startswith(kind + ":")), default=None)
                    for kind in ("fp8", "int4")}
            print(f"  {name} {n}x{k} m={m}: bf16 {r['bf16'] * 1000:.1f} us; " + "; ".join(
                f"{kind} best {b[1]} {b[0] * 1000:.1f} us" for kind, b in best.items() if b) +
                (f"; scaled_mm {r['fp8_scaled_mm'] * 1000:.1f}" if 'fp8_scaled_mm' in r else "") +
                (f"; old int4 {r['int4_old_fused'] * 1000:.1f}" if 'int4_old_fused' in r else "") +
                (f"; dequant+mm {r['int4_dequant_mm'] * 1000:.1f}" if 'int4_dequant_mm' in r else ""), flush=True)
        del w, wq, wt, bf16_w, fp8_w, int4_w
        if cuda:
            torch.cuda.empty_cache()
        with open(os.path.join(OUT, "tune-partial.json"), "w") as f:  # survives a timeout
            json.dump(rec, f)
        for line in suggest_tables(rec):
            print("  TABLE " + line, flush=True)
    # Per row count: the layer's four linears, each at its best tile, vs bf16.
    totals: dict = {}
    for key, r in rec.items():
        m = key.rsplit("_m", 1)[1]
        t = totals.setdefault(m, {})
        for kind in ("bf16", "fp8_scaled_mm", "int4_old_fused", "int4_dequant_mm"):
            if kind in r:
                t[kind] = t.get(kind, 0.0) + r[kind]
        for kind in ("fp8", "int4"):
            vals = [v for k2, v in r.items() if k2.startswith(kind + ":")]
            if vals:
                t[kind + "_best"] = t.get(kind + "_best", 0.0) + min(vals)
    results["tune_layer_totals_ms"] = totals
    for m, t in totals.items():
        print(f"  layer m={m}: " + ", ".join(f"{k2} {v * 1000:.0f} us ({v / t['bf16']:.2f}x)" for k2, v in t.items()),
              flush=True)


# ---------------------------------------------------------------- the parts, each in a subprocess

PARTS = ["kernels", "bf16", "fp8", "int4", "int4panels", "kvfp8", "fp8kv", "micro", "tiny", "tune", "sweep", "int4sweep", "profile",
         "w8a8"]
PARTS += ["pdlplant", "pdl", "siluquant", "fp8engines"]  # scripts/gpu_fp8_engines.py (not by default)
PARTS += ["b1"]  # scripts/gpu_fp8_batch1.py (not by default)
PARTS += ["b1profile"]  # scripts/gpu_fp8_b1_profile.py (not by default)
PARTS += ["int4gemm", "int4profile"]  # scripts/gpu_int4_gemm.py; the int4 engine under profile_one (not by default)
PARTS.insert(PARTS.index("int4") + 1, "int4bf16head")  # the int4 engine with the bf16 LM head (not by default)
PARTS.insert(PARTS.index("int4") + 1, "int4before")  # session 8's int4 engine, for A/B (not by default)
PARTS[PARTS.index("int4") + 1:PARTS.index("int4") + 1] = ["int4x1", "int4x2"]  # (not by default)
PARTS += ["bf16profile"]  # the bf16 engine under profile_one: int4profile's baseline (not by default)
PARTS += ["w8a8tma"]  # scripts/gpu_fp8_gemm.py (not by default)
PARTS += ["int4b1"]  # scripts/gpu_int4_b1.py (not by default)
PART_DEADLINE_ENV = "GPU_QUANT_PART_DEADLINE"  # a part's kill time (time.time()), set for its process
# Most seconds a part may take (the budget left caps it further).
PART_CAP_S = {"kernels": 120, "bf16": 170, "fp8": 120, "int4": 170, "int4panels": 80, "kvfp8": 148, "fp8kv": 100, "micro": 70, "tiny": 100, "tune": 150, "sweep": 150,
              "int4sweep": 150, "profile": 150, "w8a8": 100}
PART_CAP_S.update({"pdl": 100, "pdlplant": 40, "siluquant": 40, "fp8engines": 400, "b1": 90, "w8a8tma": 90,
                   "b1profile": 118})
PART_CAP_S.update({"int4gemm": 150, "int4profile": 120, "int4bf16head": 80, "int4b1": 150, "int4before": 90,
                   "int4x1": 90, "int4x2": 90,
                   "bf16profile": 120})


def run_part(name: str, smoke: bool) -> dict:
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    results: dict = {}
    start = time.perf_counter()
    try:
        if name == "kernels":
            kernels(results, device)
        elif name == "tiny":
            tiny(results, device)
        elif name == "micro":
            micro(results, device)
        elif name == "tune":
            tune(results, device)
        elif name == "sweep":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_quant_sweep
            gpu_quant_sweep.sweep(results, device, _time_ms, _cycled, check)
        elif name == "int4sweep":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_int4_sweep
            gpu_int4_sweep.sweep(results, device, _time_ms, _cycled, check)
        elif name == "w8a8tma":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_fp8_gemm
            gpu_fp8_gemm.sweep(results, device, _time_ms, _cycled, check, OUT, config_dir)
        elif name == "int4gemm":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_int4_gemm
            gpu_int4_gemm.sweep(results, device, _time_ms, _cycled, check, OUT)
        elif name == "int4profile":  # where an INT4 engine's decode steps (256 rows, batch 1) and prefill go
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_quant_fp8
            gpu_quant_fp8.profile_one(results, "int4", smoke, SMOKE if smoke else LLAMA8B,
                                      lambda shape: config_dir(shape, GPTQ_CONFIG), OUT)
        elif name == "bf16profile":  # the same windows as int4profile, for the bf16 engine
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_quant_fp8
            gpu_quant_fp8.profile_one(results, "bf16", smoke, SMOKE if smoke else LLAMA8B, config_dir, OUT)
        elif name == "int4b1":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_int4_b1
            gpu_int4_b1.b1_part(results, device, smoke, SMOKE if smoke else LLAMA8B, config_dir, OUT, ms_per_token,
                                check)
        elif name == "b1":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_fp8_batch1
            gpu_fp8_batch1.batch1_part(results, device, smoke, check, _time_ms, _cycled, OUT)
        elif name == "b1profile":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_fp8_b1_profile
            gpu_fp8_b1_profile.profile_part(results, device, smoke, SMOKE if smoke else LLAMA8B, config_dir, OUT,
                                            ms_per_token, _time_ms, _cycled, check)
        elif name in ("pdl", "pdlplant", "siluquant", "fp8engines"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_fp8_engines
            shape = SMOKE if smoke else LLAMA8B
            if name == "pdlplant":
                gpu_fp8_engines.plant_part(results, device, smoke, check)
            elif name == "siluquant":
                gpu_fp8_engines.silu_quant_part(results, device, smoke, check)
            elif name == "pdl":
                gpu_fp8_engines.pdl_part(results, device, smoke, shape, config_dir, OUT, check, ms_per_token)
            else:
                gpu_fp8_engines.engines_part(results, device, smoke, shape, config_dir, OUT, throughput, ms_per_token)
        elif name in ("profile", "w8a8") or name.startswith("profile-one-"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_quant_fp8
            if name == "w8a8":
                gpu_quant_fp8.w8a8(results, device, _time_ms, _cycled, check)
            elif name == "profile":
                gpu_quant_fp8.profile(results, device, smoke, os.path.abspath(__file__), OUT, SMOKE if smoke else LLAMA8B)
            else:
                gpu_quant_fp8.profile_one(results, name.removeprefix("profile-one-"), smoke, SMOKE if smoke else LLAMA8B,
                                          config_dir, OUT)
        elif name == "kvfp8":  # bf16 KV and fp8 KV engines side by side in this process
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_kvfp8
            only = os.environ.get("GPU_QUANT_WORKLOADS")
            gpu_kvfp8.side_by_side(results, smoke, config_dir(SMOKE if smoke else LLAMA8B), 1024 if smoke else 16384,
                                   [w for w in ENGINES["kvfp8"][1] if not only or w in only.split(",")], OUT,
                                   throughput, (lambda n: max(1, n // 64)) if smoke else (lambda n: n))
        else:
            engine_part(results, name, smoke)
    except Exception:
        traceback.print_exc()
        FAILURES.append(f"{name} raised")
    results["failures"] = list(FAILURES)
    results["seconds"] = time.perf_counter() - start
    return results


def _ratios(timings: dict) -> list[dict]:
    base = timings.get("bf16", {})
    rows = []
    for label, w, goal, higher in GOALS:
        # kvfp8 has its own bf16-KV baseline, measured in the same process (scripts/gpu_kvfp8.py).
        value, ref = timings.get(label, {}).get(w), timings.get(f"{label}_bf16kv", base).get(w)
        r = value / ref if value is not None and ref else None
        met = None if r is None else (r >= goal * (0.995 if w == "kv_blocks" else 1.0) if higher else r <= goal)
        rows.append({"part": label, "workload": w, "value": value, "bf16": ref, "ratio": r,
                     "goal": f"{'>=' if higher else '<='} {goal}x", "met": met})
    for label, w in INFO:
        value, ref = timings.get(label, {}).get(w), base.get(w)
        if value is not None and ref:
            rows.append({"part": label, "workload": w, "value": value, "bf16": ref, "ratio": value / ref,
                         "goal": "(none)", "met": None})
    return rows


def _fp8_profile_lines(results: dict) -> list[str]:
    """The profile part's group tables, and each workload's bound beside the measured tok/s."""
    if not results.get("profile"):
        return []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_quant_fp8
    lines = gpu_quant_fp8.group_table(results["profile"])
    b, timings = results.get("bounds", {}), results.get("timings", {})
    if b:
        lines += ["", "Physical bound of each workload (prefill at the profiled GEMM rate, decode at max(bytes / copy "
                  "bandwidth, FLOPs / that rate), bf16 KV reads included) and the fraction reached:", "",
                  "| engine | workload | bound tok/s | measured tok/s | fraction | bound fp8 / bf16 |", "|---|---|---|---|---|---|"]
        for label, rec in b.items():
            for w, v in rec.items():
                if not isinstance(v, dict):
                    continue
                got = timings.get(label, {}).get(w)
                bound = v["bound_tok_s"]
                other = b.get("bf16", {}).get(w, {}).get("bound_tok_s")
                measured = "— | —" if got is None else f"{got:,.0f} | {got / bound:.2f}"
                lines.append(f"| {label} ({rec['gemm_tflops_prefill']:.0f} TFLOP/s, {rec['copy_tb_s']:.2f} TB/s) | {w} | "
                             f"{bound:,.0f} | {measured} | {bound / other if other else float('nan'):.2f} |")
    return lines


def _markdown(results: dict) -> str:
    unit = {"kv_blocks": "blocks", "batch1": "ms/token", "batch1_16k": "ms/token"}
    lines = [f"# gpu_quant on {results['device']} (torch {results['torch']}, triton {results.get('triton')})", "",
             "| quantized | workload | value | bf16 | ratio | goal | met |", "|---|---|---|---|---|---|---|"]
    for r in results.get("goals", []):
        fmt = (lambda v: "—" if v is None else f"{v:,.2f}")
        lines.append(f"| {r['part']} | {r['workload']} ({unit.get(r['workload'], 'output tok/s')}) | {fmt(r['value'])} "
                     f"| {fmt(r['bf16'])} | {fmt(r['ratio'])} | {r['goal']} | "
                     f"{'—' if r['met'] is None else 'yes' if r['met'] else 'NO'} |")
    totals = results.get("micro_layer_totals_ms")
    if totals:
        cols = ["bf16", "fp8", "fp8_stream", "fp8_scaled_mm", "fp8_w8a8", "int4", "int4_old_fused", "int4_dequant_mm"]
        lines += ["", "One Llama-8B layer's four linears (CUDA-graph replays, weights cycled past L2), "
                  "microseconds (fp8 and int4: the engine's path):", "",
                  "| rows | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for m, t in totals.items():
            lines.append(f"| {m} | " + " | ".join(f"{t[c] * 1000:.0f}" if c in t else "—" for c in cols) + " |")
    tune_totals = results.get("tune_layer_totals_ms")
    if tune_totals:
        cols = ["bf16", "fp8_scaled_mm", "fp8_best", "int4_old_fused", "int4_dequant_mm", "int4_best"]
        lines += ["", "Tile sweep: the layer's four linears, each at its best tile (microseconds):", "",
                  "| rows | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for m, t in tune_totals.items():
            lines.append(f"| {m} | " + " | ".join(f"{t[c] * 1000:.0f}" if c in t else "—" for c in cols) + " |")
    lines += _fp8_profile_lines(results)
    if results.get("fp8_bound_lines"):  # the fp8engines part's per-step bounds
        lines += [""] + results["fp8_bound_lines"]
    lines += ["", f"Parts: {results['part_status']}", f"Failures: {results['failures'] or 'none'}", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(p for p in PARTS if p not in ("tune", "sweep", "int4sweep", "profile", "w8a8",
                                                                          "pdl", "pdlplant", "siluquant", "fp8engines",
                                                                          "int4panels", "b1", "b1profile", "int4gemm",
                                                                          "int4profile", "int4bf16head", "int4before", "w8a8tma",
                                                                          "int4x1", "int4x2",
                                                                          "bf16profile",
                                                                          "int4b1")))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks that the script runs")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for all parts together")
    ap.add_argument("--workloads", help="engine parts time only these (e.g. 1000x512x256,batch1_16k)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # run one part in this process
    ap.add_argument("--precompile", help=argparse.SUPPRESS)  # compile one shard of tune's kernels
    ns = ap.parse_args()
    if ns.workloads:
        os.environ["GPU_QUANT_WORKLOADS"] = ns.workloads  # the parts' subprocesses inherit it
    if ns.precompile:
        precompile_shard(ns.precompile)
        return 0
    os.makedirs(OUT, exist_ok=True)
    if ns.child:
        res = run_part(ns.child, ns.smoke)
        with open(os.path.join(OUT, f"part-{ns.child}.json"), "w") as f:
            json.dump(res, f, indent=2)
        return 1 if res["failures"] else 0
    parts = [p for p in PARTS if p in ns.parts.split(",")]
    unknown = set(ns.parts.split(",")) - set(PARTS)
    if unknown:
        print(f"unknown parts {sorted(unknown)}; parts: {', '.join(PARTS)}")
        return 2
    if not ns.smoke and not torch.cuda.is_available():
        print("no CUDA device: use --smoke on a CPU")
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    results: dict = {"device": torch.cuda.get_device_name() if not ns.smoke else "cpu", "torch": torch.__version__,
                     "triton": triton_version, "parts": parts, "part_status": {}, "failures": []}
    start = time.perf_counter()
    for name in parts:
        budget = ns.budget if not ns.smoke else max(ns.budget, 3600.0)  # a shared CPU is slow: no cut
        left = budget - (time.perf_counter() - start)
        if left < 20:
            print(f"== {name}: skipped, {left:.0f} s of the budget left", flush=True)
            results["part_status"][name] = "skipped (budget)"
            continue
        limit = min(PART_CAP_S[name], left) if not ns.smoke else left
        print(f"== {name} (limit {limit:.0f} s; {time.perf_counter() - start:.0f} s elapsed)", flush=True)
        part_file = os.path.join(OUT, f"part-{name}.json")
        if os.path.exists(part_file):
            os.remove(part_file)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + (["--smoke"] if ns.smoke else [])
        t0 = time.perf_counter()
        # the wall-clock time the part is killed at: a part may cut itself short before it (w8a8tma)
        os.environ[PART_DEADLINE_ENV] = str(time.time() + limit)
        try:
            rc = subprocess.run(cmd, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        took = time.perf_counter() - t0
        part = {}
        if os.path.exists(part_file):
            with open(part_file) as f:
                part = json.load(f)
        status = "ok" if rc == 0 else f"rc={rc}"
        results["part_status"][name] = f"{status} ({took:.0f} s)"
        if rc != 0 and not part.get("failures"):
            results["failures"].append(f"{name}: {'timed out' if rc == 'timeout' else 'crashed'} ({status})")
        results["failures"] += part.pop("failures", [])
        part.pop("seconds", None)
        for key, value in part.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    results.setdefault(key, {})[sub] = v
            else:
                results[key] = value
        print(f"== {name}: {status} in {took:.0f} s", flush=True)
    if not ns.smoke:
        results["goals"] = _ratios(results.get("timings", {}))
    results["seconds"] = time.perf_counter() - start
    with open(os.path.join(OUT, "gpu_quant.json"), "w") as f:
        json.dump(results, f, indent=2)
    md = _markdown(results)
    with open(os.path.join(OUT, "gpu_quant.md"), "w") as f:
        f.write(md)
    print(json.dumps(results.get("timings", {}), indent=2))
    print(md)
    print(f"done in {results['seconds']:.0f} s; {len(results['failures'])} failures")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
