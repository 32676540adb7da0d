"""`tokenmill bench all-reduce --overlap-rows R,...`: the TP overlap's mechanism (`model/tp_overlap.py`)
on its own, checked and timed in CUDA graphs, one process per GPU.

A chain of `layers` Llama-8B MLPs at TP=2 (gate_up 4096 -> 2 x 7168, SiLU-and-mul, down 7168 -> 4096,
random bf16 weights), each followed by the all-reduce of its partial sum and an RMSNorm, over R
rows, two ways:
- serial: one batch, the all-reduce on the compute stream (the symmetric buffer's kernel where the
  message fits it, as the engine's one-batch path; NCCL above);
- halves: rows in two halves, each half's all-reduce started on the side stream
  (`SymmetricAllReduce.start`) and joined only where that half's norm needs it, so one half's
  all-reduce runs under the other half's GEMMs.
Checked: the halves' output against the serial one (bf16, within 2%: the GEMMs of fewer rows may
round differently; a join that came too early reads a partial, off by the peer's share), ranks
equal. Timed: us per layer of each, graph replays (`graph_timing.graph_us`). Messages above the buffer (NCCL) run eagerly
are skipped (the engine's halves take NCCL's own stream there, outside graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HIDDEN, INTER = 4096, 7168  # Llama-3.1-8B's width, and its MLP's intermediate size at TP=2


def _norm(x: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def run_overlap(group, device: torch.device, rows_list: list[int], layers: int = 8) -> list[dict]:
    import torch.distributed as dist

    from tokenmill.benchmarks.graph_timing import graph_us
    from tokenmill.distributed.symm_all_reduce import AllReduceLimits, SymmetricAllReduce
    from tokenmill.model.tp_overlap import split_point

    rank = dist.get_rank(group)
    symm = SymmetricAllReduce(group, device, AllReduceLimits())  # the engine's limits
    side = torch.cuda.Stream(device=device, priority=-1)
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    w1 = (torch.randn(2 * INTER, HIDDEN, generator=gen, device=device) * HIDDEN ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(HIDDEN, INTER, generator=gen, device=device) * INTER ** -0.5).to(torch.bfloat16)

    def reduce_now(p: torch.Tensor) -> torch.Tensor:
        method = symm.method_for(p)
        if method == "nccl":
            dist.all_reduce(p, group=group)
            return p
        return symm.all_reduce(p, method)

    def serial(x: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            x = _norm(reduce_now(_mlp(x, w1, w2)))
        return x

    def halves(x: torch.Tensor) -> torch.Tensor:
        s = split_point(x.shape[0])
        outs: list = [x[:s], x[s:]]
        pending: list = [None, None]  # per half: (its started sum, its end event, the partial read)
        for _ in range(layers):
            for h in range(2):
                if pending[h] is not None:  # join this half's all-reduce only
                    torch.cuda.current_stream(device).wait_event(pending[h][1])
                    outs[h] = _norm(pending[h][0])
                p = _mlp(outs[h], w1, w2)
                pending[h] = (*symm.start(p, side), p)
        for h in range(2):
            torch.cuda.current_stream(device).wait_event(pending[h][1])
        return torch.cat([_norm(pending[h][0]) for h in range(2)])

    results = []
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator(device=device).manual_seed(99), device=device
                        ).to(torch.bfloat16)
        fits = symm.method_for(torch.empty(split_point(rows), HIDDEN, device=device, dtype=torch.bfloat16)) != "nccl"
        row: dict = {"rows": rows, "layers": layers, "halves_in_graph": fits}
        if not fits:
            row["skipped"] = "halves' messages above the symmetric buffer (NCCL: eager only, not timed here)"
            results.append(row)
            continue
        ref = serial(x.clone())
        got = halves(x.clone())
        torch.cuda.synchronize()
        rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        total = got.float().sum().reshape(1)
        others = [torch.zeros_like(total) for _ in range(dist.get_world_size(group))]
        dist.all_gather(others, total, group=group)
        row["max_rel_diff"] = rel
        row["ranks_equal"] = all(bool(torch.equal(o, others[0])) for o in others)
        row["ok"] = rel < 2e-2 and row["ranks_equal"]
        for name, fn in (("serial", serial), ("halves", halves)):
            held: list = [None]  # the captured graph's output (its last replay's)
            dist.barrier(group=group)
            row[f"{name}_us_per_layer"] = graph_us(lambda fn=fn: held.__setitem__(0, fn(x)), replays=5, warmup=1) / layers
            rel_graph = ((held[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            row[f"{name}_graph_ok"] = bool(rel_graph < 2e-2)
            del held
            dist.barrier(group=group)
        row["ok"] = row["ok"] and row["serial_graph_ok"] and row["halves_graph_ok"]
        row["halves_over_serial"] = row["halves_us_per_layer"] / row["serial_us_per_layer"]
        results.append(row)
        if rank == 0:
            print(f"overlap {rows:>6} rows: serial {row['serial_us_per_layer']:8.1f} us/layer, halves "
                  f"{row['halves_us_per_layer']:8.1f} ({row['halves_over_serial']:.3f}x), max rel diff {rel:.2e}, "
                  f"ranks equal {row['ranks_equal']}, {'ok' if row['ok'] else 'FAILED'}", flush=True)
        del x
    return results
