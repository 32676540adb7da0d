"""Multi-LoRA on CUDA in one command: kernel checks and timings, then the engine against the base
model in the same run. Prints a table per part, writes $OUT/gpu_lora.json and $OUT/gpu_lora.md
(default ./gpu-out; rewritten after every part, so a run cut short keeps what it measured), exits 1
on a failed check.

Parts (--parts, comma-separated; default micro,layer,tiny,engine,batch1):
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
          shape), the base engine vs the LoRA engine (max_loras=64) with 1, 8 and 64 adapters mixed
          uniformly; goals 0.90x, 0.85x, 0.80x the base's output tok/s
  batch1  one prompt, 512 in x 256 out: ms per output token, base engine vs an adapter (goal <= 1.10x)

    python scripts/gpu_lora.py                      # everything, on an H100 (under 8 minutes)
    python scripts/gpu_lora.py --parts micro
    python scripts/gpu_lora.py --smoke              # CPU: tiny shapes, Triton interpreter, a minute
"""

from __future__ import annotations

import argparse
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
    from tokenmill.layers.lora.triton_lora import lora_expand, lora_expand_silu, lora_shrink, plan_step

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
    # name: (LoRA on, slots (None: the mix; -1: every token without an adapter), side stream, tile knobs)
    "base": (False, None, None, None),
    "noop": (True, -1, "high", None),
    "seq": (True, None, None, None),
    "overlap": (True, None, "normal", None),
    "overlap_hi": (True, None, "high", None),
    # the tile kernels and the plan as they were (every program one tile of the worst-case bound)
    "old_tiles": (True, None, "high", dict(TILE_GRID_FACTOR=None, TILE_PROGRAMS_PER_SM=2, _TILES_MAX_SPLITS=8,
                                           PLAN_KERNEL_MAX_TOKENS=0)),
    "torch_plan": (True, None, "high", dict(PLAN_KERNEL_MAX_TOKENS=0)),
    "grid1": (True, None, "high", dict(TILE_GRID_FACTOR=1.0)),
    "grid2": (True, None, "high", dict(TILE_GRID_FACTOR=2.0)),
    "splits32": (True, None, "high", dict(TILE_PROGRAMS_PER_SM=8, _TILES_MAX_SPLITS=32)),
    "silu128": (True, None, "high", dict(SILU_TILE_BLOCK_N=128)),
    "wide": (True, None, "high", dict(SILU_TILE_BLOCK_N=128, EXPAND_TILE_BLOCK_N=256)),
    "overlap_hi_nofuse": (True, None, "high", dict(fuse=False)),
    "seq_nofuse": (True, None, None, dict(fuse=False)),
}


def layer(results, args) -> None:
    """The GEMMs of `layers` Llama-3.1-8B decoder layers in one CUDA graph (qkv, o + residual,
    gate_up + SiLU-and-mul, down + residual; attention and norms left out), with the LoRA of every
    projection as the engine runs it (its per-step plan inside the graph) or without; per layer us.
    Variants: LoRABatch's side stream off / normal / high priority, every slot -1 (the cost of the
    LoRA engine for base requests), the tile kernels' knobs of before (grid of the worst-case bound)."""
    from tokenmill.layers.activation import SiluAndMul
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
        token_counts, variants = [1, 40], ["base", "seq", "old_tiles"]
    g = torch.Generator(device=device).manual_seed(0)
    act = SiluAndMul()
    batch = LoRABatch(device, num_slots)
    streams = {None: None} if SMOKE else {None: None, "normal": lora_layer.side_stream(device, False),
                                          "high": lora_layer.side_stream(device, True)}

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    weights = []
    for _ in range(sets):
        w = {"qkv": rnd(q + 2 * kv, h_size, scale=h_size ** -0.5), "o": rnd(h_size, q, scale=q ** -0.5),
             "gate_up": rnd(2 * inter, h_size, scale=h_size ** -0.5), "down": rnd(h_size, inter, scale=inter ** -0.5)}
        for name, k, parts in (("qkv", h_size, [q, kv, kv]), ("o", q, [h_size]), ("gate_up", h_size, [inter, inter]),
                               ("down", inter, [h_size])):
            slots = LoRASlots(batch, num_slots, rank, k, parts, dtype, device)
            slots.a.copy_(rnd(*slots.a.shape, scale=k ** -0.5))
            slots.b.copy_(rnd(*slots.b.shape, scale=0.02))
            w["l_" + name] = slots
        weights.append(w)

    fuse = True

    def stack(h, lora: bool):
        for i in range(layers):
            w = weights[i % sets]
            if lora:
                qkv = w["l_qkv"].forward(h, lambda: torch.mm(h, w["qkv"].t()))
                att = qkv[:, :q]
                h2 = w["l_o"].forward(att, lambda: torch.addmm(h, att, w["o"].t()))
                a = w["l_gate_up"].forward_silu_mul(h2, lambda: torch.mm(h2, w["gate_up"].t()), act,
                                                      then=w["l_down"] if fuse else None)
                h = w["l_down"].forward(a, lambda: torch.addmm(h2, a, w["down"].t()))
            else:
                att = torch.mm(h, w["qkv"].t())[:, :q]
                h2 = torch.addmm(h, att, w["o"].t())
                a = act(torch.mm(h2, w["gate_up"].t()))
                h = torch.addmm(h2, a, w["down"].t())
        return h

    def check_layer(tokens, adapters, mix, h0):
        """One layer eagerly, the engine's kernels vs the torch reference of every projection."""
        from tokenmill.layers.lora.torch_lora import lora_reference
        w = weights[0]
        batch.side_stream = None
        batch.prepare(mix)
        if SMOKE:  # the CUDA path's plan: the Triton kernels (interpreted) instead of the CPU's matmuls
            batch.plan = triton_lora.plan_step(mix, num_slots, batch.shapes)
        qkv = w["l_qkv"].forward(h0, lambda: torch.mm(h0, w["qkv"].t()))
        att = qkv[:, :q]
        h2 = w["l_o"].forward(att, lambda: torch.addmm(h0, att, w["o"].t()))
        a = w["l_gate_up"].forward_silu_mul(h2, lambda: torch.mm(h2, w["gate_up"].t()), act, then=w["l_down"])
        out = w["l_down"].forward(a, lambda: torch.addmm(h2, a, w["down"].t()))
        batch.clear()

        m = min(tokens, 64)  # the reference gathers each token's adapter: the first 64 tokens only

        def ref(name, x, y):
            sl = w["l_" + name]
            return y[:m].float() + lora_reference(x[:m], sl.a, sl.b, sl.part_starts, mix[:m])
        errs = []
        for name, x, y_base, got in (("qkv", h0, torch.mm(h0, w["qkv"].t()), qkv),
                                     ("o", att, torch.addmm(h0, att, w["o"].t()), h2),
                                     ("down", a, torch.addmm(h2, a, w["down"].t()), out)):
            want = ref(name, x, y_base)
            errs.append(((got[:m].float() - want).abs().max() / want.abs().max().clamp_min(1e-3)).item())
        gate, up = ref("gate_up", h2, torch.mm(h2, w["gate_up"].t())).to(dtype).float().chunk(2, dim=1)
        want = torch.nn.functional.silu(gate).to(dtype).float() * up
        errs.append(((a[:m].float() - want).abs().max() / want.abs().max().clamp_min(1e-3)).item())
        check(max(errs) <= (1e-4 if SMOKE else 2e-2),
              f"layer T={tokens} adapters={adapters}: relative error qkv/o/down/gate_up {['%.1e' % e for e in errs]}")

    rows = []
    for tokens in token_counts:
        h0 = rnd(tokens, h_size, scale=1.0)
        for adapters in (1, 8, 64) if not SMOKE else (1, 3):
            if adapters > 1 and (tokens < 2 * adapters or tokens == 1):
                continue
            if tokens > 1024 and adapters == 8:
                continue  # (prefill sizes: 1 and 64 tell enough)
            mix = (torch.randperm(tokens, generator=g, device=device) % adapters).to(torch.int32)
            check_layer(tokens, adapters, mix, h0)
            for variant in variants:
                lora, fixed, stream, knobs = LAYER_VARIANTS[variant]
                if not lora and adapters != 1:
                    continue
                if tokens > 16 and variant in ("noop", "overlap_hi_nofuse", "seq_nofuse"):
                    continue  # (no fusion beyond decode sizes; base requests skip LoRA in eager steps)
                if tokens <= 16 and variant in ("old_tiles", "torch_plan", "grid1", "grid2", "splits32", "silu128",
                                                "wide"):
                    continue  # (the per-token kernels: no tiles)
                if (tokens > 16 and variant == "overlap") or (tokens != 256 and variant == "torch_plan") or \
                        (adapters == 1 and variant in ("grid1", "grid2")):
                    continue  # (fewer runs: overlap_hi vs seq tells the stream's part; grid2 = new for one slot)
                knobs = dict(knobs or {})
                fuse = knobs.pop("fuse", True)  # gate_up's kernel doing down_proj's shrink (decode sizes)
                saved = {k: getattr(triton_lora, k) for k in knobs}
                try:
                    for k, v in knobs.items():
                        setattr(triton_lora, k, v)
                    batch.side_stream = streams.get(stream)
                    token_slots = mix if fixed is None else torch.full_like(mix, fixed)

                    def body():
                        if lora:
                            batch.prepare(token_slots)
                        out = stack(h0, lora)
                        batch.clear()
                        return out

                    body()  # (timing only: the checks are micro's and tiny's)
                    if SMOKE:
                        us = 0.0
                    else:
                        us = _time_graph(body, reps=1, replays=20) / layers
                    rows.append({"tokens": tokens, "adapters": adapters, "variant": variant, "us_per_layer": us})
                    print(f"  T={tokens:5} adapters={adapters:2} {variant:11} {us:9.1f} us per layer", flush=True)
                except Exception as exc:
                    traceback.print_exc()
                    check(False, f"layer T={tokens} adapters={adapters} {variant} raised {exc!r}"[:400])
                finally:
                    for k, v in saved.items():
                        setattr(triton_lora, k, v)
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
    runs = {"graphs": dict(max_loras=3), "one_slot": dict(max_loras=1, max_cpu_loras=1)}
    if not SMOKE:
        runs["eager"] = dict(max_loras=3, enforce_eager=True)
    rows = {}
    for label, extra in runs.items():
        engine = dict(dtype="float32", enable_lora=True, max_lora_rank=16, **extra)
        if SMOKE:
            engine.update(single_process=True, kv_cache_memory_gb=0.02)
        else:
            engine.update(gpu_memory_utilization=0.3, max_model_len=256)
        with LLM(path, **engine) as llm:
            # Batch 1 first (each prefill alone: the prompt-chunk graphs, one row's slot per token),
            # then everything mixed in one batch.
            solo = [1, 2, 3]
            outs = [llm.generate([{"prompt_token_ids": prompts[i]}], params, use_tqdm=False,
                                 lora_request=loras[names[i]])[0] for i in solo]
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                 lora_request=[None if n is None else loras[n] for n in names])
        exact, notes = 0, []
        for out, ref, n in zip(outs, [refs[i] for i in solo] + refs, [names[i] for i in solo] + names):
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
    from transformers import AutoTokenizer

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
    if not SMOKE and num != 1000:
        print(f"  NOTE: {num} prompts (the issue's shape is 1000 x 512 x 256)")
    counts = (1, 4) if SMOKE else (1, 8, 64)
    max_loras = max(counts)
    used = max_loras if "engine" in parts else 1  # batch 1 alone: one adapter written and loaded
    root = tempfile.mkdtemp(prefix="lora-adapters-")
    start = time.perf_counter()
    folders = [write_adapter(os.path.join(root, f"f{i}"), shape, 16, i) for i in range(min(8, used))]
    print(f"  wrote {len(folders)} rank-16 adapter folders in {time.perf_counter() - start:.1f} s")
    loras = [LoRARequest(f"adapter{i}", i + 1, folders[i % len(folders)]) for i in range(max_loras)]
    prompts = [{"prompt_token_ids": p} for p in
               make_prompts(AutoTokenizer.from_pretrained(path), "random", num, inp, shape["vocab_size"])]
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    one_params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    one_prompt = [prompts[0]]
    common = dict(load_format="dummy", dtype="float32" if SMOKE else "bfloat16", max_model_len=inp + out + 16)
    if SMOKE:
        common.update(single_process=True, kv_cache_memory_gb=0.05)
    figures: dict = results.setdefault("engine", {})

    def timed(llm, lora_request, label: str, batch=prompts, p=params, repeat: int = 1) -> dict:
        best = None
        for _ in range(repeat):  # batch 1: the best of a few (short runs are noisy)
            t0 = time.perf_counter()
            outs = llm.generate(batch, p, use_tqdm=False, lora_request=lora_request)
            f = summarize(outs, time.perf_counter() - t0, inp)
            if best is None or f["tpot_ms_mean"] < best["tpot_ms_mean"]:
                best = f
        figures[label] = best
        print(f"  {label:24} {best['output_tokens_per_s']:10.1f} out tok/s  tpot {best['tpot_ms_mean']:.2f} ms  "
              f"({best['elapsed_s']:.1f} s)")
        return best

    with LLM(path, **common) as llm:  # the base model: no LoRA anywhere
        if "engine" in parts:
            llm.generate(prompts[:8], params, use_tqdm=False)  # warm
            timed(llm, None, "base")
        if "batch1" in parts:
            llm.generate(one_prompt, one_params, use_tqdm=False)
            timed(llm, None, "batch1_base", one_prompt, one_params, repeat=2)
    save(results)
    try:  # a failure here still leaves the table of what was measured (and fails the run)
        with LLM(path, enable_lora=True, max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_loras,
                 **common) as llm:
            # Every adapter read into host memory and a device slot once, before timing (as a server
            # that was given them with --lora-modules would have them after its first requests).
            start = time.perf_counter()
            llm.generate([prompts[0]] * used, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=loras[:used])
            print(f"  loaded {used} adapters in {time.perf_counter() - start:.1f} s")
            if "batch1" in parts:
                llm.generate(one_prompt, one_params, use_tqdm=False, lora_request=loras[0])
                timed(llm, loras[0], "batch1_lora", one_prompt, one_params, repeat=2)
                timed(llm, None, "batch1_base_in_lora_engine", one_prompt, one_params, repeat=2)
            if "engine" in parts:
                for count in counts:
                    mix = [loras[i % count] for i in range(num)]
                    timed(llm, mix, f"lora_{count}_adapters")
                timed(llm, None, "base_in_lora_engine")
    except Exception as exc:
        traceback.print_exc()
        check(False, f"LoRA engine raised {type(exc).__name__}: {exc}"[:500])
    lines = ["| run | out tok/s | x base | goal | | TPOT ms |", "|---|---|---|---|---|---|"]
    base = figures.get("base")
    if base:
        print(f"  {'adapters':>8} {'out tok/s':>10} {'x base':>7} {'goal':>6}")
        lines.append(f"| base ({num} x {inp} x {out}) | {base['output_tokens_per_s']:.1f} | 1 | | | "
                     f"{base['tpot_ms_mean']:.2f} |")
        for count in counts:
            f = figures.get(f"lora_{count}_adapters")
            if f is None:  # that run did not finish: the table keeps the others
                continue
            ratio = f["output_tokens_per_s"] / base["output_tokens_per_s"]
            goal = GOALS.get(count, 0.8)
            results[f"ratio_{count}_adapters"] = ratio
            verdict = "met" if ratio >= goal else "MISSED"
            print(f"  {count:8} {f['output_tokens_per_s']:10.1f} {ratio:7.3f} {goal:6.2f} {verdict}")
            lines.append(f"| {count} adapters | {f['output_tokens_per_s']:.1f} | {ratio:.3f} | >= {goal} | {verdict} | "
                         f"{f['tpot_ms_mean']:.2f} |")
        f = figures.get("base_in_lora_engine", base)
        lines.append(f"| base requests, LoRA engine | {f['output_tokens_per_s']:.1f} | "
                     f"{f['output_tokens_per_s'] / base['output_tokens_per_s']:.3f} | | | {f['tpot_ms_mean']:.2f} |")
    if "batch1_base" in figures and "batch1_lora" in figures:
        b0, b1 = figures["batch1_base"]["tpot_ms_mean"], figures["batch1_lora"]["tpot_ms_mean"]
        ratio = b1 / b0
        results["batch1_tpot_ratio"] = ratio
        verdict = "met" if ratio <= BATCH1_GOAL else "MISSED"
        print(f"  batch 1: {b0:.2f} ms/token base, {b1:.2f} with an adapter: {ratio:.3f}x "
              f"(goal <= {BATCH1_GOAL}) {verdict}")
        lines.append(f"| batch 1 base | | | | | {b0:.2f} |")
        lines.append(f"| batch 1 adapter | | {ratio:.3f} (TPOT) | <= {BATCH1_GOAL} | {verdict} | {b1:.2f} |")
        lines.append(f"| batch 1 base request, LoRA engine | | | | | "
                     f"{figures.get('batch1_base_in_lora_engine', {}).get('tpot_ms_mean', float('nan')):.2f} |")
    MARKDOWN[f"engine: Llama-3.1-8B shape, dummy weights, rank 16 on all seven projections, max_loras={max_loras}"] = \
        lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="micro,layer,tiny,engine,batch1")
    ap.add_argument("--prompts", type=int, default=1000, help="engine: prompts per run (512 in x 256 out)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks that the script runs)")
    ap.add_argument("--layer-tokens", default="1,16,64,256,8192", help="layer: the step sizes")
    ap.add_argument("--layer-variants", default=",".join(LAYER_VARIANTS), help="layer: the variants")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"micro", "layer", "tiny", "engine", "batch1"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    os.makedirs(OUT, exist_ok=True)
    results: dict = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "parts": sorted(parts)}
    start_all = time.perf_counter()
    steps = [(name, fn) for name, fn in (("micro", micro), ("layer", layer), ("tiny", tiny)) if name in parts]
    if parts & {"engine", "batch1"}:
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
    results["total_s"] = time.perf_counter() - start_all
    save(results)
    print(f"total {results['total_s']:.0f} s; {len(FAILED)} failed check(s); wrote {OUT}/gpu_lora.json and .md")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
