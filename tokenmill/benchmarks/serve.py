"""`tokenmill bench serve`: load an OpenAI-compatible server and report its latencies.

Requests arrive as a Poisson process at each `--request-rate` (or all at once, `inf`),
optionally capped at `--max-concurrency` in flight; each streams its completion so
time to first token (TTFT), time per output token (TPOT) and inter-token latency (ITL)
can be measured. Prints a table per rate, writes a JSON record (machine, versions), and,
with several rates and matplotlib installed, a PNG of latency percentiles against rate.

A server that speculates exports its speculation counters on /metrics: each rate's figures
(acceptance rate, mean acceptance length, per position) come from the counters' difference
across that rate's run, so other clients of the same server would count in them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.entrypoints.openai.metrics import SPEC_ACCEPTED, SPEC_ACCEPTED_PER_POS, SPEC_DRAFT_TOKENS, SPEC_DRAFTS
from tokenmill.metrics.spec_decode import format_spec_figures, since, spec_figures
from tokenmill.protocol import SpecDecodeStats

_WORDS = ("river mill wheel valley stone bridge harvest market road coast lantern winter morning "
          "orchard barley copper window garden letter candle forest meadow thunder silver").split()
PERCENTILES = (50, 90, 99)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="latency and throughput of an OpenAI-compatible server under load",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $TOKENMILL_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument("--dataset", choices=["random", "file"], default="random",
                   help="random words, or one prompt per line of --prompts-file")
    p.add_argument("--prompts-file", default=None, help="text file, one prompt per line")
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM field)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second (Poisson arrivals); inf sends all at once; several values run in turn")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--structured", choices=["none", "json", "choice", "regex"], default="none",
                   help="constrain every request (structured outputs): json = a small JSON schema through "
                        "response_format (chat) or structured_outputs (completions), choice, regex")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", default=None, help="write the JSON record here")
    p.add_argument("--plot", default=None, help="write a PNG of latency percentiles against request rate here")
    p.set_defaults(func=run)


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def make_prompts(ns) -> list[str]:
    rng = random.Random(ns.seed)
    if ns.dataset == "file":
        if not ns.prompts_file:
            raise ValueError("--dataset file needs --prompts-file")
        with open(ns.prompts_file, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
        if not lines:
            raise ValueError(f"--prompts-file {ns.prompts_file!r} holds no prompts")
        return [lines[i % len(lines)] for i in range(ns.num_prompts)]
    return [" ".join(rng.choice(_WORDS) for _ in range(ns.input_len)) for _ in range(ns.num_prompts)]


def arrival_delays(n: int, rate: float, rng: random.Random) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (a Poisson process), 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


def request_body(ns, model: str, prompt: str) -> dict:
    body: dict = {"model": model, "max_tokens": ns.output_len, "stream": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}}
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    constraint = STRUCTURED.get(getattr(ns, "structured", "none"))
    if constraint is not None:
        if ns.endpoint == "/v1/chat/completions" and "json" in constraint:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": constraint["json"]}}
        else:
            body["structured_outputs"] = constraint
    return body


# The structured workloads of --structured: every request constrained the same way.
STRUCTURED = {
    "json": {"json": {"type": "object", "properties": {
        "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["title", "tags", "rating"]}},
    "choice": {"choice": ["positive", "negative", "neutral"]},
    "regex": {"regex": r"[A-Z][a-z]{2,12}( [a-z]{2,12}){0,20}\."},
}


def _chunk_text(chunk: dict) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def send_one(client, url: str, headers: dict, body: dict) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))[:200]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.latency = time.perf_counter() - start
    if not result.output_tokens:
        result.output_tokens = chunks
    return result


async def run_rate(ns, model: str, prompts: list[str], rate: float) -> tuple[list[RequestResult], float]:
    import httpx

    rng = random.Random(ns.seed)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limit = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
    url = ns.base_url.rstrip("/") + ns.endpoint
    pool = httpx.Limits(max_connections=ns.max_concurrency or len(prompts) or 1)

    async def limited(client, prompt: str) -> RequestResult:
        if limit is None:
            return await send_one(client, url, headers, request_body(ns, model, prompt))
        async with limit:
            return await send_one(client, url, headers, request_body(ns, model, prompt))

    async with httpx.AsyncClient(timeout=ns.timeout, limits=pool) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, delay in zip(prompts, arrival_delays(len(prompts), rate, rng)):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(limited(client, prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    duration = max(duration, 1e-9)
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "total_output_tokens": out_tokens, "total_input_tokens": in_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for r in done for x in r.itl]),
        "e2el_ms": _stats_ms([r.latency for r in done]),
    }


def print_table(rate: float, s: dict) -> None:
    print(f"============ Serving benchmark (request rate {rate:g}/s) ============")
    print(f"{'Successful requests:':<40}{s['completed']:>12}")
    print(f"{'Failed requests:':<40}{s['failed']:>12}")
    print(f"{'Benchmark duration (s):':<40}{s['duration_s']:>12.2f}")
    print(f"{'Request throughput (req/s):':<40}{s['request_throughput']:>12.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{s['output_token_throughput']:>12.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>12.2f}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        figures = s[key]
        print(f"{name + ' (ms)':<16}" + "".join(f"{k:>6}: {v:>9.2f}" for k, v in figures.items()))
    for error in s["errors"]:
        print(f"  error: {error}")


def plot(records: list[dict], path: str) -> bool:
    """Latency percentiles against request rate; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    finite = [r for r in records if math.isfinite(r["request_rate"])]
    if len(finite) < 2:
        return False
    rates = [r["request_rate"] for r in finite]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "ITL")):
        for p in PERCENTILES:
            ax.plot(rates, [r[key][f"p{p}"] for r in finite], marker="o", label=f"p{p}")
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_spec_counters(text: str) -> SpecDecodeStats | None:
    """The speculation counters in a /metrics text; None when the server does not speculate."""
    from prometheus_client.parser import text_string_to_metric_families
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == SPEC_ACCEPTED_PER_POS:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            else:
                totals[family.name] = totals.get(family.name, 0.0) + sample.value
    if SPEC_DRAFTS not in totals:
        return None
    return SpecDecodeStats(int(totals[SPEC_DRAFTS]), int(totals.get(SPEC_DRAFT_TOKENS, 0)),
                           int(totals.get(SPEC_ACCEPTED, 0)),
                           [int(per_position.get(j, 0)) for j in range(max(per_position, default=-1) + 1)])


async def scrape_spec_counters(ns) -> SpecDecodeStats | None:
    """The server's speculation counters; None without speculation or when /metrics cannot be read."""
    import httpx
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(ns.base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return parse_spec_counters(response.text) if response.status_code == 200 else None


async def _first_model(ns) -> str:
    import httpx
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(ns.base_url.rstrip("/") + "/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def run(ns) -> int:
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if any(not r > 0 for r in ns.request_rate):
        raise ValueError("--request-rate values must be > 0 (inf for all at once)")
    model = ns.model or asyncio.run(_first_model(ns))
    prompts = make_prompts(ns)
    runs = []
    for rate in ns.request_rate:
        before = asyncio.run(scrape_spec_counters(ns))
        results, duration = asyncio.run(run_rate(ns, model, prompts, rate))
        figures = summarize(results, duration)
        after = asyncio.run(scrape_spec_counters(ns)) if before is not None else None
        print_table(rate, figures)
        if after is not None:
            figures["speculative_decoding"] = spec_figures(since(before, after))
            print(format_spec_figures(figures["speculative_decoding"]))
        runs.append({"request_rate": rate, **figures})
    record = {
        "benchmark": "serve",
        "workload": {"base_url": ns.base_url, "endpoint": ns.endpoint, "model": model,
                     "num_prompts": ns.num_prompts, "dataset": ns.dataset, "input_len": ns.input_len,
                     "output_len": ns.output_len, "ignore_eos": ns.ignore_eos,
                     "max_concurrency": ns.max_concurrency, "seed": ns.seed},
        "machine": machine_info(), "versions": versions(),
        "runs": [{**r, "request_rate": r["request_rate"] if math.isfinite(r["request_rate"]) else "inf"}
                 for r in runs],
    }
    if ns.plot:
        if plot(runs, ns.plot):
            print(f"plot written to {ns.plot}")
        else:
            print("no plot: it needs matplotlib and at least two finite request rates")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2, allow_nan=True)
    print(json.dumps(record))
    return 0
