"""Per-step physical bounds of the fp8engines workloads (scripts/gpu_fp8_engines.py), from rates
measured on this card in the same process: copy bandwidth, bf16 cuBLAS and row-wise fp8
`torch._scaled_mm` on a prefill-sized GEMM (8192 x 14336 x 4096).

A workload N x I x O (N prompts of I tokens, O output tokens each) at R = min(N, max_num_seqs,
what the KV pool holds at I + O tokens) rows:
- prefill: N * I tokens, each 2 * (linear params) FLOPs at the GEMM rate, plus causal attention
  (2 * 2 * ctx * hidden FLOPs per token and layer, ctx the mean prefix) at the same rate;
- decode: N * (O - 1) tokens in steps of R rows; the step at output position j takes
  max(bytes / bandwidth, FLOPs / GEMM rate), bytes = the weights (fp8: linears at 1 byte, the
  LM head in bf16) + every row's KV (I + j tokens, 2 bytes per value, fp8 KV 1), FLOPs = 2 * R *
  (linear + LM head params);
- bound tok/s = N * O / (prefill + decode). No step overheads, no norms, no sampling: a ceiling.
- serial bound: the same, but a decode step's GEMMs (max(weight bytes / bandwidth, FLOPs / rate))
  and its attention (KV bytes / bandwidth) one after the other, as the engine runs them (no kernel
  overlaps the two): the ceiling for this engine's structure.
The ratio of two engines' bounds says what speed-up the bytes and FLOPs allow at best.
"""

from __future__ import annotations

import torch

# The Llama-3.1-8B shape of gpu_quant.py's LLAMA8B, as figures.
BLOCK_SIZE = 16


def model_figures(shape: dict) -> dict:
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv_heads, heads, vocab = shape["num_key_value_heads"], shape["num_attention_heads"], shape["vocab_size"]
    head_dim = h // heads
    linear = layers * (h * (h + 2 * kv_heads * head_dim) + h * h + 2 * i * h + i * h)
    return {"linear_params": linear, "lm_head_params": vocab * h, "layers": layers, "hidden": h,
            "kv_values_per_token": 2 * layers * kv_heads * head_dim}


def _time_s(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def measure_rates(device: str) -> dict:
    """copy bytes/s, bf16 and fp8 GEMM FLOP/s on this card (CPU smoke: nominal figures). Its memory
    goes back to the device after (an engine built next sizes its KV pool from what is free)."""
    if device != "cuda":
        return {"copy_b_s": 50e9, "bf16_flop_s": 1e12, "fp8_flop_s": 2e12}
    rates = _measure_cuda(device)
    torch.cuda.empty_cache()
    return rates


def _measure_cuda(device: str) -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.numel() / _time_s(lambda: y.copy_(x))
    del x, y
    m, n, k = 8192, 14336, 4096
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    bf16 = 2 * m * n * k / _time_s(lambda: a @ b.t())
    aq, bq = a.to(torch.float8_e4m3fn), b.mul(40).to(torch.float8_e4m3fn)
    sa = torch.ones(m, 1, device=device)
    sb = torch.ones(1, n, device=device)
    fp8 = 2 * m * n * k / _time_s(lambda: torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return {"copy_b_s": copy, "bf16_flop_s": bf16, "fp8_flop_s": fp8}


def workload_bound(f: dict, rates: dict, fp8_weights: bool, kv_bytes: int, kv_blocks: int | None,
                   num: int, inp: int, outp: int, max_seqs: int = 256) -> dict:
    rate = rates["fp8_flop_s" if fp8_weights else "bf16_flop_s"]
    bw = rates["copy_b_s"]
    hold = kv_blocks * BLOCK_SIZE // (inp + outp) if kv_blocks else num
    rows = max(1, min(num, max_seqs, hold))
    attn_flops = 2 * 2 * (inp / 2) * f["hidden"] * f["layers"]  # per prompt token: q.k and p.v over the mean prefix
    prefill_s = num * inp * (2 * f["linear_params"] + attn_flops) / rate
    wbytes = f["linear_params"] * (1 if fp8_weights else 2) + 2 * f["lm_head_params"]
    step_flops = 2 * rows * (f["linear_params"] + f["lm_head_params"])
    steps = num * (outp - 1) / rows
    decode_s = serial_s = 0.0
    for j in range(outp - 1):
        kv = rows * (inp + j) * f["kv_values_per_token"] * kv_bytes
        decode_s += max((wbytes + kv) / bw, step_flops / rate) * steps / (outp - 1)
        serial_s += (max(wbytes / bw, step_flops / rate) + kv / bw) * steps / (outp - 1)
    return {"rows": rows, "prefill_s": prefill_s, "decode_s": decode_s, "bound_tok_s": num * outp / (prefill_s + decode_s),
            "serial_decode_s": serial_s, "serial_bound_tok_s": num * outp / (prefill_s + serial_s)}


def engine_bounds(shape: dict, rates: dict, timings: dict, engines: list) -> dict:
    """engines: (label, engine kwargs, workloads) as gpu_fp8_engines.FP8_ENGINES; timings: the measured
    tok/s and KV blocks per label. Returns label -> workload -> bound record (+ measured, fraction)."""
    f = model_figures(shape)
    out: dict = {}
    for label, kwargs, workloads in engines:
        fp8_w = kwargs.get("quantization") == "fp8"
        kv = 1 if str(kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else 2
        got = timings.get(label, {})
        for w in workloads:
            if w == "batch1":
                continue
            num, inp, outp = (int(v) for v in w.split("x"))
            b = workload_bound(f, rates, fp8_w, kv, got.get("kv_blocks"), num, inp, outp)
            if got.get(w):
                b["measured_tok_s"] = got[w]
                b["fraction"] = got[w] / b["bound_tok_s"]
            out.setdefault(label, {})[w] = b
    return out


def bound_lines(bounds: dict, rates: dict) -> list[str]:
    """A markdown table: each engine and workload, its bound, measured, fraction, both ratios to bf16."""
    lines = [f"Bounds (copy {rates['copy_b_s'] / 1e12:.2f} TB/s, bf16 GEMM {rates['bf16_flop_s'] / 1e12:.0f} TFLOP/s, "
             f"fp8 GEMM {rates['fp8_flop_s'] / 1e12:.0f} TFLOP/s, measured in this process):", "",
             "| engine | workload | rows | bound tok/s | measured | fraction | bound / bf16's | measured / bf16's | "
             "serial bound | fraction of it | serial bound / bf16's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = bounds.get("bf16", {})
    for label, recs in bounds.items():
        for w, b in recs.items():
            ref = base.get(w, {})
            rb = b["bound_tok_s"] / ref["bound_tok_s"] if ref else float("nan")
            rm = b.get("measured_tok_s", 0) / ref["measured_tok_s"] if ref.get("measured_tok_s") and \
                b.get("measured_tok_s") else float("nan")
            sb = b["serial_bound_tok_s"]
            rs = sb / ref["serial_bound_tok_s"] if ref else float("nan")
            fs = b["measured_tok_s"] / sb if b.get("measured_tok_s") else float("nan")
            lines.append(f"| {label} | {w} | {b['rows']} | {b['bound_tok_s']:,.0f} | {b.get('measured_tok_s', 0):,.0f} | "
                         f"{b.get('fraction', float('nan')):.2f} | {rb:.2f} | {rm:.2f} | {sb:,.0f} | {fs:.2f} | {rs:.2f} |")
    return lines
