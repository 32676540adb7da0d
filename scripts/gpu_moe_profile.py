"""Where a MoE decode step's time goes (`scripts/gpu_moe.py --parts profile,sweep`).

profile  torch.profiler over graph-replayed decode steps of two engines (dummy bf16 weights, CUDA
         graphs, one process): OLMoE-1B-7B at batch 256 and Qwen3-30B-A3B (24 layers) at batch 1.
         Steps are caught at `ModelRunner.launch` (every row one token, the batch full): the profiler
         starts before the first caught step and stops before the one after the last, with the
         device synchronized at both ends, so it holds whole steps (replay, sampling, copies).
         Writes a per-kernel table (device time per step, calls per step) and the share of each
         group (MoE GEMMs, MoE alignment and routing, attention, dense GEMMs, norms/rotary, the
         rest) to $OUT/profile_<shape>.txt and the JSON record. GPU_MOE_PROFILE_VARIANTS=branch skips
         the "main" (patched-back) engines.
sweep    one layer's fused experts (router output given) replayed in a CUDA graph, so launch
         overhead is what the engine sees: the torch alignment against the Triton one, and a tile
         grid, at OLMoE T=256 and Qwen3-30B-A3B T=1; the best tiles go to
         $OUT/moe_configs_graph/*.json (copy into tokenmill/layers/moe/configs/ to use them).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict

import torch

GROUPS = [
    ("moe_gemm", r"_gate_up_kernel|_down_kernel"),
    ("moe_align", r"_align|sort|radix|scatter|cumsum|scan|searchsorted|bincount|histogram"),
    ("moe_router", r"topk|softmax|gather|sigmoid|_router"),
    ("attention", r"paged_attention|reduce_splits|write_kv|kv_write"),
    ("dense_gemm", r"gemm|gemv|cutlass|nvjet|xmma|sm90|splitk|splitK|cublas|matmul"),
    ("norm_rope", r"rms_norm|rotary|norm"),
    ("rest", r".*"),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return group
    return "rest"


def _device_events(prof) -> list[tuple[str, float]]:
    """(kernel name, device microseconds) of every device-side event (kernels, memcpy, memset)."""
    out = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out.append((evt.name, float(evt.time_range.elapsed_us())))
    return out


def kernel_table(events: list[tuple[str, float]], steps: int) -> dict:
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us in events:
        per_name[name][0] += us
        per_name[name][1] += 1
    total = sum(us for _, us in events)
    rows = sorted(((n, us / steps, c / steps) for n, (us, c) in per_name.items()), key=lambda r: -r[1])
    groups: dict[str, float] = defaultdict(float)
    for name, us, _ in rows:
        groups[group_of(name)] += us
    return {"steps": steps, "device_us_per_step": total / steps,
            "kernels_per_step": len(events) / steps,
            "groups_us_per_step": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": n[:160], "us_per_step": us, "calls_per_step": c, "group": group_of(n)}
                        for n, us, c in rows]}


def format_table(label: str, table: dict, wall_ms: float) -> str:
    total = table["device_us_per_step"]
    lines = [f"{label}: {table['steps']} steps, wall {wall_ms:.3f} ms/step (unprofiled steps before: "
             f"{table['wall_ms_per_step_unprofiled']:.3f}), device busy {total / 1e3:.3f} ms/step, "
             f"{table['kernels_per_step']:.0f} kernels/step",
             "group shares: " + ", ".join(f"{g} {us / 1e3:.3f} ms ({100 * us / max(total, 1e-9):.1f}%)"
                                           for g, us in table["groups_us_per_step"].items()),
             f"{'us/step':>9} {'share':>6} {'calls':>6}  {'group':<10} kernel"]
    for k in table["kernels"][:45]:
        lines.append(f"{k['us_per_step']:9.1f} {100 * k['us_per_step'] / max(total, 1e-9):5.1f}% "
                     f"{k['calls_per_step']:6.1f}  {k['group']:<10} {k['name'][:110]}")
    return "\n".join(lines)


def profile_engine(path: str, device: str, batch: int, in_len: int, warm: int, steps: int) -> tuple[dict, float]:
    """Profile `steps` full-batch decode steps after `warm` of them; (kernel table, wall ms per step)."""
    import random
    from tokenmill import LLM, SamplingParams
    from tokenmill.worker.model_runner import ModelRunner
    rng = random.Random(0)
    reqs = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(in_len)]} for _ in range(batch)]
    # Rows prefilled early decode during the later rows' prefill chunks (8192 tokens a step): that
    # many more tokens, so the full batch still decodes warm + steps + 1 steps together.
    out_len = warm + steps + 8 + -(-batch * in_len // 8192)
    state = {"n": 0, "t0": 0.0, "wall": 0.0, "t_plain": 0.0, "plain": 0.0}
    # Device activity only on CUDA: recording every CPU op would slow the host, and at batch 1 the
    # host's pace can be the step's.
    activities = [torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU]
    prof = torch.profiler.profile(activities=activities)
    original = ModelRunner.launch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def launch(self, so):
        counts = so.batch_counts
        if len(counts) == batch and int(counts.sum()) == batch and state["n"] >= 0:
            state["n"] += 1
            if state["n"] == 3:
                state["t_plain"] = time.perf_counter()
            if state["n"] == warm + 1:
                sync()
                state["plain"] = (time.perf_counter() - state["t_plain"]) / (warm - 2)
                prof.start()
                state["t0"] = time.perf_counter()
            elif state["n"] == warm + steps + 1:
                sync()
                state["wall"] = time.perf_counter() - state["t0"]
                prof.stop()
                state["n"] = -1
        return original(self, so)

    ModelRunner.launch = launch
    try:
        with LLM(path, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32", device=device,
                 max_model_len=in_len + out_len + 16, max_num_seqs=max(batch, 1), enable_prefix_caching=False,
                 single_process=True, kv_cache_memory_gb=0.05) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            llm.generate(reqs, params, use_tqdm=False)
    finally:
        ModelRunner.launch = original
    if state["n"] != -1:
        raise RuntimeError(f"profile: only {state['n']} full decode steps of batch {batch} were seen")
    events = _device_events(prof)
    if not events:  # CPU (smoke): the CPU ops' own time stands in
        events = [(e.key, float(e.self_cpu_time_total)) for e in prof.key_averages() for _ in range(1)]
    table = kernel_table(events, steps)
    table["wall_ms_per_step_unprofiled"] = 1e3 * state["plain"]  # steps 3..warm, no profiler running
    return table, 1e3 * state["wall"] / steps


class _MainPaths:
    """The MoE decode path as main had it before the profile's fixes (torch alignment over the E-wide
    grid bound, torch router, OLMoE's q/k norm in torch ops), put back by patching for a "before"
    profile in the same run."""

    def __enter__(self):
        from tokenmill.layers.moe import align, layer
        from tokenmill.model import olmoe
        self.saved = (align.IMPL, align.max_padded_rows, layer.routing.fused_router_applies, olmoe.ShardedRMSNorm.forward)
        align.IMPL = "torch"
        align.max_padded_rows = lambda pairs, experts, block_m: pairs + experts * (block_m - 1)
        layer.routing.fused_router_applies = lambda moe: False

        def norm(mod, x):
            square_sum = mod.parallel.all_reduce(x.float().square().sum(dim=-1, keepdim=True))
            return mod.weight * (x.float() * torch.rsqrt(square_sum / mod.full_size + mod.eps)).to(x.dtype)
        olmoe.ShardedRMSNorm.forward = norm
        return self

    def __exit__(self, *exc):
        from tokenmill.layers.moe import align, layer
        from tokenmill.model import olmoe
        align.IMPL, align.max_padded_rows, layer.routing.fused_router_applies, olmoe.ShardedRMSNorm.forward = self.saved


def part_profile(results: dict, smoke: bool, device: str, config_dir, out_dir: str, arch_of, step_weight_bytes,
                 bandwidth: float) -> None:
    """The bound beside each profile: the step's weights (active experts) and KV at the profiled
    steps' mean context, over the copy bandwidth measured at the part's start."""
    from tokenmill.benchmarks.roofline import kv_bytes_per_token
    cases = [("olmoe-1b-7b", 256, 320), ("qwen3-30b-a3b-24l", 1, 128)]
    results["profile_copy_bandwidth_GBps"] = bandwidth / 1e9
    for shape, batch, in_len in cases:
        path = config_dir(shape, smoke)
        arch = arch_of(path)
        b, i = (4, 8) if smoke else (batch, in_len)
        warm, steps = (4, 2) if smoke else (8, 10)
        context = i + warm + steps / 2
        bound_ms = 1e3 * (step_weight_bytes(arch, b) + b * context * kv_bytes_per_token(arch, "bfloat16")) / bandwidth
        for variant in os.environ.get("GPU_MOE_PROFILE_VARIANTS", "main,branch").split(","):
            try:
                table, wall_ms = _profile_in_child(dict(path=path, device=device, batch=b, in_len=i, warm=warm,
                                                        steps=steps, variant=variant))
            except Exception as exc:  # noqa: BLE001 (report, go on with the next)
                print(f"  {shape} {variant}: profile failed: {exc}")
                results[f"profile_{shape}_b{b}_{variant}"] = {"error": str(exc)[:2000]}
                continue
            plain = table["wall_ms_per_step_unprofiled"]
            label = (f"{shape} batch {b}, context {context:.0f}, {variant} MoE path (bound {bound_ms:.3f} ms at "
                     f"{bandwidth / 1e9:.0f} GB/s: unprofiled steps at {100 * bound_ms / plain:.1f}% of it)")
            text = format_table(label, table, wall_ms)
            print(text)
            with open(os.path.join(out_dir, f"profile_{shape}_b{b}_{variant}.txt"), "w") as f:
                f.write(text + "\n")
            results[f"profile_{shape}_b{b}_{variant}"] = {**table, "wall_ms_per_step": wall_ms, "bound_ms": bound_ms,
                                                          "kernels": table["kernels"][:60]}
            with open(os.path.join(out_dir, "gpu_moe.json"), "w") as f:  # a run cut short keeps what it measured
                json.dump(results, f, indent=1, default=str)


def _profile_in_child(job: dict) -> tuple[dict, float]:
    """One engine's profile in a fresh process: a profiler session leaves CUPTI attached, and
    kernels of graphs captured after it may then go unrecorded (each profile here attaches only
    after its engine captured its graphs)."""
    import subprocess
    import sys
    import tempfile
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(job), result.name],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"child exited {proc.returncode}: {proc.stderr[-1500:]}")
        rec = json.load(result)
    if not rec["table"]["kernels"]:
        raise RuntimeError("the profiler recorded no kernels")
    return rec["table"], rec["wall_ms"]


def _child_main(job: dict, result_path: str) -> None:
    import contextlib
    if job["device"] == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with _MainPaths() if job["variant"] == "main" else contextlib.nullcontext():
        table, wall_ms = profile_engine(job["path"], job["device"], job["batch"], job["in_len"], job["warm"],
                                        job["steps"])
    with open(result_path, "w") as f:
        json.dump({"table": table, "wall_ms": wall_ms}, f)


def _graph_time(fn, device: str, reps: int) -> float:
    """Seconds per call of `fn` replayed in a CUDA graph (eager on CPU)."""
    if device != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    from tokenmill.benchmarks.graph_timing import graph_us
    return graph_us(fn, calls=10, replays=reps, warmup=1) * 1e-6


SWEEP_TILES = {  # (block_m, block_n, block_k, num_warps, num_stages); down uses the same n/k; likeliest first
    "decode": [(16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 32, 256, 4, 4), (16, 64, 64, 4, 4),
               (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 64, 128, 8, 4)],
    "batch": [(64, 64, 64, 4, 3), (32, 64, 64, 4, 3), (64, 64, 128, 4, 3), (32, 64, 128, 4, 4),
              (64, 128, 64, 8, 3), (64, 64, 64, 8, 4), (32, 128, 64, 4, 3), (16, 64, 128, 4, 3),
              (32, 64, 64, 4, 4), (16, 128, 128, 4, 4)],
}


def part_sweep(results: dict, smoke: bool, device: str, dtype, random_moe, out_dir: str,
               budget_s: float = 8.0) -> None:
    """`budget_s`: seconds of tile timing per shape (compiles included); the rest is fixed work."""
    from tokenmill.layers.moe import align as align_mod
    from tokenmill.layers.moe.fused_moe import fused_experts
    from tokenmill.layers.moe.tile_configs import TileConfig, config_file_name, tile_config
    start = time.perf_counter()
    shapes = ([("tiny", (8, 64, 32, 2), 8, "decode")] if smoke else
              [("olmoe-1b-7b", (64, 2048, 1024, 8), 256, "batch"), ("qwen3-30b-a3b", (128, 2048, 768, 8), 1, "decode")])
    cfg_dir = os.path.join(out_dir, "moe_configs_graph")
    os.makedirs(cfg_dir, exist_ok=True)
    dname = str(dtype).removeprefix("torch.")
    reps = 2 if smoke else 20
    experts: dict = {}
    for name, (e, h, i, k), t, kind in shapes:
        if name not in experts:  # random weights made on the device once per shape (the CPU is slow at GBs)
            gen = torch.Generator(device=device).manual_seed(0)
            experts[name] = ((torch.randn(e, 2 * i, h, generator=gen, device=device) * 0.03).to(dtype),
                             (torch.randn(e, h, i, generator=gen, device=device) * 0.03).to(dtype))
        w13, w2 = experts[name]
        x, _, _, weights, ids = random_moe(e, 8, 8, k, t, dtype, device)  # routing only; x below
        x = (torch.randn(t, h, device=device) / 2).to(dtype)
        active = len(set(ids.flatten().tolist()))
        expert_bytes = active * 3 * h * i * x.element_size()
        current = tile_config(e, h, i, t, dname, k)
        rec: dict = {"current": current.to_json(), "expert_bytes": expert_bytes}
        for mode in ("torch", "triton"):
            align_mod.IMPL = mode
            try:
                sec = _graph_time(lambda: fused_experts(x, w13, w2, weights, ids, current), device, reps)
                rec[f"fused_align_{mode}_us"] = sec * 1e6
                rec[f"fused_align_{mode}_GBps"] = expert_bytes / sec / 1e9
                sec = _graph_time(lambda: align_mod.align_by_expert(ids, e, current.block_m), device, reps)
                rec[f"align_only_{mode}_us"] = sec * 1e6
            except Exception as exc:  # noqa: BLE001 (report, go on)
                rec[f"align_{mode}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            finally:
                align_mod.IMPL = "auto"
        print(f"  {name} T={t}: current tiles {current} (expert bytes {expert_bytes / 1e6:.1f} MB): fused MoE with "
              f"torch align {rec.get('fused_align_torch_us', float('nan')):.1f} us, with triton align "
              f"{rec.get('fused_align_triton_us', float('nan')):.1f} us; alignment alone "
              f"{rec.get('align_only_torch_us', float('nan')):.1f} vs {rec.get('align_only_triton_us', float('nan')):.1f} us")
        timings = []
        start = time.perf_counter()
        for bm, bn, bk, warps, stages in SWEEP_TILES[kind][:2] if smoke else SWEEP_TILES[kind]:
            if time.perf_counter() - start > budget_s:
                print(f"  sweep stopped at its {budget_s:.0f} s budget")
                break
            cfg = TileConfig(bm, bn, bk, bn, bk, warps, stages)
            try:
                sec = _graph_time(lambda: fused_experts(x, w13, w2, weights, ids, cfg), device, reps)
            except Exception as exc:  # noqa: BLE001 (a tile that does not fit: skip it)
                print(f"    skip {cfg}: {type(exc).__name__}")
                continue
            timings.append((sec, cfg))
            print(f"    {bm:3d} {bn:4d} {bk:4d} w{warps} s{stages}: {sec * 1e6:8.1f} us  "
                  f"{expert_bytes / sec / 1e9:7.0f} GB/s")
        if timings:
            best_sec, best = min(timings, key=lambda r: r[0])
            rec["best"] = best.to_json()
            rec["best_us"] = best_sec * 1e6
            rec["sweep"] = [{"us": s * 1e6, **c.to_json()} for s, c in timings]
            print(f"  {name} T={t}: best {best} {best_sec * 1e6:.1f} us")
            path = os.path.join(cfg_dir, config_file_name(e, h, i, dname))
            table = json.load(open(path)) if os.path.exists(path) else {}
            table[str(t)] = best.to_json()
            with open(path, "w") as f:
                json.dump(table, f, indent=1)
        results[f"sweep_{name}_T{t}"] = rec
    _router_ab(results, smoke, device, dtype, reps)
    part_attn_sweep(results, smoke, device, dtype)


def _router_ab(results: dict, smoke: bool, device: str, dtype, reps: int) -> None:
    """The router alone in a CUDA graph: the torch ops (float32 logits, softmax, top-k, renormalize)
    against the Triton router (two launches), Qwen3-30B-A3B's (E=128, H=2048, top-8, renormalized)."""
    from tokenmill.config import MoEArch
    from tokenmill.layers.moe.routing import select_experts
    from tokenmill.layers.moe.triton_router import route
    e, h = (8, 64) if smoke else (128, 2048)
    moe = MoEArch(num_experts=e, top_k=2 if smoke else 8, intermediate_size=32, renormalize=True)
    w = (torch.randn(e, h) * 0.02).to(dtype).to(device)
    for t in ((4,) if smoke else (1, 256)):
        x = torch.randn(t, h).to(dtype).to(device)
        torch_s = _graph_time(lambda: select_experts(torch.nn.functional.linear(x.float(), w.float()), moe), device, reps)
        fused_s = _graph_time(lambda: route(x, w, None, moe), device, reps)
        results[f"sweep_router_T{t}"] = {"torch_us": torch_s * 1e6, "triton_us": fused_s * 1e6}
        print(f"  router E={e} T={t}: torch ops {torch_s * 1e6:.1f} us, Triton router {fused_s * 1e6:.1f} us")


ATTN_TILES = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 3), (32, 4, 4)]


def part_attn_sweep(results: dict, smoke: bool, device: str, dtype, budget_s: float = 5.0) -> None:
    """The decode attention alone (paged, one launch per layer), replayed in a CUDA graph, at 256
    rows of 320 keys, block size 16: OLMoE's MHA (16 x 128) and Qwen3-30B-A3B's GQA (32 query heads
    on 4 KV heads of 128); bytes are the K and V read. The launch's other choices are the backend's."""
    from tokenmill.layers.attention.triton_backend import TritonAttentionConfig, plan_launch
    from tokenmill.layers.attention.triton_paged_attention import paged_attention
    cases = {"mha16": (16, 16), "gqa32x4": (32, 4)}
    for label, (heads, kv_heads) in cases.items():
        start = time.perf_counter()
        seqs, ctx, dim, bs = (4, 40, 16, 16) if smoke else (256, 320, 128, 16)
        heads, kv_heads = (4, 2) if smoke else (heads, kv_heads)
        per_seq = -(-ctx // bs)
        blocks = seqs * per_seq
        gen = torch.Generator(device=device).manual_seed(0)
        cache = torch.randn(2, blocks, bs, kv_heads, dim, generator=gen, device=device).to(dtype)
        table = torch.randperm(blocks, device=device).view(seqs, per_seq).to(torch.int32)
        q = torch.randn(seqs, heads, dim, generator=gen, device=device).to(dtype)
        qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device=device)
        kv_bytes = 2 * seqs * ctx * kv_heads * dim * cache.element_size()
        plan = plan_launch(TritonAttentionConfig(), heads, kv_heads, seqs, seqs, 1, ctx + 80, 132)
        ref = None
        for block_n, warps, stages in ATTN_TILES[:2] if smoke else ATTN_TILES:
            if time.perf_counter() - start > budget_s:
                print(f"  attention sweep ({label}) stopped at its {budget_s:.0f} s budget")
                break
            run = lambda: paged_attention(q, cache, qsl, seq_lens, table, dim ** -0.5, kv_heads,  # noqa: E731
                                          block_q=plan.block_q, block_n=block_n, num_splits=plan.num_splits,
                                          max_splits=max(32, plan.num_splits), num_warps=warps,
                                          num_stages=stages)
            try:
                out = run()
                ref = out if ref is None else ref
                err = float((out.float() - ref.float()).abs().max())
                sec = _graph_time(run, device, 2 if smoke else 20)
            except Exception as exc:  # noqa: BLE001 (a tile that does not fit: skip it)
                print(f"    skip attention {label} {block_n}/{warps}/{stages}: {type(exc).__name__}")
                continue
            results[f"attn_sweep_{label}_n{block_n}_w{warps}_s{stages}"] = {
                "us": sec * 1e6, "GBps": kv_bytes / sec / 1e9, "max_diff_vs_first": err}
            print(f"    attention {label} block_n {block_n:3d} w{warps} s{stages}: {sec * 1e6:7.1f} us "
                  f"{kv_bytes / sec / 1e9:6.0f} GB/s (max diff vs the first {err:.1e}; defaults: 64 w4 s2)")


if __name__ == "__main__":  # one profile job (see _profile_in_child)
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _child_main(json.loads(sys.argv[1]), sys.argv[2])
