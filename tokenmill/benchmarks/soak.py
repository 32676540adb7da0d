"""`tokenmill bench soak`: drive a running server on this machine for a while with a mix of good
and bad requests, then prove that nothing was lost and nothing leaked.

Requests arrive as a Poisson process at `--request-rate` for `--duration` seconds (at most
`--max-requests`, at most `--max-concurrency` in flight: arrivals beyond it wait, and are
counted), over the loopback only. The mix (`--mix`) is described in `soak_requests.py`; the
reconciliation at the end in `soak_checks.py`: every request ended in exactly one state, as its
kind should; token and finish counts match /metrics; the engine holds no request and no KV
block (the server needs --enable-debug-routes); the server's process tree has no extra
process, fd or shared-memory segment. The server must serve nothing else meanwhile.

Prints a table and the checks, writes a JSON record; exits 0 only if every check that could run
passed (one that cannot, for want of a debug route or the server's pid, prints n/a and how to enable it).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from urllib.parse import urlparse

import numpy as np
from tqdm import tqdm

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.benchmarks.soak_checks import (Check, ProcessTree, find_listener, process_tree, reconcile, scrape,
                                              settled_tree, wait_engine_idle)
from tokenmill.benchmarks.soak_requests import KINDS, STATES, Outcome, Workload, choose_kinds, send

_WORDS = ("river mill wheel valley stone bridge harvest market road coast lantern winter morning "
          "orchard barley copper window garden letter candle forest meadow thunder silver").split()
DEFAULT_MIX = "normal=35,stream=25,cancel=10,n=10,overlength=10,malformed=10"
_NUM_PROMPTS = 32


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="drive a local server with good and bad requests for a while; "
                                    "check that nothing was lost or leaked",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback addresses only)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $TOKENMILL_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--request-rate", type=float, default=2.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--max-requests", type=int, default=100_000, help="most requests sent")
    p.add_argument("--max-concurrency", type=int, default=256, help="most requests in flight; arrivals wait beyond")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"kind=weight,... over {', '.join(KINDS)}")
    p.add_argument("--input-len", type=int, default=64, help="words per prompt")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of generating requests")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens (steady load)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds, at the end, for the engine to go idle and closed connections to go")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid, for the process-tree check (default: the process listening on the port)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="write the JSON record here")
    p.set_defaults(func=run)


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in KINDS:
            raise ValueError(f"--mix: unknown kind {name!r} (kinds: {', '.join(KINDS)})")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise ValueError(f"--mix: weight of {name!r} must be a number, got {weight!r}") from None
        if mix[name] < 0:
            raise ValueError(f"--mix: weight of {name!r} must be >= 0")
    if not any(mix.values()):
        raise ValueError("--mix: at least one weight must be > 0")
    return mix


def check_loopback(base_url: str) -> tuple[str, int]:
    """(host, port) of `base_url`; refuses anything but this machine."""
    parsed = urlparse(base_url)
    host = parsed.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback or parsed.scheme != "http":
        raise ValueError(f"--base-url must be http on a loopback address (127.0.0.1, ::1, localhost), got {base_url!r}")
    return host, parsed.port or 80


def check_args(ns) -> dict[str, float]:
    for name in ("request_rate", "duration", "timeout", "settle"):
        value = getattr(ns, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    for name in ("max_requests", "max_concurrency", "input_len", "output_len"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    check_loopback(ns.base_url)
    return parse_mix(ns.mix)


# ---------------------------------------------------------------------------- the run


async def _workload(client, ns, base: str, headers: dict) -> Workload:
    models = (await client.get(base + "/v1/models", headers=headers)).raise_for_status().json()["data"]
    card = models[0] if ns.model is None else next((m for m in models if m["id"] == ns.model), None)
    if card is None:
        raise ValueError(f"--model {ns.model!r}: the server serves {[m['id'] for m in models]}")
    rng = random.Random(ns.seed)
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(ns.input_len)) for _ in range(_NUM_PROMPTS)]
    ids = []
    for prompt in prompts:
        response = await client.post(base + "/tokenize", headers=headers, json={"model": card["id"], "prompt": prompt})
        ids.append(response.raise_for_status().json()["tokens"])
    if max(len(x) for x in ids) + ns.output_len > card["max_model_len"]:
        raise ValueError(f"--input-len {ns.input_len} words plus --output-len {ns.output_len} exceed the "
                         f"server's max_model_len {card['max_model_len']}")
    return Workload(card["id"], card["max_model_len"], ns.output_len, ns.ignore_eos, prompts, ids)


async def _drive(client, ns, base: str, headers: dict, w: Workload, mix: dict[str, float],
                 on_done: Callable[[Outcome], None]) -> tuple[list[Outcome], int, float]:
    """Arrivals for `duration` seconds; (outcomes, arrivals that waited for a free slot, seconds)."""
    rng = random.Random(ns.seed + 1)
    count = min(ns.max_requests, int(ns.request_rate * ns.duration * 2) + 16)
    kinds = choose_kinds(mix, count, rng)
    limit = asyncio.Semaphore(ns.max_concurrency)
    tasks: list[asyncio.Task] = []
    delayed = 0

    async def one(kind: str, seed: int) -> Outcome:
        sent_at = time.monotonic() - start
        try:
            out = await send(client, base, headers, kind, w, random.Random(seed))
        finally:
            limit.release()
        out.sent_at_s = sent_at
        on_done(out)
        return out

    start = time.monotonic()
    due = start
    for kind in kinds:
        due += rng.expovariate(ns.request_rate)
        if due - start > ns.duration:
            break
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        if limit.locked():
            delayed += 1
        await limit.acquire()
        tasks.append(asyncio.ensure_future(one(kind, rng.randrange(1 << 30))))
    outcomes = list(await asyncio.gather(*tasks))
    return outcomes, delayed, time.monotonic() - start


async def soak(ns, mix: dict[str, float]) -> dict:
    import httpx

    base = ns.base_url.rstrip("/")
    _, port = check_loopback(base)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    timeout = httpx.Timeout(ns.timeout, connect=30.0)
    pool = httpx.Limits(max_connections=ns.max_concurrency + 8, max_keepalive_connections=ns.max_concurrency + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
        w = await _workload(client, ns, base, headers)
        warm = [await send(client, base, headers, kind, w, random.Random(i)) for i, kind in enumerate(mix)
                if mix[kind] > 0]  # first use of every path (lazy imports, templates) before the baseline
        await wait_engine_idle(client, base, headers, ns.settle)
    pid = ns.server_pid or find_listener(port)
    tree_before = process_tree(pid) if pid else None
    load_before = os.getloadavg()
    async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
        before = await scrape(client, base, headers)
        expected = min(ns.max_requests, round(ns.request_rate * ns.duration))
        with tqdm(total=expected, desc="soak", unit="req", dynamic_ncols=True) as bar:
            tally = dict.fromkeys(STATES, 0)

            def on_done(out: Outcome) -> None:
                tally[out.state] += 1
                bar.update(1)
                bar.set_postfix(tally, refresh=False)

            outcomes, delayed, elapsed = await _drive(client, ns, base, headers, w, mix, on_done)
        engine = await wait_engine_idle(client, base, headers, ns.settle)
        after = await scrape(client, base, headers)
    tree_after = await settled_tree(pid, tree_before, ns.settle) if tree_before is not None else None
    checks = reconcile(outcomes, before, after, engine, tree_before, tree_after)
    return _record(ns, w, mix, outcomes, delayed, elapsed, checks, tree_before, tree_after,
                   (load_before, os.getloadavg()), warm)


# ---------------------------------------------------------------------------- the record


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    arr = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def _record(ns, w: Workload, mix: dict[str, float], outcomes: list[Outcome], delayed: int, elapsed: float,
            checks: list[Check], tree_before: ProcessTree | None, tree_after: ProcessTree | None,
            load: tuple, warm: list[Outcome]) -> dict:
    by_kind = {k: {s: sum(o.kind == k and o.state == s for o in outcomes) for s in STATES}
               for k in KINDS if mix.get(k, 0) > 0}
    for k, row in by_kind.items():
        row["sent"] = sum(o.kind == k for o in outcomes)
        row["unexpected"] = sum(o.kind == k and not o.expected for o in outcomes)
    completed = [o for o in outcomes if o.state == "completed"]
    problems = sorted({f"{o.kind}: {o.state} ({o.detail})" for o in outcomes if not o.expected or o.state == "lost"})
    return {
        "benchmark": "soak",
        "workload": {"base_url": ns.base_url, "model": w.model, "max_model_len": w.max_model_len,
                     "request_rate": ns.request_rate, "duration_s": ns.duration, "max_requests": ns.max_requests,
                     "max_concurrency": ns.max_concurrency, "mix": mix, "input_len_words": ns.input_len,
                     "output_len": ns.output_len, "ignore_eos": ns.ignore_eos, "seed": ns.seed},
        "machine": machine_info(), "versions": versions(),
        "load_average": {"before": list(load[0]), "after": list(load[1])},
        "sent": len(outcomes), "elapsed_s": elapsed, "arrival_rate": len(outcomes) / ns.duration,
        "delayed_by_concurrency_cap": delayed,
        "states": {s: sum(o.state == s for o in outcomes) for s in STATES},
        "overloaded_503": sum(o.overloaded for o in outcomes),
        "by_kind": by_kind,
        "latency_ms": {"all_completed": _ms([o.latency_s for o in completed]),
                       **{k: _ms([o.latency_s for o in completed if o.kind == k]) for k in ("normal", "stream", "n")},
                       "stream_ttft": _ms([o.ttft_s for o in completed if o.ttft_s is not None])},
        "by_minute": _by_minute(outcomes),
        "output_tokens_completed": sum(o.completion_tokens for o in completed),
        "process_tree": {"before": tree_before.as_dict() if tree_before else None,
                         "after": tree_after.as_dict() if tree_after else None},
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        "problems": problems[:20],
        "warm_up_states": [o.state for o in warm],
        "passed": passed(checks),
    }


def passed(checks: list[Check]) -> bool:
    """Every check that ran passed; one that could not run (ok None: a debug route off, no
    server pid) is reported n/a, not failed."""
    return all(c.ok is not False for c in checks)


def _by_minute(outcomes: list[Outcome]) -> list[dict]:
    """Per minute of arrivals: requests sent, and the latency of those that completed."""
    rows = []
    for minute in range(int(max((o.sent_at_s for o in outcomes), default=0) // 60) + 1):
        sent = [o for o in outcomes if minute * 60 <= o.sent_at_s < (minute + 1) * 60]
        done = [o.latency_s for o in sent if o.state == "completed"]
        rows.append({"minute": minute, "sent": len(sent), "completed": len(done), "latency_ms": _ms(done)})
    return rows


def print_table(record: dict) -> None:
    wl = record["workload"]
    print(f"============ Soak ({wl['request_rate']:g} req/s for {wl['duration_s']:g} s, {wl['model']}) ============")
    head = ["sent", *STATES, "unexpected"]
    print(f"{'kind':<12}" + "".join(f"{h:>11}" for h in head))
    for kind, row in record["by_kind"].items():
        print(f"{kind:<12}" + "".join(f"{row[h]:>11}" for h in head))
    total = {**record["states"], "sent": record["sent"],
             "unexpected": sum(r["unexpected"] for r in record["by_kind"].values())}
    print(f"{'all':<12}" + "".join(f"{total[h]:>11}" for h in head))
    print(f"{'Arrivals per second:':<40}{record['arrival_rate']:>12.2f}")
    print(f"{'Seconds, first arrival to last answer:':<40}{record['elapsed_s']:>12.1f}")
    print(f"{'Arrivals delayed by the concurrency cap:':<40}{record['delayed_by_concurrency_cap']:>12}")
    print(f"{'503 overloaded (with Retry-After):':<40}{record['overloaded_503']:>12}")
    for name, figures in record["latency_ms"].items():
        print(f"{'latency ' + name + ' (ms)':<32}" + "".join(f"{k:>6}: {v:>9.1f}" for k, v in figures.items()))
    print("completed latency p50 / p99 (s) by minute of arrival: " + ", ".join(
        f"{m['latency_ms']['p50'] / 1e3:.1f}/{m['latency_ms']['p99'] / 1e3:.1f}" for m in record["by_minute"]))
    print(f"load average before / after: {record['load_average']['before']} / {record['load_average']['after']}")
    for check in record["checks"]:
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[check["ok"]]
        print(f"[{mark}] {check['name']}: {check['detail']}")
    for problem in record["problems"]:
        print(f"  problem: {problem}")
    unchecked = sum(check["ok"] is None for check in record["checks"])
    print(("PASSED" if record["passed"] else "FAILED")
          + (f" ({unchecked} check(s) n/a: see above how to enable them)" if unchecked else ""))


def run(ns) -> int:
    mix = check_args(ns)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    record = asyncio.run(soak(ns, mix))
    print_table(record)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2, allow_nan=True)
    print(json.dumps(record))
    return 0 if record["passed"] else 1
