"""The fused all-reduce + residual add + RMSNorm against the all-reduce and the norm apart, on GPUs.

Part of `tokenmill bench all-reduce` (one process per GPU, its NCCL group). For each row count
(decode batch sizes, hidden `--hidden`): random bf16 partials per rank and a float32 residual;
- checked: the fused kernel's residual and output against `all_reduce_norm.reference` over the
  ranks' partials (gathered with NCCL), and against NCCL's all-reduce + the Triton add + norm
  (`fused_add_rms_norm`, what the layers run without the fusion): the residual within one bf16
  step of the sum, the output within a bf16 rounding or two; every rank's residual bit-identical;
- chained: `calls` fused calls in a row inside a CUDA graph (each output the next partial) equal
  the same chain run eagerly, bit for bit (the halves alternate across calls and replays);
- timed: per call inside a CUDA graph of `calls` back-to-back calls, fused vs one-shot + norm vs
  NCCL + norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _graph_us(fn, calls: int, replays: int = 10) -> float:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    dist.barrier()
    return begin.elapsed_time(end) * 1e3 / (replays * calls)


def run_fused(group, device: torch.device, symm, hidden: int, rows_list: list[int], calls: int,
              variant: str = "pull", lamport_tiles: list[str] = ()) -> list[dict]:
    """`variant`: the kernel's (`all_reduce_norm`: pull, push, lamport). Lamport gets a buffer that
    holds the largest row count asked for (it is meant for prefill-sized messages too); the others
    the engine's and skip the rows it does not hold. `lamport_tiles`: lamport's launch shapes
    ("rows:warps:per_sm", `all_reduce_norm_lamport.LamportTiles`), each checked and timed at every
    row count (default: the engine's)."""
    from tokenmill.distributed.all_reduce_norm import FusedAllReduceNorm, FusedNormLimits, reference
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    limits = None
    if variant == "lamport":
        half = max(FusedNormLimits().half_bytes, world * max(rows_list) * hidden * 2)
        limits = FusedNormLimits(half_bytes=half, max_bytes=half // world)
    fused = FusedAllReduceNorm.create(group, device, limits, variant=variant)
    if fused is None:
        raise RuntimeError("the fused all-reduce + norm could not be set up (see the warning above)")
    eps = 1e-5
    out_rows = []
    shapes = [None] if variant != "lamport" or not lamport_tiles else list(lamport_tiles)
    for tiles_text, rows in [(t, r) for t in shapes for r in rows_list]:
        if tiles_text is not None and (rows == rows_list[0]):
            from tokenmill.distributed.all_reduce_norm_lamport import LamportTiles
            fused.set_lamport_tiles(LamportTiles.parse(tiles_text))
        probe = torch.empty(rows, hidden, device=device, dtype=torch.bfloat16)
        if not fused.applies(probe, probe.float(), probe[0]):  # more than its buffer holds
            continue
        gen = torch.Generator(device=device).manual_seed(7 + rank)
        x = torch.randn(rows, hidden, generator=gen, device=device, dtype=torch.bfloat16)
        shared = torch.Generator(device=device).manual_seed(99)  # the same residual and weight on every rank
        residual = torch.randn(rows, hidden, generator=shared, device=device) * 4
        weight = (1 + 0.1 * torch.randn(hidden, generator=shared, device=device)).to(torch.bfloat16)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        want_out, want_res = reference(parts, residual, weight, eps)
        got_out, got_res = fused(x, residual.clone(), weight, eps)
        nccl_sum = x.clone()
        dist.all_reduce(nccl_sum, group=group)
        apart_out, apart_res = fused_add_rms_norm(nccl_sum, residual.clone(), weight, eps)
        res_list = [torch.empty_like(got_res) for _ in range(world)]
        dist.all_gather(res_list, got_res, group=group)
        row: dict = {"rows": rows, "hidden": hidden, "kib": rows * hidden * 2 >> 10, "variant": variant,
                     "push": variant == "push", "tiles": tiles_text or (str(fused.lamport_tiles) if variant == "lamport" else None)}
        row["ref_res_max_diff"] = (got_res - want_res).abs().max().item()
        row["ref_out_max_diff"] = (got_out.float() - want_out.float()).abs().max().item()
        row["apart_res_max_diff"] = (got_res - apart_res).abs().max().item()
        row["apart_out_max_diff"] = (got_out.float() - apart_out.float()).abs().max().item()
        row["ranks_identical"] = all(torch.equal(r, res_list[0]) for r in res_list)
        # Limits: the residual as the reference's up to float32 summation order; the output within two
        # bf16 steps of its largest value; apart, the residual differs by the bf16 rounding of the sum.
        res_scale, out_step = want_res.abs().max().item(), want_out.float().abs().max().item() * 2 ** -7
        row["ok"] = (row["ref_res_max_diff"] <= 1e-6 * res_scale and row["ref_out_max_diff"] <= 2 * out_step
                     and row["apart_res_max_diff"] <= res_scale * 2 ** -7 and row["ranks_identical"])

        # The chain: each call's output is the next call's partial; graph replay vs eager, bit for bit.
        def chain(start: torch.Tensor, res: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            h = start
            for _ in range(n):
                h, res = fused(h, res, weight, eps)
            return h, res

        eager_out, eager_res = chain(x, residual.clone(), calls)
        graph = torch.cuda.CUDAGraph()
        g_res = residual.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            g_out, _ = chain(x, g_res, calls)
        torch.cuda.synchronize()
        dist.barrier()
        g_res.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        row["chain_ok"] = bool(torch.equal(g_out, eager_out) and torch.equal(g_res, eager_res))
        del graph
        dist.barrier()

        res_t = residual.clone()
        row["fused_graph_us"] = _graph_us(lambda: fused(x, res_t, weight, eps), calls)

        def nccl_norm():
            y = x.clone()
            dist.all_reduce(y, group=group)
            return fused_add_rms_norm(y, res_t, weight, eps)

        if tiles_text is None or tiles_text == shapes[0]:  # (the ones apart: once per row count)
            row["one_shot_norm_graph_us"] = _graph_us(
                lambda: fused_add_rms_norm(symm.all_reduce(x, "one_shot"), res_t, weight, eps), calls)
            row["nccl_norm_graph_us"] = _graph_us(nccl_norm, calls)
        else:
            row["one_shot_norm_graph_us"] = row["nccl_norm_graph_us"] = float("nan")
        row["ok"] = row["ok"] and row["chain_ok"]
        out_rows.append(row)
        if rank == 0:
            tiles_note = f" tiles {tiles_text}" if tiles_text else ""
            print(f"fused {variant:<7}{tiles_note} {rows:>4} x {hidden} ({row['kib']:>5} KiB)  fused {row['fused_graph_us']:6.1f} us  "
                  f"one-shot+norm {row['one_shot_norm_graph_us']:6.1f} us  nccl+norm {row['nccl_norm_graph_us']:6.1f} us"
                  f"  |res-ref| {row['ref_res_max_diff']:.2g} |out-ref| {row['ref_out_max_diff']:.2g} "
                  f"|res-apart| {row['apart_res_max_diff']:.2g} |out-apart| {row['apart_out_max_diff']:.2g} "
                  f"ranks equal {row['ranks_identical']} chain {row['chain_ok']}  {'ok' if row['ok'] else 'FAILED'}",
                  flush=True)
    return out_rows
