"""`tokenmill bench all-reduce`: the TP all-reduce's methods, checked and timed per message size.

One process per GPU (NCCL group over TCP on localhost). For each size: a random bfloat16 message
per rank, reduced by NCCL, by the symmetric buffer's one-shot and its two-shot kernels; the
symmetric results must equal NCCL's (on two ranks a sum of two values is rounded once either
way, so they are compared bit for bit; above two, within one bf16 step). Then each method's time
per call inside a CUDA graph of `--calls` back-to-back all-reduces (how a decode step runs them),
and eagerly. The table shows where each method wins; `symm_all_reduce.AllReduceLimits` holds the
limits taken from it. Then the all-reduce fused with the residual add and RMSNorm against the two
apart, per row count (`all_reduce_norm.py`), and the TP overlap's halves against one batch
(`--overlap-rows`, `all_reduce_overlap.py`).

    tokenmill bench all-reduce --tp 2 --output-json ar.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_SIZES_KIB = (8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_METHODS = ("nccl", "one_shot", "two_shot")


def _worker(rank: int, world: int, port: int, sizes_kib: list[int], calls: int, out: str | None,
            fused: list[int], hidden: int, variants: tuple[str, ...] = ("pull", "push", "lamport"),
            overlap: list[int] = (), lamport_tiles: list[str] = ()) -> None:
    import torch
    import torch.distributed as dist

    from tokenmill.distributed.symm_all_reduce import AllReduceLimits, SymmetricAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    group = dist.group.WORLD
    top = max(max([*sizes_kib, 1024]) << 10, max([0, *fused]) * hidden * 2)  # the fused runs' one-shot too
    symm = SymmetricAllReduce(group, device, AllReduceLimits(max_bytes=top, one_shot_bytes=top))

    def run(method: str, x: torch.Tensor) -> torch.Tensor:
        if method == "nccl":
            dist.all_reduce(x, group=group)
            return x
        return symm.all_reduce(x, method)

    rows = []
    for kib in sizes_kib:
        numel = (kib << 10) // 2
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        x = torch.randn(numel, generator=gen, device=device, dtype=torch.bfloat16)
        expected = run("nccl", x.clone())
        row: dict = {"kib": kib}
        for method in _METHODS:
            got = run(method, x.clone())
            diff = (got.float() - expected.float()).abs().max().item()
            row[f"{method}_max_diff"] = diff
            row[f"{method}_identical"] = bool(torch.equal(got, expected))
            xe = x.clone()  # grows by the group size per call: timing only
            for _ in range(3):  # warm
                run(method, xe.clone())
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                xe = run(method, xe)
            torch.cuda.synchronize()
            row[f"{method}_eager_us"] = (time.perf_counter() - start) / calls * 1e6
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run(method, x.clone())  # NCCL and the symmetric ops warm on the capture stream
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    y = x.clone()
                    for _ in range(calls):
                        y = run(method, y)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
            replays = 10
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            row[f"{method}_graph_us"] = begin.elapsed_time(end) * 1e3 / (replays * calls)
            # Back-to-back calls reuse the buffer: a rank that refills it while a peer still reads the
            # previous message would show here. Each call multiplies the (rank-equal) sum by `world`.
            chained = expected.float() * float(world) ** (calls - 1)
            row[f"{method}_chain_ok"] = bool(torch.allclose(y.float(), chained, rtol=2e-2, atol=0))
            del graph, y
            dist.barrier()
        best = min(_METHODS, key=lambda m: row[f"{m}_graph_us"])
        row["best"] = best
        rows.append(row)
        if rank == 0:
            print(f"{kib:>7} KiB  " + "  ".join(f"{m} {row[f'{m}_graph_us']:7.1f} us" for m in _METHODS)
                  + f"  best {best}  identical " + ",".join(m for m in _METHODS if row[f"{m}_identical"])
                  + "  chain ok " + ",".join(m for m in _METHODS if row[f"{m}_chain_ok"]),
                  flush=True)
    failed = [f"{r['kib']} KiB {m}" for r in rows for m in _METHODS if not (r[f"{m}_chain_ok"]
                                                                              and (r[f"{m}_max_diff"] == 0.0 or world > 2))]
    if rank == 0 and failed:
        print("all-reduce results differ from NCCL's: " + ", ".join(failed), flush=True)
    fused_rows = []
    if fused:  # the all-reduce fused with the residual add and RMSNorm (`all_reduce_norm`)
        from tokenmill.benchmarks.all_reduce_norm import run_fused
        # Each variant of the kernel (`all_reduce_norm.VARIANTS`), checked and timed alike.
        for variant in variants:
            fused_rows += run_fused(group, device, symm, hidden, fused, calls, variant, lamport_tiles)
        failed += [f"fused {r['variant']} {r['rows']} rows" for r in fused_rows if not r["ok"]]
        if rank == 0 and not all(r["ok"] for r in fused_rows):
            print("fused all-reduce + norm failed its checks", flush=True)
    overlap_rows = []
    if overlap:  # the TP overlap's halves against one batch (`all_reduce_overlap.py`)
        from tokenmill.benchmarks.all_reduce_overlap import run_overlap
        overlap_rows = run_overlap(group, device, list(overlap))
        failed += [f"overlap {r['rows']} rows" for r in overlap_rows if r.get("ok") is False]
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump({"world_size": world, "calls_per_graph": calls, "gpu": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "rows": rows, "fused_rows": fused_rows,
                       "overlap_rows": overlap_rows}, f, indent=2)
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


def run(args: argparse.Namespace) -> int:
    """Start one worker per GPU and wait for them."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    port = args.port
    procs = [subprocess.Popen([sys.executable, "-m", "tokenmill.benchmarks.all_reduce", "--worker", str(rank),
                               "--tp", str(args.tp), "--port", str(port), "--sizes-kib", args.sizes_kib,
                               "--calls", str(args.calls), "--fused-rows", args.fused_rows,
                               "--hidden", str(args.hidden), "--fused-variants", args.fused_variants,
                               "--overlap-rows", args.overlap_rows, "--lamport-tiles", args.lamport_tiles,
                               *(["--output-json", args.output_json]
                                                             if args.output_json else [])], env=env)
             for rank in range(args.tp)]
    codes = [p.wait() for p in procs]
    return max(codes)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, help="GPUs (one process each)")
    p.add_argument("--sizes-kib", default=",".join(map(str, _SIZES_KIB)), help="message sizes in KiB")
    p.add_argument("--calls", type=int, default=64, help="all-reduces per captured graph (two per layer)")
    p.add_argument("--fused-rows", default="1,8,32,128,256,512",
                   help="rows of the fused all-reduce + residual add + RMSNorm runs ('' for none)")
    p.add_argument("--hidden", type=int, default=4096, help="the fused runs' row width")
    p.add_argument("--fused-variants", default="pull,push,lamport", help="the fused kernel's variants to run")
    p.add_argument("--overlap-rows", default="", help="rows of the TP overlap's check and timing (halves "
                   "against one batch, `all_reduce_overlap.py`; '' for none), e.g. 1024,8192")
    p.add_argument("--lamport-tiles", default="", help="the lamport variant's launch shapes, rows:warps:per_sm "
                   "separated by ',' (e.g. 1:16:1,2:16:1,1:8:2), each checked and timed ('': the engine's)")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--output-json", default=None)


def add_parser(sub) -> None:
    p = sub.add_parser("all-reduce", help="TP all-reduce methods (NCCL, symmetric one-/two-shot) per size, on GPUs",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _add_arguments(p)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is None:
        return run(args)
    _worker(args.worker, args.tp, args.port, [int(v) for v in args.sizes_kib.split(",") if v], args.calls,
            args.output_json, [int(v) for v in args.fused_rows.split(",") if v], args.hidden,
            tuple(v for v in args.fused_variants.split(",") if v), [int(v) for v in args.overlap_rows.split(",") if v],
            [v for v in args.lamport_tiles.split(",") if v])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
