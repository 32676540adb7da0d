"""Multi-LoRA on CUDA in one command: kernel checks and timings, then the engine against the base
model in the same run. Prints a table per part, writes $OUT/gpu_lora.json and $OUT/gpu_lora.md
(default ./gpu-out; rewritten after every part, so a run cut short keeps what it measured), exits 1
on a failed check.

Parts (--parts, comma-separated; default micro,layer,tiny,engine,batch1; also profile):
  micro   the Triton shrink + expand of one projection on Llama-3.1-8B shapes (qkv 4096->6144,
          o 4096->4096, gate_up 4096->28672, down 14336->4096), rank 16, 64 slots, at 1, 16, 64,
          256 and 8192 tokens with 1, 8 and 64 adapters mixed uniformly: checked against the torch
          reference (bfloat16), timed eagerly and as CUDA-graph replays, next to the base bf16 GEMM
          of the same shape (gate_up: the GEMM and SiLU-and-mul vs the GEMM and the LoRA expand
          fused with the activation, as the engine runs it); at 16 and 64 tokens both kernel kinds
          (per-token "rows", slot "tiles"); with the shrink in stream order and beside the GEMM;
          the per-step plan; and per token count the four projections summed (one decoder layer)
  layer   32 Llama-3.1-8B decoder layers' GEMMs (qkv, o, gate_up + SiLU-and-mul, down) with every
          projection's LoRA in one CUDA graph, the step's plan inside: us per layer at 1, 16, 64,
          256, 8192 tokens with 1, 8, 64 adapters, base and variants (side stream off / normal /
          high priority, no fusion, every slot -1, the tile knobs); one layer checked against the
          torch reference per size
  tiny    a tiny random Llama, float32, CUDA graphs on (and eager): base and three adapters mixed
          in one batch vs HF + PEFT greedy; again with one slot (eviction and reload mid-run)
  engine  Llama-3.1-8B shape, dummy weights, CUDA graphs on, rank-16 adapters on all seven
          projections: N prompts x 512 in x 256 out (N = --prompts, 1000 by default: the issue's
          shape), the base engine and the LoRA engine (max_loras=64) alive together with the SAME
          number of KV blocks (the LoRA engine sizes its pool from --lora-memory, the base engine
          gets that count; or --kv-blocks for both), each run's blocks and preemptions recorded:
          a round of a base run and a 1-adapter run, 8 and 64 adapters mixed uniformly against the
          median base, then more rounds (the median round's ratio, every round and the spread
          reported) and base requests in the LoRA engine while --budget allows; goals 0.90x,
          0.85x, 0.80x the base's output tok/s (`scripts/lora_engines.py`)
  batch1  one prompt, 512 in x 256 out: ms per output token, base engine vs an adapter (goal <= 1.10x),
          --batch1-runs alternations (and one base request in the LoRA engine), the medians
  profile torch.profiler over a prefill step (16 x 512 tokens) and 256-row decode steps: base engine,
          1 adapter, base requests in the LoRA engine, prefill variants (`scripts/lora_profile.py`)
  Every configuration of an engine is warmed (a short run of its mix) before the first timing;
  every timed run has prompts of its own (no prefix-cache hits between runs).

    python scripts/gpu_lora.py                      # everything, on an H100 (under 8 minutes)
    python scripts/gpu_lora.py --parts micro
    python scripts/gpu_lora.py --smoke              # CPU: tiny shapes, Triton interpreter, a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the kernels run under Triton's interpreter on CPU (read when they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))

from scripts.device_check import SHAPES, config_dir  # noqa: E402
from tokenmill.benchmarks.throughput import make_prompts, summarize  # noqa: E402

OUT = os.environ.get("OUT", os.path.join(os.getcwd(), "gpu-out"))
START = time.perf_counter()
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GOALS = {1: 0.90, 8: 0.85, 64: 0.80}
BATCH1_GOAL = 1.10
FAILED: list[str] = []
MARKDOWN: dict[str, list[str]] = {}


def check(ok: bool, what: str) -> bool:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILED.append(what)
    return ok


def save(results: dict) -> None:
    results["failed"] = FAILED
    with open(os.path.join(OUT, "gpu_lora.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(OUT, "gpu_lora.md"), "w") as f:
        f.write(f"# Multi-LoRA on {results['device']} (torch {results['torch']})\n\n")
        for title, lines in MARKDOWN.items():
            f.write(f"## {title}\n\n" + "\n".join(lines) + "\n\n")


# ---------------------------------------------------------------- micro: one projection's LoRA

def _time_eager(fn, iters: int = 20) -> float:
    """Microseconds per call, launched eagerly one after another (the host's launch cost shows
    when it exceeds the GPU's time)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _time_graph(fn, reps: int = 10, replays: int = 200) -> float:
    """Microseconds per call inside a CUDA graph: `reps` calls captured, the graph replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    replays = max(3, min(replays, int(50.0 / max(start.elapsed_time(end), 1e-3))))  # about 50 ms at most
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def micro(results: dict, args) -> None:
    from tokenmill.layers.lora import triton_lora
    from tokenmill.layers.lora.lora_layer import run_beside
    from tokenmill.layers.lora.torch_lora import lora_reference
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.lora.triton_expand import lora_expand
    from tokenmill.layers.lora.triton_fused import lora_expand_silu
    from tokenmill.layers.lora.triton_lora import plan_step
    from tokenmill.layers.lora.triton_shrink import lora_shrink

    device = "cpu" if SMOKE else "cuda"
    dtype = torch.float32 if SMOKE else torch.bfloat16
    rank, num_slots = 16, 64
    projections = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]),
                   "gate_up+act": (4096, [14336, 14336]), "down": (14336, [4096])}
    token_counts, adapter_counts, both_kinds = (1, 16, 64, 256, 8192), (1, 8, 64), (16, 64)
    if SMOKE:
        projections = {"qkv": (64, [64, 32, 32]), "gate_up+act": (64, [48, 48]), "down": (96, [64])}
        token_counts, adapter_counts, both_kinds, num_slots = (1, 5, 40), (1, 4), (5,), 4
    rows_max = triton_lora.ROWS_MAX_TOKENS
    side = None if SMOKE else torch.cuda.Stream()
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    act = SiluAndMul()
    for proj, (k, parts) in projections.items():
        # gate_up as the engine runs it: its expand fused with SiLU-and-mul, against GEMM + activation.
        fused = proj.startswith("gate_up")

        def finish(planes, y_out, plan):
            if fused:
                return lora_expand_silu(planes, b, plan, y_out)
            return lora_expand(planes, b, plan, y_out, starts)

        starts = tuple(int(v) for v in torch.tensor([0] + parts).cumsum(0))
        n = starts[-1]
        a = (torch.randn(num_slots, len(parts) * rank, k, generator=g, device=device) / k ** 0.5).to(dtype)
        b = (torch.randn(num_slots, n, rank, generator=g, device=device) * 0.05).to(dtype)
        w = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(dtype)
        for tokens in token_counts:
            x = torch.randn(tokens, k, generator=g, device=device).to(dtype)
            y = torch.zeros(tokens, n, device=device, dtype=dtype)
            base = {}
            if not SMOKE:
                out = torch.empty(tokens, n, device=device, dtype=dtype)
                mm = lambda: torch.mm(x, w.t(), out=out)  # noqa: E731
                gemm = (lambda: act(mm())) if fused else mm  # noqa: E731
                base = {"gemm_eager_us": _time_eager(gemm), "gemm_graph_us": _time_graph(gemm)}
            for adapters in adapter_counts:
                if adapters > tokens and adapters != adapter_counts[0]:
                    continue  # no more distinct adapters than tokens
                perm = torch.randperm(tokens, generator=g, device=device)
                token_slots = perm % adapters  # a uniform mix, every token with an adapter
                kinds = ["auto"] + (["other"] if tokens in both_kinds else [])
                for kind in kinds:
                    try:
                        use_rows = (tokens <= rows_max) if kind == "auto" else not tokens <= rows_max
                        limit = tokens if use_rows else tokens - 1
                        plan = plan_step(token_slots, num_slots, {(a.shape[1], k)}, rows_max=limit)
                        label = "rows" if plan.order is None else f"tiles{triton_lora.tile_rows(tokens)}"
                        # The check: the delta alone (y = 0), on up to 64 rows against the reference.
                        got = finish(lora_shrink(x, a, plan), y.clone(), plan).float()
                        sub = perm[:64]
                        want = lora_reference(x[sub], a, b, starts, token_slots[sub])
                        if fused:  # y = 0: the activation of the delta alone
                            gate, up = want.to(dtype).float().chunk(2, dim=1)
                            want = torch.nn.functional.silu(gate).to(dtype).float() * up
                        err = (got[sub] - want).abs().max().item()
                        scale = want.abs().max().item()
                        ok = err <= (1e-4 if SMOKE else 2e-2) * max(scale, 1e-3)
                        check(ok, f"micro {proj} T={tokens} adapters={adapters} {label}: max error {err:.2e} "
                                  f"(delta scale {scale:.2f})")
                        row = {"proj": proj, "tokens": tokens, "adapters": adapters, "kernel": label,
                               "auto": kind == "auto", "max_err": err, "ok": ok, **base}
                        if not SMOKE:
                            ybuf = y.clone()
                            fn = lambda: finish(lora_shrink(x, a, plan), ybuf, plan)  # noqa: E731
                            row["lora_eager_us"] = _time_eager(fn)
                            row["lora_graph_us"] = _time_graph(fn)
                            # The projection as the engine runs it: the base GEMM, then the LoRA, in
                            # stream order ("seq") or with the shrink beside the GEMM ("overlap").
                            row["both_seq_us"] = _time_graph(lambda: finish(lora_shrink(x, a, plan), mm(), plan))
                            row["both_overlap_us"] = _time_graph(
                                lambda: finish(*run_beside(side, lambda: lora_shrink(x, a, plan), mm), plan))
                            if proj == "qkv":  # once per step, shared by every projection
                                row["plan_graph_us"] = _time_graph(
                                    lambda: plan_step(token_slots, num_slots, {(a.shape[1], k)}, rows_max=limit))
                        rows.append(row)
                    except Exception as exc:  # one shape's failure: recorded, the others still measured
                        traceback.print_exc()
                        check(False, f"micro {proj} T={tokens} adapters={adapters} {kind} raised {exc!r}"[:400])
            del x, y
    results["micro"] = rows
    if SMOKE:
        return
    head = ["proj", "T", "adapters", "kernel", "gemm eager", "gemm graph", "lora eager", "lora graph",
            "gemm+lora seq", "gemm+lora overlap", "+% seq", "+% overlap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("  times in us per call; graph: CUDA-graph replay; +%: gemm+lora over the gemm alone (graph)")
    print("  " + " ".join(f"{h:>11}" for h in head))
    for r in rows:
        g0 = r["gemm_graph_us"]
        cells = [r["proj"], r["tokens"], r["adapters"], r["kernel"] + ("" if r["auto"] else "*"),
                 f"{r['gemm_eager_us']:.1f}", f"{g0:.1f}", f"{r['lora_eager_us']:.1f}", f"{r['lora_graph_us']:.1f}",
                 f"{r['both_seq_us']:.1f}", f"{r['both_overlap_us']:.1f}",
                 f"{100 * (r['both_seq_us'] / g0 - 1):.1f}", f"{100 * (r['both_overlap_us'] / g0 - 1):.1f}"]
        print("  " + " ".join(f"{str(c):>11}" for c in cells))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    lines.append("kernel: rows = per-token kernels, tilesM = slot tiles of M rows; * = not the one the engine picks")
    MARKDOWN["micro: one projection's shrink + expand (rank 16, 64 slots) vs its base GEMM"] = lines
    # One decoder layer: the four projections summed (the kernel the engine would pick).
    layer_lines = ["| T | adapters | GEMMs us | LoRA alone us | GEMM+LoRA seq us | +% | GEMM+LoRA overlap us | +% "
                   "| plan us per step |", "|---|---|---|---|---|---|---|---|---|"]
    print("  per layer (the 4 projections summed, graph replay):")
    for tokens in token_counts:
        for adapters in adapter_counts:
            picked = [r for r in rows if r["tokens"] == tokens and r["adapters"] == adapters and r["auto"]]
            if len(picked) != len(projections):
                continue
            sums = {key: sum(r[key] for r in picked) for key in ("gemm_graph_us", "lora_graph_us", "both_seq_us",
                                                                 "both_overlap_us")}
            plan_us = next(r.get("plan_graph_us", 0.0) for r in picked if r["proj"] == "qkv")
            g0 = sums["gemm_graph_us"]
            seq, over = 100 * (sums["both_seq_us"] / g0 - 1), 100 * (sums["both_overlap_us"] / g0 - 1)
            results.setdefault("micro_layer", []).append(
                {"tokens": tokens, "adapters": adapters, "plan_us": plan_us, **sums})
            print(f"    T={tokens:5} adapters={adapters:3}: GEMMs {g0:8.1f} us, LoRA {sums['lora_graph_us']:7.1f}, "
                  f"GEMM+LoRA {sums['both_seq_us']:8.1f} (+{seq:.1f}%) seq, {sums['both_overlap_us']:8.1f} "
                  f"(+{over:.1f}%) overlap; plan {plan_us:.1f} us per step")
            layer_lines.append(f"| {tokens} | {adapters} | {g0:.1f} | {sums['lora_graph_us']:.1f} | "
                               f"{sums['both_seq_us']:.1f} | {seq:.1f} | {sums['both_overlap_us']:.1f} | {over:.1f} | "
                               f"{plan_us:.1f} |")
    MARKDOWN["micro: one decoder layer (the four projections), graph replay"] = layer_lines


# ---------------------------------------------------------------- layer: a stack of decoder layers' GEMMs

LAYER_VARIANTS = {
    # name: (LoRA on, slots (None: the mix; -1: every token without an adapter), side stream, knobs of
    # triton_lora or lora_layer (LORA_LAYER_KNOBS))
    "base": (False, None, None, None),
    "base_strided": (False, None, None, dict(strided=True)),  # base GEMMs on the LoRA engine's wider weights
    "noconcat": (True, None, "normal", dict(CONCAT=False)),  # one adapter as 8 or 64 run (before the concat path)
    "concat_all": (True, None, "normal", dict(CONCAT_SINKS=True)),  # o's and down's LoRA inside their GEMMs too
    "dense_concat_all": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True, CONCAT_SINKS=True)),
    "dense_noconcat": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True, CONCAT=False)),
    "noop": (True, -1, "normal", None),
    "engine": (True, None, "normal", None),  # as the engine runs it (the defaults)
    "seq": (True, None, None, None),  # no side stream
    "nosink": (True, None, "normal", dict(SINK_MODE="never")),  # o/down deltas into y (before the sink)
    "sink_all": (True, None, "normal", dict(SINK_OVERLAP_MAX_TOKENS=1 << 30)),
    "sink_seq": (True, None, None, dict(SINK_MODE="always")),  # into the stream, in stream order
    "all_beside": (True, None, "normal", dict(SINK_OVERLAP_MAX_TOKENS=1 << 30, OVERLAP_MAX_TOKENS=1 << 30)),
    "rows32": (True, None, "normal", dict(TILE_ROWS_SMALL=32)),
    "rows64": (True, None, "normal", dict(TILE_ROWS_SMALL=64)),
    "rows64_sink_all": (True, None, "normal", dict(TILE_ROWS_SMALL=64, SINK_OVERLAP_MAX_TOKENS=1 << 30)),
    "rows64s16": (True, None, "normal", dict(TILE_ROWS_SMALL=64, _TILES_MAX_SPLITS=16)),
    "grid2": (True, None, "normal", dict(TILE_GRID_FACTOR=2.0)),
    "unrolled": (True, None, "normal", dict(TILE_SPLITS_UNROLL=True)),  # the tile expands' split loop unrolled
    # an eager step of one adapter known on the host: cuBLAS shrink/expand (engine: prefill chunks)
    "dense": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True)),
    "tiles_eager": (True, None, "normal", dict(DENSE_MIN_TOKENS=1 << 30, host=True)),  # the same without it
    "dense_sink_all": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True, SINK_OVERLAP_MAX_TOKENS=1 << 30)),
    "nofuse": (True, None, "normal", dict(fuse=False)),
    # the dense path adding its delta into y after the base GEMM (before DENSE_FUSED)
    "dense_add": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True, DENSE_FUSED=False)),
    # gate_up's delta through the expand fused with the activation (the others under the GEMM)
    "dense_silu": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True, DENSE_FUSED_SILU=False)),
    "dense_silu256": (True, None, "normal", dict(DENSE_MIN_TOKENS=512, host=True, DENSE_FUSED_SILU=False,
                                                 SILU_TILE_BLOCK_N=256)),
    # the dense path at decode-like sizes (eager mixed steps of a few hundred tokens)
    "dense256": (True, None, "normal", dict(DENSE_MIN_TOKENS=128, host=True)),
    # wider column blocks of the tile expands (fewer, longer programs)
    "silu128": (True, None, "normal", dict(SILU_TILE_BLOCK_N=128)),
    "silu256": (True, None, "normal", dict(SILU_TILE_BLOCK_N=256)),
    "exp256": (True, None, "normal", dict(EXPAND_TILE_BLOCK_N=256)),
    "exp128": (True, None, "normal", dict(EXPAND_TILE_BLOCK_N_SMALL=128)),  # (before: 128 at every size)
    # fewer K splits of the tile shrinks (beside the GEMM in captured steps): fewer planes for the
    # expands on the critical path to sum
    "splits2": (True, None, "normal", dict(_TILES_MAX_SPLITS=2)),
    "splits4": (True, None, "normal", dict(_TILES_MAX_SPLITS=4)),
    # qkv's and gate_up's whole LoRA beside their GEMM into a buffer of its own, then one add
    "delta_beside": (True, None, "normal", dict(DELTA_BESIDE=True)),
    "shrink_only": (True, None, "normal", dict(DELTA_BESIDE=False)),  # only the shrinks beside (before)
    "delta_combo": (True, None, "normal", dict(DELTA_BESIDE=True, _TILES_MAX_SPLITS=2, TILE_GRID_FACTOR=2.0,
                                               EXPAND_TILE_BLOCK_N=256)),
    "combo": (True, None, "normal", dict(SILU_TILE_BLOCK_N=256, _TILES_MAX_SPLITS=2, TILE_GRID_FACTOR=2.0)),
    "combo_exp": (True, None, "normal", dict(SILU_TILE_BLOCK_N=256, _TILES_MAX_SPLITS=2, TILE_GRID_FACTOR=2.0,
                                             EXPAND_TILE_BLOCK_N=256)),
}
LORA_LAYER_KNOBS = {"CONCAT", "CONCAT_SINKS", "CONCAT_EAGER", "CONCAT_GRAPHS", "SINK_MODE", "SINK_EAGER_MIN_TOKENS", "DENSE_MIN_TOKENS", "SINK_OVERLAP_MAX_TOKENS",
                    "OVERLAP_MAX_TOKENS", "DENSE_FUSED", "DENSE_FUSED_SILU", "DELTA_BESIDE"}
DECODE_ONLY = {"noop", "nofuse"}  # (no fusion beyond decode sizes; base requests skip LoRA in eager steps)
TILES_ONLY = {"rows32", "rows64", "rows64_sink_all", "rows64s16", "grid2", "sink_all", "all_beside", "unrolled",
              "silu128", "silu256", "exp256", "splits2", "splits4", "combo", "combo_exp", "delta_beside",
              "delta_combo", "shrink_only", "exp128"}


def layer(results, args) -> None:
    """The GEMMs of `layers` Llama-3.1-8B decoder layers in one CUDA graph as the engine runs them
    on CUDA (qkv, o, the residual add + RMSNorm, gate_up + SiLU-and-mul, down, add + norm; the
    float32 residual stream; attention left out), with the LoRA of every projection as the engine
    runs it (its per-step plan inside the graph, o's and down's deltas into the stream) or without;
    per layer us. Variants: the side stream off, the deltas into y (no sink), the sink's LoRA beside
    its GEMM at every size, every slot -1 (the cost of the LoRA engine for base requests), the tile knobs."""
    from types import SimpleNamespace

    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.linear import UNQUANTIZED
    from tokenmill.layers.lora import lora_layer, triton_lora
    from tokenmill.layers.lora.lora_layer import LoRABatch, LoRASlots

    device = torch.device("cpu" if SMOKE else "cuda")
    dtype = torch.float32 if SMOKE else torch.bfloat16
    h_size, inter, q, kv, rank, num_slots = 4096, 14336, 4096, 1024, 16, 64
    layers, sets = 32, 4
    token_counts = [int(t) for t in args.layer_tokens.split(",")]
    variants = args.layer_variants.split(",")
    if SMOKE:
        h_size, inter, q, kv, num_slots, layers, sets = 64, 96, 64, 32, 4, 2, 2
        token_counts, variants = [1, 40], ["base", "base_strided", "seq", "nosink", "rows64", "noconcat", "concat_all"]
    g = torch.Generator(device=device).manual_seed(0)
    act = SiluAndMul()
    batch = LoRABatch(device, num_slots)
    streams = {None: None} if SMOKE else {None: None, "normal": lora_layer.side_stream(device, False),
                                          "high": lora_layer.side_stream(device, True)}
    norm_w = torch.ones(h_size, dtype=dtype, device=device)

    def add_norm(y, r):
        """The engine's `forward_with_residual`: r += y (float32), then RMSNorm of r."""
        if SMOKE:
            r.add_(y)
            return (r * torch.rsqrt(r.square().mean(-1, keepdim=True) + 1e-5)).to(dtype), r
        from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
        return fused_add_rms_norm(y, r, norm_w, 1e-5)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    weights = []
    for _ in range(sets):
        w = {"qkv": rnd(q + 2 * kv, h_size, scale=h_size ** -0.5), "o": rnd(h_size, q, scale=q ** -0.5),
             "gate_up": rnd(2 * inter, h_size, scale=h_size ** -0.5), "down": rnd(h_size, inter, scale=inter ** -0.5)}
        for name, k, parts in (("qkv", h_size, [q, kv, kv]), ("o", q, [h_size]), ("gate_up", h_size, [inter, inter]),
                               ("down", inter, [h_size])):
            slots = LoRASlots(batch, num_slots, rank, k, parts, dtype, device)
            # (the projection as the engine's: a plain GEMM of this weight, `LoRASlots._plain_weight`)
            slots.layer = SimpleNamespace(weight=w[name], bias=None, quant_method=UNQUANTIZED)
            slots.a.copy_(rnd(*slots.a.shape, scale=k ** -0.5))
            slots.b.copy_(rnd(*slots.b.shape, scale=0.02))
            w["l_" + name] = slots
            # qkv's and gate_up's weights as the LoRA engine holds them: views of wider buffers
            # (`LoRASlots.attach_concat`); "base" keeps the contiguous ones (the base engine's)
            if lora_layer.CONCAT and slots.attach_concat(cuda_only=False):  # (o, down: used with CONCAT_SINKS)
                w["lw_" + name] = slots.layer.weight
            else:
                w["lw_" + name] = w[name]
        weights.append(w)

    fuse = True
    strided = False  # "base_strided": the base GEMMs on the LoRA engine's (wider) weights

    def one_layer(w, x, r, lora: bool, sink: bool = True):
        """(qkv, o output, r after attention, activation, down output, next x, r at the end)."""
        if lora:
            qkv = w["l_qkv"].forward(x, lambda: torch.mm(x, w["lw_qkv"].t()))
            att = qkv[:, :q]
            y_o = w["l_o"].forward(att, lambda: torch.mm(att, w["lw_o"].t()), r if sink else None)
            x2, r = add_norm(y_o, r)
            a = w["l_gate_up"].forward_silu_mul(x2, lambda: torch.mm(x2, w["lw_gate_up"].t()), act,
                                                then=w["l_down"] if fuse else None)
            y_d = w["l_down"].forward(a, lambda: torch.mm(a, w["lw_down"].t()), r if sink else None)
        else:
            pre = "lw_" if strided else ""
            qkv = torch.mm(x, w[pre + "qkv"].t())
            att = qkv[:, :q]
            y_o = torch.mm(att, w[pre + "o"].t())
            x2, r = add_norm(y_o, r)
            a = act(torch.mm(x2, w[pre + "gate_up"].t()))
            y_d = torch.mm(a, w[pre + "down"].t())
        return qkv, y_o, x2, a, y_d

    def stack(h, lora: bool):
        x, r = h, h.float()
        for i in range(layers):
            _, _, _, _, y_d = one_layer(weights[i % sets], x, r, lora)
            x, r = add_norm(y_d, r)
        return x

    def prepare(mix, host=None, single=False):
        """`batch.prepare`, and the one-slot graph family's path when `single` (CONCAT)."""
        batch.prepare(mix, host, single=single)
        if SMOKE and host is None:  # the CUDA path's plan: the Triton kernels (interpreted), not the CPU's matmuls
            batch.plan = triton_lora.plan_step(mix, num_slots, batch.shapes)
            batch.decide_concat(mix, None, single)
        # (the slot's B into the wider weights as the engine does before a replay: not inside a capture,
        # whose body's eager run just before has put it there)
        if single and batch.concat and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            for wt in weights:
                for name in ("qkv", "o", "gate_up", "down"):
                    wt["l_" + name].load_slot(int(mix.max()))

    def check_layer(tokens, adapters, mix, h0, single=False):
        """One layer eagerly, the engine's kernels vs the torch reference of every projection (o's
        and down's deltas are what their sinks gained); `single`: the one-slot path (qkv's and
        gate_up's LoRA inside their GEMMs)."""
        from tokenmill.layers.lora.torch_lora import lora_reference
        w = weights[0]
        batch.side_stream = None
        prepare(mix, single=single)
        r0 = h0.float() + 0.5
        qkv, y_o, x2, a, y_d = one_layer(w, h0, r0.clone(), True, sink=False)  # deltas into y
        r1 = r0.clone()
        mode, lora_layer.SINK_MODE = lora_layer.SINK_MODE, "always"  # (eager: by default only beside a GEMM)
        try:
            _, y_o_s, x2_s, a_s, y_d_s = one_layer(w, h0, r1, True)  # sinks: r1 gains both deltas and y_o
        finally:
            lora_layer.SINK_MODE = mode
        batch.clear()
        m = min(tokens, 64)  # the reference gathers each token's adapter: the first 64 tokens only

        def ref(name, x, y):
            sl = w["l_" + name]
            return y[:m].float() + lora_reference(x[:m], sl.a, sl.b, sl.part_starts, mix[:m])

        def rel(got, want):
            return ((got[:m].float() - want).abs().max() / want.abs().max().clamp_min(1e-3)).item()
        att = qkv[:, :q]
        errs = [rel(qkv, ref("qkv", h0, torch.mm(h0, w["qkv"].t()))),
                rel(y_o, ref("o", att, torch.mm(att, w["o"].t()))),
                rel(y_d, ref("down", a, torch.mm(a, w["down"].t())))]
        gate, up = ref("gate_up", x2, torch.mm(x2, w["gate_up"].t())).to(dtype).float().chunk(2, dim=1)
        want = torch.nn.functional.silu(gate).to(dtype).float() * up
        errs.append(rel(a, want))
        # with the sinks: the stream after the layer is the same as with the deltas in y
        want_r = r0[:m] + y_o[:m].float() + y_d[:m].float()
        errs.append(rel(r1 + y_d_s.float(), want_r))
        if tokens > 512 and adapters == 1 and not SMOKE:  # the dense path of one adapter's eager steps
            dense, lora_layer.DENSE_MIN_TOKENS = lora_layer.DENSE_MIN_TOKENS, 512
            try:
                batch.prepare(mix, mix.cpu().numpy())
                assert batch.dense_slot == int(mix[0])
                qkv_d, y_o_d, x2_d, a_d, y_d_d = one_layer(w, h0, r0.clone(), True, sink=False)
            finally:
                lora_layer.DENSE_MIN_TOKENS = dense
                batch.clear()
            att_d = qkv_d[:, :q]
            errs += [rel(qkv_d, ref("qkv", h0, torch.mm(h0, w["qkv"].t()))),
                     rel(y_o_d, ref("o", att_d, torch.mm(att_d, w["o"].t()))),
                     rel(y_d_d, ref("down", a_d, torch.mm(a_d, w["down"].t())))]
            gate, up = ref("gate_up", x2_d, torch.mm(x2_d, w["gate_up"].t())).to(dtype).float().chunk(2, dim=1)
            errs.append(rel(a_d, torch.nn.functional.silu(gate).to(dtype).float() * up))
        check(max(errs) <= (1e-4 if SMOKE else 2e-2),
              f"layer T={tokens} adapters={adapters}{' one-slot path' if single else ''}: relative error qkv/o/down/gate_up/stream with sinks "
              f"(then qkv/o/down/gate_up dense) {['%.1e' % e for e in errs]}")

    rows = results["layer"] = []  # (saved after every row: a run cut short keeps what it measured)
    for tokens in token_counts:
        h0 = rnd(tokens, h_size, scale=1.0)
        for adapters in [int(a) for a in args.layer_adapters.split(",")] if not SMOKE else (1, 3):
            if adapters > 1 and (tokens < 2 * adapters or tokens == 1):
                continue
            if tokens > 1024 and adapters == 8:
                continue  # (prefill sizes: 1 and 64 tell enough)
            mix = (torch.randperm(tokens, generator=g, device=device) % adapters).to(torch.int32)
            check_layer(tokens, adapters, mix, h0)
            if adapters == 1 and lora_layer.CONCAT:
                check_layer(tokens, adapters, mix, h0, single=True)
            for variant in variants:
                lora, fixed, stream, knobs = LAYER_VARIANTS[variant]
                if not lora and adapters != 1:
                    continue
                if tokens > 1024 and adapters > 1 and variant not in ("engine", "nosink", "sink_all"):
                    continue  # (prefill sizes: the knobs of one adapter)
                beside_only = variant.startswith("delta") or variant == "shrink_only"  # (captured steps <= 256)
                if (tokens > 16 and variant in DECODE_ONLY) or (tokens <= 16 and variant in TILES_ONLY) or \
                        (tokens > 512 and variant.startswith("rows")) or (tokens > 256 and beside_only):
                    continue  # (rowsN: the tiles of steps up to 512 tokens)
                knobs = dict(knobs or {})
                fuse = knobs.pop("fuse", True)  # gate_up's kernel doing down_proj's shrink (decode sizes)
                strided = knobs.pop("strided", False)
                host = mix.cpu().numpy() if knobs.pop("host", False) else None  # (the step's slots known)
                if host is not None and (tokens < min(knobs.get("DENSE_MIN_TOKENS", 512), 513) or adapters > 1):
                    continue  # (one adapter's large steps only)
                owner = {k: lora_layer if k in LORA_LAYER_KNOBS else triton_lora for k in knobs}
                saved = {k: getattr(owner[k], k) for k in knobs}
                try:
                    for k, v in knobs.items():
                        setattr(owner[k], k, v)
                    batch.side_stream = streams.get(stream)
                    token_slots = mix if fixed is None else torch.full_like(mix, fixed)

                    # one adapter: the engine replays its one-slot graph family (CONCAT)
                    single = lora and fixed is None and adapters == 1 and host is None and lora_layer.CONCAT

                    def body():
                        if lora:
                            prepare(token_slots, host, single)
                        out = stack(h0, lora)
                        batch.clear()
                        return out

                    want = body()  # eager: the sinks' LoRA in stream order
                    if variant in ("engine", "sink_all", "delta_beside", "delta_combo") and not SMOKE:
                        # a replay (side stream) computes the same
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            got = body()
                        graph.replay()
                        torch.cuda.synchronize()
                        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                        check(err <= 1e-2, f"layer T={tokens} adapters={adapters} {variant}: graph replay vs eager "
                                           f"relative difference {err:.1e}")
                        del graph
                    if SMOKE:
                        us = 0.0
                    else:
                        us = _time_graph(body, reps=1, replays=20) / layers
                    rows.append({"tokens": tokens, "adapters": adapters, "variant": variant, "us_per_layer": us})
                    save(results)
                    print(f"  T={tokens:5} adapters={adapters:2} {variant:11} {us:9.1f} us per layer", flush=True)
                except Exception as exc:
                    traceback.print_exc()
                    check(False, f"layer T={tokens} adapters={adapters} {variant} raised {exc!r}"[:400])
                finally:
                    for k, v in saved.items():
                        setattr(owner[k], k, v)
                    batch.clear()
    results["layer"] = rows
    lines = ["| T | adapters | variant | us per layer | + us over base | +% |", "|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b["us_per_layer"] for b in rows if b["tokens"] == r["tokens"] and b["variant"] == "base"), None)
        extra = (r["us_per_layer"] - base) if base else float("nan")
        pct = 100 * extra / base if base else float("nan")
        lines.append(f"| {r['tokens']} | {r['adapters']} | {r['variant']} | {r['us_per_layer']:.1f} | {extra:.1f} | "
                     f"{pct:.1f} |")
        r["plus_pct"] = pct
    if not SMOKE:
        print("\n".join("  " + line for line in lines))
    MARKDOWN["layer: 32 decoder layers' GEMMs + LoRA in one graph, us per layer"] = lines


# ---------------------------------------------------------------- tiny: tokens vs HF + PEFT

def tiny(results: dict, args) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf_reference import compare_greedy
    from tests.helpers.lora_adapters import PeftAdapters
    from tests.helpers.tiny_models import make_tiny_model_dir
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    device = "cpu" if SMOKE else "cuda"
    root = tempfile.mkdtemp(prefix="lora-tiny-")
    path = make_tiny_model_dir("llama", root, num_hidden_layers=3)
    peft = PeftAdapters(AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval().to(device))
    specs = {"a1": dict(rank=8, seed=1, std=0.3),
             "a2": dict(rank=16, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2, std=0.5, use_rslora=True),
             "a3": dict(rank=4, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=3, std=0.4)}
    loras = {n: LoRARequest(n, i + 1, peft.add(n, os.path.join(root, "adapters"), **spec))
             for i, (n, spec) in enumerate(specs.items())}
    names = [None, "a1", "a2", "a3"] * (2 if SMOKE else 6)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + (5 * i) % 40)] for i in range(len(names))]
    new = 8 if SMOKE else 24
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    refs = [peft.greedy(n, p, new) for n, p in zip(names, prompts)]
    # one adapter and base rows in a batch of more than 16 rows: the one-slot graphs (CONCAT)
    one = [None if i % 3 == 0 else "a1" for i in range(len(names))]
    refs += [refs[i] if n == names[i] else peft.greedy(n, p, new) for i, (n, p) in enumerate(zip(one, prompts))]
    runs = {"graphs": dict(max_loras=3), "one_slot": dict(max_loras=1, max_cpu_loras=1)}
    if not SMOKE:
        runs["eager"] = dict(max_loras=3, enforce_eager=True)
    runs = {k: v for k, v in runs.items() if k in args.tiny_runs.split(",")}
    rows = {}
    for label, extra in runs.items():
        engine = dict(dtype="float32", enable_lora=True, max_lora_rank=16, **extra)
        if SMOKE:
            engine.update(single_process=True, kv_cache_memory_gb=0.02)
        else:
            engine.update(gpu_memory_utilization=0.3, max_model_len=256)
        with LLM(path, **engine) as llm:
            # Batch 1 first (each prefill alone: the prompt-chunk graphs, one row's slot per token;
            # the base request alone: the graphs captured without LoRA), then everything mixed.
            solo = [0, 1, 2, 3]
            outs = [llm.generate([{"prompt_token_ids": prompts[i]}], params, use_tqdm=False,
                                 lora_request=loras.get(names[i]))[0] for i in solo]
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                 lora_request=[None if n is None else loras[n] for n in names])
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                 lora_request=[None if n is None else loras[n] for n in one])
        exact, notes = 0, []
        for out, ref, n in zip(outs, [refs[i] for i in solo] + refs, [names[i] for i in solo] + names + one):
            try:
                note = compare_greedy(list(out.outputs[0].token_ids), ref, f"{label} {n}")
            except AssertionError as exc:
                note = f"MISMATCH {exc}"[:300]
            exact += note is None
            if note:
                notes.append(note)
        mismatches = [x for x in notes if x.startswith("MISMATCH")]
        check(not mismatches and len(notes) <= 2,
              f"tiny {label}: {exact}/{len(outs)} exact vs HF+PEFT, {len(notes)} near-tie notes"
              + (f"; {mismatches[0]}" if mismatches else ""))
        rows[label] = {"exact": exact, "rows": len(outs), "notes": notes}
    results["tiny"] = rows


# ---------------------------------------------------------------- engine and batch 1

def write_adapter(path: str, shape: dict, rank: int, seed: int, dtype=torch.bfloat16) -> str:
    """A random PEFT folder of rank `rank` on all seven projections of every layer."""
    from safetensors.torch import save_file

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or h // heads
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for name, (fan_in, fan_out) in dims.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none"}, f)
    return path


def engines(results: dict, args, parts: set[str]) -> None:
    """The base engine and the LoRA engine alive together, runs alternated (`scripts/lora_engines.py`)."""
    import logging
    # tokenmill's INFO lines (the workers follow this level): the engines' start-up, with the LoRA
    # engine's one-slot graph A/B (`DecodeGraphs._single_pays`: kept or dropped, both timings)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    from transformers import AutoTokenizer

    from scripts import lora_engines as le
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    shape_name = "llama8b"
    shape = dict(SHAPES[shape_name])
    if SMOKE:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
        SHAPES["lora-smoke"] = shape
        shape_name = "lora-smoke"
    path = config_dir(shape_name)
    num, inp, out = (12, 32, 8) if SMOKE else (args.prompts, 512, 256)
    base_num = 6 if SMOKE else args.base_in_lora_prompts
    if not SMOKE and num != 1000:
        print(f"  NOTE: {num} prompts (the issue's shape is 1000 x 512 x 256)")
    counts = (1, 4) if SMOKE else tuple(int(c) for c in args.engine_adapters.split(","))
    max_loras = 4 if SMOKE else 64  # (the issue's: max_loras >= the adapters in a step)
    used = max(counts) if "engine" in parts else 1  # batch 1 alone: one adapter written and loaded
    root = tempfile.mkdtemp(prefix="lora-adapters-")
    # (4 folders: the 64 adapters are 64 ids over them, each loaded into a slot of its own), written
    # on a thread while the engines start (`written()` waits for them before the first load)
    from concurrent.futures import ThreadPoolExecutor
    folders = [os.path.join(root, f"f{i}") for i in range(min(4, used))]
    writer = ThreadPoolExecutor(1)
    writing = writer.submit(lambda: [write_adapter(f, shape, 16, i) for i, f in enumerate(folders)])
    writer.shutdown(wait=False)

    def written() -> None:
        start = time.perf_counter()
        writing.result()
        print(f"  wrote {len(folders)} rank-16 adapter folders (waited {time.perf_counter() - start:.1f} s "
              f"for them after the engines' start)")
    loras = [LoRARequest(f"adapter{i}", i + 1, folders[i % len(folders)]) for i in range(max_loras)]
    tokenizer = AutoTokenizer.from_pretrained(path)

    def prompts_of(n: int, seed: int) -> list[dict]:  # fresh prompts per run: no prefix-cache hits
        return [{"prompt_token_ids": p} for p in make_prompts(tokenizer, "random", n, inp, shape["vocab_size"], seed)]
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    common = dict(load_format="dummy", dtype="float32" if SMOKE else "bfloat16", max_model_len=inp + out + 16)
    if SMOKE:
        common.update(single_process=True, kv_cache_memory_gb=0.05)
    # Like for like: both engines alive at once with the SAME number of KV blocks. The LoRA engine
    # (the larger one: its adapter slots) starts first and sizes its pool from its share of the
    # device (--lora-memory; the smoke run: a smaller CPU pool than the base engine's default);
    # the base engine gets that count (`num_gpu_blocks_override`); --kv-blocks fixes it for both.
    if args.kv_blocks:
        lora_kv = {"num_gpu_blocks_override": args.kv_blocks}
    else:
        lora_kv = {"kv_cache_memory_gb": 0.04} if SMOKE else {"gpu_memory_utilization": args.lora_memory}
    from tokenmill.benchmarks.throughput import step_figures
    bench = le.Bench(prompts_of, summarize, params, inp, args.budget, START, step_figures=step_figures)
    results["engine"] = bench.figures
    mixes = {count: [loras[i % count] for i in range(num)] for count in counts}
    warm_params = SamplingParams(temperature=0.0, max_tokens=min(out, 16), ignore_eos=True, detokenize=False)

    def publish() -> None:  # after every run: a run cut short keeps every figure it measured
        MARKDOWN[title] = le.report(bench, counts, GOALS, num, inp, out, BATCH1_GOAL, results, verbose=False)
        save(results)
    title = (f"engine: Llama-3.1-8B shape, dummy weights, rank 16 on all seven projections, max_loras={max_loras}, "
             f"base and LoRA engines alive together with the same KV blocks, runs alternated")
    bench.on_run = publish

    def warm(llm, lora_request, n=min(num, 64)) -> None:
        """A short run of a configuration's mix: its step sizes compile and settle before any timing."""
        llm.generate(prompts_of(n, 7), warm_params, use_tqdm=False, lora_request=lora_request)

    def free_gib() -> str:
        if SMOKE:
            return "n/a (CPU)"
        free, total = torch.cuda.mem_get_info()
        return f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB"

    # --decode-profile R: each engine's worker profiles full decode steps (`device_profile.py`), one
    # window per profiled configuration told apart by its row count (R, R - 1, R - 2: the profile
    # runs below have exactly that many prompts, the timed runs never R - 2 .. R rows of pure decode
    # before these runs close the windows: they run first).
    rows = args.decode_profile
    profiled = {"base": [("base", rows)],
                "lora": [("lora_1", rows), (f"lora_{counts[-1]}", rows - 1), ("lora_engine_base_requests", rows - 2)]
                } if rows else {}
    skip, steps = (2, 3) if SMOKE else (12, 10)

    def profile_env(engine: str) -> None:
        from tokenmill.worker.device_profile import ENV_VAR
        os.environ.pop(ENV_VAR, None)
        if engine in profiled:
            os.environ[ENV_VAR] = json.dumps([{"out_dir": os.path.join(OUT, "decode_profile", name), "batch": b,
                                               "skip": skip, "steps": steps} for name, b in profiled[engine]])

    # --kv-blocks (no profile windows, which go by environment at each engine's start): the base
    # engine starts on a thread beside the LoRA engine (their start-ups overlap: about 10 s of the
    # call; the LoRA engine's start-up A/B of its one-slot graphs comes last, after the base's).
    base_future = None
    if args.kv_blocks and not rows and not args.keep_one_slot:
        pool = ThreadPoolExecutor(1)
        base_future = pool.submit(lambda: LLM(path, **common, num_gpu_blocks_override=args.kv_blocks))
        pool.shutdown(wait=False)

    @contextlib.contextmanager
    def base_engine(blocks: int):
        if base_future is not None:
            llm = base_future.result()
        else:
            profile_env("base")
            if args.keep_one_slot:
                os.environ.pop("TOKENMILL_LORA_SINGLE_CHECK", None)
            llm = LLM(path, **common, num_gpu_blocks_override=blocks)
        with llm:
            profile_env("none")
            yield llm

    try:  # a failure here still leaves the table of what was measured (and fails the run)
        start = time.perf_counter()
        profile_env("lora")
        if args.keep_one_slot:  # (the LoRA engine's worker reads it at start: decode_graphs.SINGLE_CHECK)
            os.environ["TOKENMILL_LORA_SINGLE_CHECK"] = "0"
        with LLM(path, enable_lora=True, max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_loras,
                 **{**common, **lora_kv}) as lora_llm:
            blocks = lora_llm.scheduler_stats()["num_kv_blocks"]
            print(f"  LoRA engine up in {time.perf_counter() - start:.1f} s: {blocks} KV blocks "
                  f"({'--kv-blocks' if args.kv_blocks else 'sized from its memory share'}); device free {free_gib()}; "
                  f"{time.perf_counter() - START:.0f} s from the start",
                  flush=True)
            start = time.perf_counter()
            with base_engine(blocks) as base_llm:
                base_blocks = base_llm.scheduler_stats()["num_kv_blocks"]
                print(f"  base engine up {'(started beside the LoRA engine) ' if base_future else ''}in "
                      f"{time.perf_counter() - start:.1f} s more: {base_blocks} KV blocks; device free {free_gib()}; "
                      f"{time.perf_counter() - START:.0f} s from the start", flush=True)
                results["engine_kv_blocks"] = {"lora_engine": blocks, "base_engine": base_blocks}
                check(base_blocks == blocks, f"engines: the same KV blocks (base {base_blocks}, LoRA {blocks})")
                # Every adapter read into host memory and a device slot once, before timing (as a
                # server given them with --lora-modules has them after its first requests).
                written()
                start = time.perf_counter()
                short = [{"prompt_token_ids": p["prompt_token_ids"][:16]} for p in prompts_of(used, 3)]
                lora_llm.generate(short, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=loras[:used])
                print(f"  loaded {used} adapters in {time.perf_counter() - start:.1f} s; "
                      f"{time.perf_counter() - START:.0f} s from the start", flush=True)
                start = time.perf_counter()
                if "batch1" in parts:
                    warm(base_llm, None, 1)
                    warm(lora_llm, loras[0], 1)
                    warm(lora_llm, None, 1)
                if "engine" in parts:  # (the other mixes: the load above ran a step of every adapter)
                    warm(base_llm, None)
                    warm(lora_llm, mixes[counts[0]][:min(num, 64)])
                print(f"  warmed every configuration in {time.perf_counter() - start:.1f} s; "
                      f"{time.perf_counter() - START:.0f} s from the start", flush=True)
                if rows:
                    decode_profiles(results, {"base": base_llm, "lora": lora_llm}, profiled, mixes, loras, rows,
                                    blocks, skip + steps + 8, tokenizer, shape, common["max_model_len"])
                def batch1() -> None:  # alternated: base engine, adapter, base request in the LoRA engine
                    bench.last_s.setdefault("b1", 2.0)  # (a 512 x 256 batch-1 run: about 1.6 s on an H100)
                    for i in range(args.batch1_runs):
                        if not bench.fits("b1", "b1", margin=0.0):
                            print(f"  (batch 1 alternation {i + 1} left out: the {args.budget:.0f} s budget)")
                            break
                        bench.run(base_llm, None, "batch1_base", 1, kind="b1")
                        bench.run(lora_llm, loras[0], "batch1_lora", 1, kind="b1")
                        if i == 0 and bench.fits("b1", margin=0.0):
                            bench.run(lora_llm, None, "batch1_base_in_lora_engine", 1, kind="b1")
                if "batch1" in parts and not ("engine" in parts and args.engine_repeats > 0):
                    batch1()
                if "engine" in parts and args.engine_repeats > 0:
                    # In order of worth, each figure written as soon as measured: a round (base, 1
                    # adapter), each other mix once, then more rounds and base requests in the LoRA
                    # engine while the budget allows.
                    def round_(r: int) -> bool:  # base and 1 adapter, one after the other
                        if r and not bench.fits("base", "lora"):
                            print(f"  (round {r + 1} left out: the {args.budget:.0f} s budget)")
                            return False
                        bench.run(base_llm, None, "base", num, kind="base")
                        bench.run(lora_llm, mixes[counts[0]], f"lora_{counts[0]}_adapters", num, kind="lora")
                        return True
                    round_(0)
                    for count in counts[1:]:
                        if not bench.fits("lora", margin=0.0):
                            print(f"  ({count} adapters left out: the {args.budget:.0f} s budget)")
                            continue
                        bench.run(lora_llm, mixes[count], f"lora_{count}_adapters", num, kind="lora")
                    if "batch1" in parts:  # (a few seconds: after the throughput figures, before repeats)
                        batch1()
                    more = round_(1) if args.engine_repeats >= 2 else False
                    # base requests: LoRA engine vs base engine, alternated (a smaller run of the workload)
                    if more and bench.fits("base", "base", scale=1.3 * base_num / num):
                        bench.run(base_llm, None, "base_paired", base_num, kind="small")
                        bench.run(lora_llm, None, "base_in_lora_engine", base_num, kind="small")
                    for r in range(2, args.engine_repeats if more else 0):  # more rounds while the budget allows
                        if not round_(r):
                            break
    except Exception as exc:
        traceback.print_exc()
        check(False, f"engines raised {type(exc).__name__}: {exc}"[:500])
    finally:
        if base_future is not None:  # (a base engine started beside a LoRA engine that failed: stopped too)
            try:
                base_future.result().shutdown()
            except Exception:
                pass
    MARKDOWN[title] = le.report(bench, counts, GOALS, num, inp, out, BATCH1_GOAL, results)


def decode_profiles(results: dict, engines: dict, profiled: dict, mixes: dict, loras: list, rows: int, blocks: int,
                    decode_steps: int, tokenizer, shape: dict, max_len: int) -> None:
    """The engine part's profile runs (--decode-profile): per window, `rows` (less its offset)
    prompts decoding together in the engine that holds the window; each worker's window record
    cut into steps; per-group and top kernels against the base engine's window (`lora_profile`)."""
    from scripts import lora_profile as lp
    from tokenmill import SamplingParams

    out = decode_steps + rows * 384 // 8192 + 4  # (the window's pure decode steps follow the prefill chunks)
    # every row's KV fits (no preemption), within max_model_len
    in_len = max(16, min(384, max_len - out, int(0.8 * blocks * 16 / rows) - out))
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    lines, base = [], None
    for engine, windows in profiled.items():
        for name, n in windows:
            request = None if name in ("base", "lora_engine_base_requests") else \
                [mixes[int(name.split("_")[1])][i % len(mixes[int(name.split("_")[1])])] for i in range(n)]
            prompts = [{"prompt_token_ids": p} for p in make_prompts(tokenizer, "random", n, in_len,
                                                                      shape["vocab_size"], 500 + n)]
            start = time.perf_counter()
            engines[engine].generate(prompts, params, use_tqdm=False, lora_request=request)
            path = os.path.join(OUT, "decode_profile", name, "rank0.json")
            if not os.path.exists(path):
                check(False, f"decode profile {name}: no window written ({path})")
                continue
            with open(path) as f:
                record = json.load(f)
            a = lp.analyze(*lp.window_events(record))
            a["wall_ms_unprofiled"] = record.get("wall_ms_per_step_unprofiled")
            results.setdefault("decode_profile", {})[name] = a
            base = base or (a if name == "base" else None)
            what = f"decode, {n} rows x ~{in_len + out // 2} context (graphs), {name}"
            lines += lp.format_window(what, a, base if name != "base" else None,
                                      record.get("wall_ms_per_step") or 0.0)
            print(f"  decode profile {name}: {n} rows, span {a['span_us']:.0f} us a step, busy {a['busy_us']:.0f}, "
                  f"LoRA kernels {a['lora_sum_us']:.0f} ({a['lora_beside_us']:.0f} beside others) "
                  f"[{time.perf_counter() - start:.1f} s]", flush=True)
    for line in lines:
        print("  " + line)
    MARKDOWN["decode profile: the engine part's engines, full decode steps (worker windows)"] = lines


# ---------------------------------------------------------------- profile: where a step's time goes

PROFILE_PREFILL_VARIANTS = {"lora_1_dense_add": dict(DENSE_FUSED=False),
                            "lora_1_dense_silu": dict(DENSE_FUSED_SILU=False),
                            "lora_1_tiles": dict(DENSE_MIN_TOKENS=1 << 30)}


def profile(results: dict, args) -> None:
    """torch.profiler over a prefill step (16 x 512 tokens, eager) and 256-row decode steps (graph
    replays) of the base engine and the LoRA engine (1 adapter; base requests), Llama-3.1-8B shape
    (`scripts/lora_profile.py`); per-group device time, launches, the side stream's overlap."""
    import gzip

    from scripts import lora_profile as lp
    from tokenmill import LLM
    from tokenmill.layers.lora import lora_layer
    from tokenmill.benchmarks.throughput import make_prompts as mk
    from tokenmill.lora.request import LoRARequest

    # The analysis on a synthetic trace: two streams, a LoRA kernel half beside a GEMM.
    synthetic = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "_shrink_tiles_kernel", "ts": 5, "dur": 10, "args": {"stream": 9}},
        {"ph": "X", "cat": "kernel", "name": "_expand_tiles_kernel", "ts": 20, "dur": 4, "args": {"stream": 7}}]}
    a = lp.analyze(lp.device_events(synthetic), 1)
    check(abs(a["busy_us"] - 19) < 1e-9 and abs(a["lora_beside_us"] - 5) < 1e-9 and abs(a["lora_exposed_us"] - 9) < 1e-9
          and a["groups"]["lora_shrink"]["launches"] == 1 and a["span_us"] == 24,
          f"profile analysis of a synthetic trace: busy {a['busy_us']}, beside {a['lora_beside_us']}, "
          f"exposed {a['lora_exposed_us']}, span {a['span_us']}")
    shape_name = "llama8b"
    shape = dict(SHAPES[shape_name])
    rows, chunk, steps = 256, 8192, 4
    if SMOKE:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
        SHAPES["lora-smoke"] = shape
        shape_name = "lora-smoke"
        rows, chunk, steps = 8, 1024, 2
    path = config_dir(shape_name)
    adapter = write_adapter(tempfile.mkdtemp(prefix="lora-prof-"), shape, 16, 0)
    lora = LoRARequest("adapter0", 1, adapter)
    serial = [0]

    def prompts_for(kind, n, length):  # fresh prompts every call (no prefix-cache hits)
        serial[0] += 1
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
        return [{"prompt_token_ids": p} for p in mk(tok, "random", n, length, shape["vocab_size"], seed=serial[0])]

    common = dict(load_format="dummy", dtype="float32" if SMOKE else "bfloat16", max_model_len=512 + 32,
                  single_process=True, enable_prefix_caching=False)
    common.update(kv_cache_memory_gb=0.05) if SMOKE else common.update(gpu_memory_utilization=0.45)
    windows: dict = {}
    cuda = not SMOKE
    start = time.perf_counter()
    with lp.StepWindows(cuda) as win:
        with LLM(path, **common) as llm:
            print(f"  base engine up in {time.perf_counter() - start:.1f} s", flush=True)
            lp.run_windows(llm, win, prompts_for, lambda n: None, "warm", rows, chunk, steps)
            windows["base"] = lp.run_windows(llm, win, prompts_for, lambda n: None, "base", rows, chunk, steps)
            del llm
        if cuda:  # (the base engine's memory back before the LoRA engine sizes its KV pool)
            import gc
            gc.collect()
            torch.cuda.empty_cache()
            common.update(gpu_memory_utilization=0.85)
        start = time.perf_counter()
        with LLM(path, enable_lora=True, max_loras=4 if SMOKE else 64, max_lora_rank=16, **common) as llm:
            print(f"  LoRA engine up in {time.perf_counter() - start:.1f} s", flush=True)
            one = lambda n: [lora] * n  # noqa: E731
            lp.run_windows(llm, win, prompts_for, one, "warm", rows, chunk, steps)
            lp.run_windows(llm, win, prompts_for, lambda n: None, "warm", rows, chunk, steps)
            windows["lora_1"] = lp.run_windows(llm, win, prompts_for, one, "lora_1", rows, chunk, steps)
            windows["lora_engine_base_requests"] = lp.run_windows(llm, win, prompts_for, lambda n: None,
                                                                  "lora_engine_base_requests", rows, chunk, steps)
            # Prefill variants of one adapter (eager: knobs read per call): the delta added into y
            # after the base GEMM (before `DENSE_FUSED`), and the tile kernels instead of cuBLAS.
            for label, knobs in PROFILE_PREFILL_VARIANTS.items():
                saved = {k: getattr(lora_layer, k) for k in knobs}
                try:
                    for k, v in knobs.items():
                        setattr(lora_layer, k, v)
                    lp.run_windows(llm, win, prompts_for, one, "warm", rows, chunk, steps, kinds=("prefill",))
                    windows[label] = lp.run_windows(llm, win, prompts_for, one, label, rows, chunk, steps,
                                                    kinds=("prefill",))
                finally:
                    for k, v in saved.items():
                        setattr(lora_layer, k, v)
    del llm
    if cuda:  # (this process's engines' memory back: a later part's engines size their KV pools)
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    out: dict = {}
    lines = []
    for kind in ("prefill", "decode"):
        base = None
        for label, got in windows.items():
            if kind not in got:
                continue
            trace, wall_ms, caught = got[kind]
            a = lp.analyze(lp.device_events(trace, ("cpu_op",) if SMOKE else lp.DEVICE_CATS), caught)
            a["wall_ms"] = wall_ms
            a["host_launches"] = {k: v / max(caught, 1) for k, v in lp.host_launches(trace).items()}
            out[f"{kind}/{label}"] = a
            what = f"{kind} ({chunk} tokens, eager)" if kind == "prefill" else f"decode ({rows} rows, graphs)"
            lines += lp.format_window(f"{what}, {label}", a, base, wall_ms)
            base = base or a
            with gzip.open(os.path.join(OUT, f"trace_{kind}_{label}.json.gz"), "wt") as f:
                json.dump(trace, f)
    results["profile"] = out
    for line in lines:
        print("  " + line)
    with open(os.path.join(OUT, "profile_lora.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    MARKDOWN["profile: a prefill step and decode steps, base engine vs LoRA engine"] = lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="micro,layer,tiny,engine,batch1")
    ap.add_argument("--prompts", type=int, default=1000, help="engine: prompts per run (512 in x 256 out)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks that the script runs)")
    ap.add_argument("--layer-tokens", default="1,16,64,256,8192", help="layer: the step sizes")
    ap.add_argument("--layer-variants", default=",".join(LAYER_VARIANTS), help="layer: the variants")
    ap.add_argument("--layer-adapters", default="1,8,64", help="layer: the adapter mixes")
    ap.add_argument("--tiny-runs", default="graphs,one_slot,eager", help="tiny: the engines checked")
    ap.add_argument("--engine-adapters", default="1,8,64", help="engine: the adapter mixes timed")
    ap.add_argument("--engine-repeats", type=int, default=2,
                    help="engine: rounds of (base run, 1-adapter run), alternated; rounds past the first run after "
                         "the other mixes, while --budget allows; the median round is reported; 0: no timed run "
                         "(start-up, KV blocks and --decode-profile only)")
    ap.add_argument("--lora-memory", type=float, default=0.51,
                    help="engine: the LoRA engine's share of the device, from which it sizes its KV pool; the "
                         "base engine, alive beside it, gets the same number of KV blocks")
    ap.add_argument("--kv-blocks", type=int, default=0,
                    help="engine: KV blocks of both engines (num_gpu_blocks_override); 0: from --lora-memory")
    ap.add_argument("--decode-profile", type=int, default=0,
                    help="engine: profile R-row decode steps in each engine (its base, 1 and the most adapters, "
                         "base requests in the LoRA engine) before the timed runs; 0: off")
    ap.add_argument("--keep-one-slot", action="store_true",
                    help="engine: the LoRA engine keeps its one-slot decode graphs without the start-up A/B "
                         "(TOKENMILL_LORA_SINGLE_CHECK=0), e.g. to profile that path with --decode-profile")
    ap.add_argument("--batch1-runs", type=int, default=2, help="batch1: alternations of base engine and adapter")
    ap.add_argument("--base-in-lora-prompts", type=int, default=256,
                    help="engine: prompts of the paired base-engine / LoRA-engine runs of base requests")
    ap.add_argument("--budget", type=float, default=290.0,
                    help="seconds from the start: optional engine runs that would end past it are left out")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"micro", "layer", "tiny", "engine", "batch1", "profile"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    os.makedirs(OUT, exist_ok=True)
    results: dict = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "parts": sorted(parts)}
    start_all = time.perf_counter()
    # In the order --parts names them (engine and batch1 share their engines: one step).
    named = {"micro": micro, "layer": layer, "tiny": tiny, "profile": profile}
    steps = []
    for name in args.parts.split(","):
        if name in named:
            steps.append((name, named[name]))
        elif not any(label == "engine / batch1" for label, _ in steps):
            steps.append(("engine / batch1", lambda res, a: engines(res, a, parts)))
    for name, fn in steps:
        start = time.perf_counter()
        print(f"==== {name}", flush=True)
        try:
            fn(results, args)
        except Exception as exc:  # the other parts still run; the run fails
            traceback.print_exc()
            check(False, f"{name} raised {type(exc).__name__}: {exc}"[:500])
        print(f"[{name} took {time.perf_counter() - start:.0f} s]", flush=True)
        save(results)
        if not SMOKE:  # (a part's device memory back before the next one's engines size their KV pools)
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    results["total_s"] = time.perf_counter() - start_all
    save(results)
    print(f"total {results['total_s']:.0f} s; {len(FAILED)} failed check(s); wrote {OUT}/gpu_lora.json and .md")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
