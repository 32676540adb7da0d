"""`tokenmill bench spec`: speculative decoding against none, side by side in one run.

The workload is copy-heavy, where speculation pays: chat prompts asking the model to repeat or
lightly edit a passage of a few hundred tokens. Both engines (the same engine arguments, one with
`--speculative-config`) are warmed on other passages first, then run the same requests
`--concurrency` at a time (1: one request after another, the latency case). Prints output tokens/s
of both, the speedup, mean acceptance length (tokens per verified step of a request with drafts)
and acceptance per draft position, and a JSON record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from tqdm import tqdm

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.config import add_engine_flags, engine_args_from_flags
from tokenmill.metrics.spec_decode import from_scheduler_stats, since, spec_figures

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


def run(ns) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    spec_args = engine_args_from_flags(ns, ns.model)
    if spec_args.speculative_config is None:
        raise SystemExit("bench spec: give --speculative-config")
    plain_args = dataclasses.replace(spec_args, speculative_config=None)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len)
    record = {"benchmark": "spec", "workload": {"model": ns.model, "num_prompts": ns.num_prompts,
                                                "concurrency": ns.concurrency, "output_len": ns.output_len,
                                                "repeat_passage": ns.repeat_passage, "sampling": "greedy"},
              "engine_args": dataclasses.asdict(spec_args), "machine": machine_info(), "versions": versions()}
    outputs = {}
    for name, args in (("plain", plain_args), ("speculative", spec_args)):
        with LLM(**dataclasses.asdict(args)) as llm:
            tokenizer = llm.get_tokenizer()
            prompts = copy_prompts(tokenizer, ns.num_prompts, ns.repeat_passage)
            _generate(llm, copy_prompts(tokenizer, min(ns.num_prompts, 2), ns.repeat_passage, offset=1), params,
                      ns.concurrency, f"{name} warm-up")
            before = llm.scheduler_stats()
            llm.reset_telemetry()
            start = time.perf_counter()
            outs = _generate(llm, prompts, params, ns.concurrency, name)
            elapsed = time.perf_counter() - start
            after = llm.scheduler_stats()
            phases = _phases(llm.telemetry())
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        num_out = sum(len(t) for t in outputs[name])
        figures = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed,
                   "prompt_tokens_mean": sum(len(o.prompt_token_ids) for o in outs) / len(outs)}
        figures.update(spec_figures(since(from_scheduler_stats(before), from_scheduler_stats(after))))
        figures["phases_us"] = phases
        record[name] = figures
    record["speedup"] = record["speculative"]["output_tokens_per_s"] / record["plain"]["output_tokens_per_s"]
    record["outputs_identical"] = outputs["plain"] == outputs["speculative"]
    _print(record)
    print(json.dumps(record))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


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
    print(f"speedup {record['speedup']:.2f}x; acceptance per draft position: {per}; "
          f"outputs identical: {record['outputs_identical']}")
