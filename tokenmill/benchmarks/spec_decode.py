"""`tokenmill bench spec`: speculative decoding against none, side by side in one run.

The default workload is copy-heavy, where speculation pays: chat prompts asking the model to
repeat or lightly edit a passage of a few hundred tokens (`--dataset random`: random prompts of
`--input-len` tokens instead, the saturation shapes of `bench throughput`). Both engines (the
same engine arguments, one with `--speculative-config`) are alive at once and warmed on other
prompts first; then `--rounds` rounds each time both on the same requests, `--concurrency` at a
time (1: one request after another, the latency case), the order alternating from round to
round so that a drift of the machine falls on both alike. Prints output tokens/s of both (all
rounds pooled, and per round), the speedup, mean acceptance length (tokens per verified step of
a request with drafts) and acceptance per draft position, and a JSON record.

On CUDA the first engine gets half of `--gpu-memory-utilization`, the second the rest (each
engine's KV budget counts the other's memory as used): both get the same KV pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from tqdm import tqdm

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.benchmarks.throughput import make_prompts
from tokenmill.config import add_engine_flags, engine_args_from_flags
from tokenmill.metrics.spec_decode import from_scheduler_stats, since, spec_figures
from tokenmill.protocol import SpecDecodeStats

_PASSAGES = [
    "The printing press spread across Europe within a few decades of its invention. Books became cheaper, "
    "literacy rose, and ideas travelled faster than they ever had. Scientists shared their results, "
    "reformers spread pamphlets, and merchants printed price lists for distant markets.",
    "To bake the bread, mix two cups of flour with a pinch of salt and a spoon of yeast. Add warm water "
    "slowly, knead the dough for ten minutes, then let it rest under a damp cloth for an hour. Shape the "
    "loaf, bake it in a hot oven for forty minutes, and let it cool before slicing.",
    "The river bends twice before it reaches the old mill, where the wheel still turns on spring mornings. "
    "Travellers stop on the bridge to watch the water, talk about the harvest, and argue about the best "
    "road to the coast, while the miller counts the sacks of grain stacked by the door.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be "
    "positive')\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n"
    "        if i >= window:\n            total -= values[i - window]\n        out.append(total / min(i + 1, "
    "window))\n    return out\n",
]
_TASKS = ["Repeat the following text exactly, word for word:\n\n{p}",
          "Rewrite the following text, changing only its first sentence:\n\n{p}",
          "Copy this passage, then say nothing else:\n\n{p}"]


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding vs none on copy-heavy prompts, side by side",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (1: batch 1)")
    p.add_argument("--output-len", type=int, default=192, help="most tokens generated per request")
    p.add_argument("--repeat-passage", type=int, default=2, help="the passage is this many copies long")
    p.add_argument("--dataset", choices=["copy", "random"], default="copy",
                   help="copy-heavy chat prompts, or random token ids of --input-len")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (--dataset random)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    p.add_argument("--rounds", type=int, default=1, help="timed passes of each engine, interleaved")
    p.add_argument("--repeat-prompts", action="store_true",
                   help="--dataset random: the same prompts every round (pair it with --no-enable-prefix-caching); "
                        "copy prompts always repeat")
    p.add_argument("--output-json", default=None)
    add_engine_flags(p)
    p.set_defaults(func=run)


def copy_prompts(tokenizer, num: int, repeat: int, offset: int = 0) -> list[str]:
    prompts = []
    for i in range(num):
        passage = " ".join([_PASSAGES[(i + offset) % len(_PASSAGES)]] * repeat)
        task = _TASKS[(i + offset) % len(_TASKS)].format(p=passage)
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                                     add_generation_prompt=True))
    return prompts


def workload(ns, llm, num: int, offset: int) -> list:
    """`num` prompts of the chosen dataset; another `offset` gives other prompts of the same shape
    (random: other token ids; copy: the passages and tasks in another order)."""
    tokenizer = llm.get_tokenizer()
    if ns.dataset == "copy":
        return copy_prompts(tokenizer, num, ns.repeat_passage, offset=offset)
    ids = make_prompts(tokenizer, "random", num, ns.input_len, llm.config.model.vocab_size, seed=offset)
    return [{"prompt_token_ids": p} for p in ids]


def run(ns) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    spec_args = engine_args_from_flags(ns, ns.model)
    if spec_args.speculative_config is None:
        raise SystemExit("bench spec: give --speculative-config")
    if ns.rounds < 1:
        raise SystemExit(f"bench spec: --rounds must be >= 1, got {ns.rounds}")
    share = spec_args.gpu_memory_utilization
    plain_args = dataclasses.replace(spec_args, speculative_config=None, gpu_memory_utilization=share / 2)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=ns.ignore_eos)
    repeat = ns.dataset == "copy" or ns.repeat_prompts
    record = {"benchmark": "spec", "workload": {"model": ns.model, "num_prompts": ns.num_prompts,
                                                "concurrency": ns.concurrency, "output_len": ns.output_len,
                                                "dataset": ns.dataset, "sampling": "greedy",
                                                "ignore_eos": ns.ignore_eos, "rounds": ns.rounds,
                                                "repeat_prompts": repeat},
              "engine_args": dataclasses.asdict(spec_args), "machine": machine_info(), "versions": versions()}
    record["workload"].update({"repeat_passage": ns.repeat_passage} if ns.dataset == "copy"
                              else {"input_len": ns.input_len})
    names = ("plain", "speculative")
    engines: dict = {}
    try:
        for name, args in zip(names, (plain_args, spec_args)):
            engines[name] = llm = LLM(**dataclasses.asdict(args))
            warm = workload(ns, llm, min(ns.num_prompts, max(ns.concurrency, 2)), offset=1)
            _generate(llm, warm, params, ns.concurrency, f"{name} warm-up")
        passes = {name: [] for name in names}
        outputs = {name: [] for name in names}
        for round_ in range(ns.rounds):
            # Random prompts are new each round unless asked (no prefix-cache hits); copy prompts
            # come from a few passages and repeat anyway.
            prompts = workload(ns, engines["plain"], ns.num_prompts, offset=0 if repeat else 2 + round_)
            for name in (names if round_ % 2 == 0 else names[::-1]):
                figures, tokens = _timed_pass(engines[name], prompts, params, ns.concurrency,
                                              f"{name} ({round_ + 1}/{ns.rounds})")
                passes[name].append(figures)
                outputs[name].append(tokens)
    finally:
        for llm in engines.values():
            llm.shutdown()
    for name in names:
        record[name] = _pooled(passes[name])
    record["speedup"] = record["speculative"]["output_tokens_per_s"] / record["plain"]["output_tokens_per_s"]
    record["speedup_per_round"] = [s["output_tokens_per_s"] / p["output_tokens_per_s"]
                                   for p, s in zip(passes["plain"], passes["speculative"])]
    record["outputs_identical"] = all(p == s for p, s in zip(outputs["plain"], outputs["speculative"]))
    record["requests_differing_per_round"] = [sum(a != b for a, b in zip(p, s))
                                              for p, s in zip(outputs["plain"], outputs["speculative"])]
    if repeat:  # the control: how much plain varies from run to run on the same prompts (batch makeup)
        record["plain_requests_differing_from_round_1"] = [sum(a != b for a, b in zip(p, outputs["plain"][0]))
                                                           for p in outputs["plain"]]
    _print(record)
    print(json.dumps(record))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def _timed_pass(llm, prompts: list, params, concurrency: int, label: str) -> tuple[dict, list]:
    """One timed pass over `prompts`: its figures (speculation counters and step phases of this
    pass alone) and every request's output tokens."""
    before = llm.scheduler_stats()
    llm.reset_telemetry()
    start = time.perf_counter()
    outs = _generate(llm, prompts, params, concurrency, label)
    elapsed = time.perf_counter() - start
    after = llm.scheduler_stats()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    num_out = sum(len(t) for t in tokens)
    figures = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed,
               "prompt_tokens_mean": sum(len(o.prompt_token_ids) for o in outs) / len(outs)}
    figures.update(spec_figures(since(from_scheduler_stats(before), from_scheduler_stats(after))))
    figures["phases_us"] = _phases(llm.telemetry())
    return figures, tokens


def _pooled(passes: list[dict]) -> dict:
    """An engine's passes as one: tokens over time summed, counters summed, the first pass's
    phases; each pass's own figures under "passes"."""
    elapsed = sum(p["elapsed_s"] for p in passes)
    tokens = sum(p["output_tokens"] for p in passes)
    counts = SpecDecodeStats(*(sum(p[key] for p in passes) for key in ("num_drafts", "draft_tokens",
                                                                        "accepted_tokens")),
                             [sum(col) for col in zip(*(p["accepted_per_position"] for p in passes))])
    pooled = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
              "prompt_tokens_mean": passes[0]["prompt_tokens_mean"], **spec_figures(counts),
              "phases_us": passes[0]["phases_us"]}
    if len(passes) > 1:
        pooled["passes"] = [{k: p[k] for k in ("elapsed_s", "output_tokens_per_s", "draft_tokens",
                                                "accepted_tokens")} for p in passes]
    return pooled


def _generate(llm, prompts: list[str], params, concurrency: int, label: str) -> list:
    outs = []
    for i in tqdm(range(0, len(prompts), concurrency), desc=label, unit="batch", dynamic_ncols=True):
        outs += llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
    return outs


def _phases(report) -> dict:
    """Each process's step phases over the timed pass: {role: {phase: [count, mean us, p50 us]}}
    (where a step's time goes: the core's schedule and update, the worker's launch, its device
    time and device idle)."""
    return {p.role: {name: [t.count, round(t.mean_us, 1), round(t.p50_us, 1)] for name, t in p.timings.items()}
            for p in report.processes}


def _print(record: dict) -> None:
    print(f"{'':14}{'out tok/s':>12}{'elapsed s':>11}{'drafts':>8}{'accepted':>10}{'mean acc len':>14}")
    for name in ("plain", "speculative"):
        f = record[name]
        print(f"{name:14}{f['output_tokens_per_s']:>12.1f}{f['elapsed_s']:>11.2f}{f['draft_tokens']:>8}"
              f"{f['accepted_tokens']:>10}{f['mean_acceptance_length']:>14.2f}")
    for name in ("plain", "speculative"):
        shown = [f"{role} {phase} {stats[2]:.0f}" for role, by_phase in record[name]["phases_us"].items()
                 for phase, stats in by_phase.items()
                 if phase in ("schedule", "update", "device_step", "device_idle")]
        if shown:
            print(f"{name} step phases, p50 us: " + ", ".join(shown))
    per = ", ".join(f"{a:.2f}" for a in record["speculative"]["acceptance_per_position"])
    if len(record["speedup_per_round"]) > 1:
        rounds = ", ".join(f"{r:.3f}" for r in record["speedup_per_round"])
        print(f"per round: plain {_per_pass(record['plain'])}; speculative {_per_pass(record['speculative'])} "
              f"out tok/s; speedup {rounds}")
    differing = "" if record["outputs_identical"] else f" (requests differing per round: {record['requests_differing_per_round']})"
    if "plain_requests_differing_from_round_1" in record:
        differing += f"; plain vs its own first round: {record['plain_requests_differing_from_round_1']}"
    print(f"speedup {record['speedup']:.2f}x; acceptance per draft position: {per}; "
          f"outputs identical: {record['outputs_identical']}{differing}")


def _per_pass(figures: dict) -> str:
    return ", ".join(f"{p['output_tokens_per_s']:.1f}" for p in figures["passes"])
