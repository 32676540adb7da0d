"""The base engine against the LoRA engine, both alive at once, runs alternated
(`scripts/gpu_lora.py --parts engine,batch1`).

Both engines hold the SAME number of KV blocks (the LoRA engine, started first, sizes its pool
from its share of the device; the base engine gets that count through `num_gpu_blocks_override`;
or both get `--kv-blocks`), so they run the same sequences per step and preempt alike: every run
records its engine's KV blocks and the preemptions it caused, printed next to the ratios. A base
run and a LoRA run can then alternate (base, 1 adapter, base, 1 adapter, ...): drift of the device
or host over the run falls on both alike. Each run gets prompts of its own (a seed per run): no run
finds another's prompts in the prefix cache. Every configuration is warmed first (a short run of
its mix). The 1-adapter ratio of round r is that round's LoRA run over that round's base run; the
figure is the median over rounds, with every round and the spread reported. The 8- and 64-adapter
runs are compared with the median base run. Optional runs stop when the time budget (`budget_s`,
wall time from the start of the script) would be exceeded.
"""

from __future__ import annotations

import statistics
import time

_print = print



def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Bench:
    """Timed runs of two live engines; `figures[label]`: the list of each run's summary."""

    def __init__(self, make_prompts, summarize, params, inp: int, budget_s: float, t0: float,
                 step_figures=None) -> None:
        self.make_prompts, self.summarize, self.params, self.inp = make_prompts, summarize, params, inp
        self.step_figures = step_figures  # telemetry -> the worker's device step figures (optional)
        self.budget_s, self.t0 = budget_s, t0
        self.figures: dict[str, list[dict]] = {}
        self.seed = 100
        self.last_s: dict[str, float] = {}  # the last run's seconds per kind of run (time projection)
        self.on_run = None  # called after every run (the caller writes its figures so far)

    def fits(self, *kinds: str, scale: float = 1.0, margin: float = 8.0) -> bool:
        """Whether runs of these kinds still fit the budget: each as long as the last of its kind
        (times `scale`: a smaller run of the same workload), or as the longest run so far."""
        need = sum(self.last_s.get(k, max(self.last_s.values(), default=30.0)) * scale for k in kinds)
        return time.perf_counter() - self.t0 + need + margin <= self.budget_s

    def run(self, llm, lora_request, label: str, num: int, params=None, kind: str = "full") -> dict:
        self.seed += 1
        prompts = self.make_prompts(num, self.seed)
        if self.step_figures is not None:
            llm.reset_telemetry()
        before = llm.scheduler_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params or self.params, use_tqdm=False, lora_request=lora_request)
        elapsed = time.perf_counter() - start
        after = llm.scheduler_stats()
        f = self.summarize(outs, elapsed, self.inp)
        # like for like: the engine's KV pool and the preemptions of this run
        f["kv_blocks"] = after["num_kv_blocks"]
        f["preemptions"] = after["num_preemptions"] - before["num_preemptions"]
        if self.step_figures is not None:
            f.update(self.step_figures(llm.telemetry()))
        self.last_s[kind] = elapsed
        self.figures.setdefault(label, []).append(f)
        steps = f" {f['device_step_count']} steps p50 {f['device_step_ms_p50']:.2f} ms;" \
            if "device_step_count" in f else ""
        print(f"  {label:34} {f['output_tokens_per_s']:10.1f} out tok/s  tpot {f['tpot_ms_mean']:.2f} ms  "
              f"(KV blocks {f['kv_blocks']}, {f['preemptions']} preemptions;{steps} {elapsed:.1f} s; "
              f"{time.perf_counter() - self.t0:.0f} s from the start)", flush=True)
        if self.on_run is not None:
            self.on_run()
        return f


def tok_s(runs: list[dict]) -> list[float]:
    return [r["output_tokens_per_s"] for r in runs]


def kv_of(runs: list[dict]) -> str:
    """The runs' KV blocks and preemptions, as a table cell: 'blocks / preemptions, ...'."""
    return ", ".join(f"{r.get('kv_blocks', '?')} / {r.get('preemptions', '?')}" for r in runs)


def like_for_like(figures: dict[str, list[dict]]) -> tuple[bool, dict[str, list[int]]]:
    """Whether every run (base engine's and LoRA engine's) had the same number of KV blocks, and
    the blocks per run label."""
    blocks = {label: [r.get("kv_blocks", -1) for r in runs] for label, runs in figures.items()}
    seen = {b for values in blocks.values() for b in values}
    return len(seen) == 1 and -1 not in seen, blocks


def report(bench: Bench, counts: tuple[int, ...], goals: dict, num: int, inp: int, out: int,
           batch1_goal: float, results: dict, verbose: bool = True) -> list[str]:
    """The table: every run, the 1-adapter median over rounds and its spread, the others over the
    median base, each run's KV blocks and preemptions; batch 1 from the medians of its alternated
    runs. `verbose`: also printed."""
    print = _print if verbose else (lambda *a, **k: None)  # noqa: A001
    fig = bench.figures
    fair, blocks = like_for_like(fig)
    results["kv_blocks"], results["like_for_like"] = blocks, fair
    results["preemptions"] = {label: [r.get("preemptions") for r in runs] for label, runs in fig.items()}
    lines = ["| run | runs (out tok/s) | median | x base (median) | per round | spread | KV blocks / preemptions "
             "per run | goal | |", "|---|---|---|---|---|---|---|---|---|"]
    base_runs = tok_s(fig.get("base", []))
    base = median(base_runs)
    if base_runs:
        lines.append(f"| base ({num} x {inp} x {out}) | {', '.join(f'{v:.0f}' for v in base_runs)} | {base:.1f} | 1 | "
                     f"| {100 * (max(base_runs) - min(base_runs)) / base:.1f}% | {kv_of(fig['base'])} | | |")
        print(f"  base: runs {', '.join(f'{v:.0f}' for v in base_runs)}; median {base:.0f} out tok/s; "
              f"KV blocks / preemptions {kv_of(fig['base'])}")
    for count in counts:
        label = f"lora_{count}_adapters"
        runs = tok_s(fig.get(label, []))
        if not runs or not base_runs:
            continue
        goal = goals.get(count, 0.8)
        if count == counts[0]:  # paired with the base run of its round
            rounds = [v / b for v, b in zip(runs, base_runs)]
            ratio = median(rounds)
            spread = max(rounds) - min(rounds)
            per_round = ", ".join(f"{r:.3f}" for r in rounds)
            results[f"ratio_{count}_adapters_rounds"] = rounds
        else:
            ratio = median(runs) / base
            spread, per_round = float("nan"), ""
        results[f"ratio_{count}_adapters"] = ratio
        verdict = "met" if ratio >= goal else "MISSED"
        print(f"  {count:3} adapter(s): runs {', '.join(f'{v:.0f}' for v in runs)}; x base {ratio:.3f} "
              f"(goal {goal}) {verdict}; KV blocks / preemptions {kv_of(fig[label])}"
              + (f"; per round {per_round}, spread {spread:.3f}" if per_round else ""))
        lines.append(f"| {count} adapter(s) | {', '.join(f'{v:.0f}' for v in runs)} | {median(runs):.1f} | "
                     f"**{ratio:.3f}** | {per_round} | {'' if spread != spread else f'{spread:.3f}'} | "
                     f"{kv_of(fig[label])} | >= {goal} | {verdict} |")
    inside = tok_s(fig.get("base_in_lora_engine", []))
    paired = tok_s(fig.get("base_paired", []))
    if inside and paired:
        rounds = [v / b for v, b in zip(inside, paired)]
        results["ratio_base_in_lora_engine"] = median(rounds)
        print(f"  base requests in the LoRA engine: {', '.join(f'{v:.0f}' for v in inside)} vs the base engine's "
              f"{', '.join(f'{v:.0f}' for v in paired)} (same prompts' shape, alternated): "
              f"{median(rounds):.3f}x")
        lines.append(f"| base requests, LoRA engine (vs base runs alternated with them: "
                     f"{', '.join(f'{v:.0f}' for v in paired)}) | {', '.join(f'{v:.0f}' for v in inside)} | "
                     f"{median(inside):.1f} | {median(rounds):.3f} | {', '.join(f'{r:.3f}' for r in rounds)} | | "
                     f"{kv_of(fig['base_in_lora_engine'])} | ~1.0 | |")
    b0 = [r["tpot_ms_mean"] for r in fig.get("batch1_base", [])]
    b1 = [r["tpot_ms_mean"] for r in fig.get("batch1_lora", [])]
    if b0 and b1:
        ratio = median(b1) / median(b0)
        results["batch1_tpot_ratio"] = ratio
        verdict = "met" if ratio <= batch1_goal else "MISSED"
        b2 = [r["tpot_ms_mean"] for r in fig.get("batch1_base_in_lora_engine", [])]
        print(f"  batch 1: {median(b0):.2f} ms/token base (runs {', '.join(f'{v:.2f}' for v in b0)}), "
              f"{median(b1):.2f} with an adapter ({', '.join(f'{v:.2f}' for v in b1)}): {ratio:.3f}x "
              f"(goal <= {batch1_goal}) {verdict}; a base request in the LoRA engine {median(b2):.2f}")
        lines.append(f"| batch 1, ms per token: base {', '.join(f'{v:.2f}' for v in b0)}; adapter "
                     f"{', '.join(f'{v:.2f}' for v in b1)}; base request in the LoRA engine "
                     f"{', '.join(f'{v:.2f}' for v in b2)} | | {median(b1):.2f} | **{ratio:.3f}** (TPOT) | | | | "
                     f"<= {batch1_goal} | {verdict} |")
    if blocks:
        kinds = sorted({b for values in blocks.values() for b in values})
        verdict = "like for like" if fair else "NOT like for like"
        lines += ["", f"KV blocks of every run: {', '.join(str(b) for b in kinds)} ({verdict}); preemptions per run "
                      f"in the table (blocks / preemptions)."]
        print(f"  KV blocks of every run: {', '.join(str(b) for b in kinds)} ({verdict})")
    return lines
