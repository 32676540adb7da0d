"""The soak's request mix: what each kind sends, what it must get back, and how one exchange ends.

Kinds (weights chosen on the command line):
  normal      non-streaming completion                            -> completed
  stream      streaming chat completion with a usage chunk        -> completed
  cancel      streaming completion the client closes midway       -> cancelled
  n           non-streaming completion with n=3 seeded samples    -> completed
  overlength  prompt past max_model_len, or max_tokens past it    -> rejected (400 context_length_exceeded)
  malformed   broken JSON, wrong types, unknown model, bad values -> rejected (4xx)

Every exchange ends in exactly one terminal state: completed, cancelled, rejected (4xx),
failed (5xx, or a stream's error event) or lost (anything else: a transport error, a stream
that closes without [DONE], a second terminal event, a missing finish reason). A 503
"overloaded" answer must carry Retry-After. `expected` is what a healthy server answers.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

KINDS = ("normal", "stream", "cancel", "n", "overlength", "malformed")
EXPECTED = {"normal": "completed", "stream": "completed", "cancel": "cancelled", "n": "completed",
            "overlength": "rejected", "malformed": "rejected"}
STATES = ("completed", "cancelled", "rejected", "failed", "lost")
CANCEL_AFTER_EVENTS = 2  # a cancelled stream is closed after this many data events
N_SAMPLES = 3


@dataclass
class Workload:
    """What every request is built from (set up once, from the server's answers)."""

    model: str
    max_model_len: int
    output_len: int
    ignore_eos: bool
    prompts: list[str]  # random-word prompts
    prompt_ids: list[list[int]]  # the same prompts, tokenized by the server


@dataclass
class Outcome:
    kind: str
    state: str = "lost"
    status: int = 0
    detail: str = ""  # why it was lost or failed; an error code
    latency_s: float = 0.0
    ttft_s: float | None = None
    prompt_tokens: int | None = None  # known when the engine saw the request (usage, or token ids sent)
    completion_tokens: int = 0  # from usage when completed; tokens seen when cancelled
    max_completion_tokens: int = 0  # the most the engine may have generated for it
    finished_choices: int = 0
    overloaded: bool = False
    sent_at_s: float = 0.0  # since the first arrival

    @property
    def expected(self) -> bool:
        return self.state == EXPECTED[self.kind] or self.overloaded


@dataclass
class SSEReader:
    """Checks that a stream ends exactly once: data events, at most one error event right before
    the one [DONE], nothing after it, and one finish reason per choice."""

    events: int = 0
    done: int = 0
    errors: list[dict] = field(default_factory=list)
    after_done: int = 0
    finishes: dict[int, int] = field(default_factory=dict)
    usage: dict | None = None
    text_events: int = 0

    def feed(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        data = line[6:]
        if self.done:
            self.after_done += 1
            return
        if data == "[DONE]":
            self.done += 1
            return
        self.events += 1
        chunk = json.loads(data)
        if "error" in chunk:
            self.errors.append(chunk["error"])
            return
        if self.errors:
            self.after_done += 1  # news after an error event
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                self.finishes[choice["index"]] = self.finishes.get(choice["index"], 0) + 1
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                self.text_events += 1

    def verdict(self, num_choices: int) -> tuple[str, str]:
        """(state, detail) of a stream read to its end."""
        if self.done != 1 or self.after_done:
            return "lost", f"stream ended with {self.done} [DONE] and {self.after_done} events after its end"
        if self.errors:
            if len(self.errors) > 1:
                return "lost", "several error events"
            return "failed", str(self.errors[0].get("code"))
        if sorted(self.finishes) != list(range(num_choices)) or any(v != 1 for v in self.finishes.values()):
            return "lost", f"finish reasons per choice: {self.finishes}"
        return "completed", ""


def choose_kinds(weights: dict[str, float], count: int, rng: random.Random) -> list[str]:
    names = [k for k in KINDS if weights.get(k, 0) > 0]
    return rng.choices(names, [weights[k] for k in names], k=count)


def build(kind: str, w: Workload, rng: random.Random) -> tuple[str, dict | bytes, int, int]:
    """(path, JSON body or raw bytes, choices, max tokens) of one request of `kind`."""
    i = rng.randrange(len(w.prompts))
    common = {"model": w.model, "max_tokens": w.output_len, "temperature": 0.0}
    if w.ignore_eos:
        common["ignore_eos"] = True
    if kind == "normal":
        return "/v1/completions", {**common, "prompt": w.prompts[i]}, 1, w.output_len
    if kind == "stream":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": w.prompts[i]}],
                                        "stream": True, "stream_options": {"include_usage": True}}, 1, w.output_len
    if kind == "cancel":
        body = {**common, "prompt": w.prompt_ids[i], "stream": True, "ignore_eos": True,
                "max_tokens": max(w.output_len, 4 * CANCEL_AFTER_EVENTS)}
        return "/v1/completions", body, 1, body["max_tokens"]
    if kind == "n":
        body = {**common, "prompt": w.prompts[i], "n": N_SAMPLES, "temperature": 0.8, "seed": rng.randrange(1 << 30)}
        return "/v1/completions", body, N_SAMPLES, N_SAMPLES * w.output_len
    if kind == "overlength":
        if rng.random() < 0.5:  # a prompt the context cannot hold
            reps = w.max_model_len // max(len(w.prompt_ids[i]), 1) + 1
            return "/v1/completions", {**common, "prompt": w.prompt_ids[i] * reps, "max_tokens": 1}, 1, 0
        return "/v1/completions", {**common, "prompt": w.prompts[i], "max_tokens": w.max_model_len}, 1, 0
    return _malformed(w, rng)


def _malformed(w: Workload, rng: random.Random) -> tuple[str, dict | bytes, int, int]:
    cases: list[tuple[str, dict | bytes]] = [
        ("/v1/completions", b'{"prompt": "hi", '),
        ("/v1/completions", {"model": w.model, "prompt": "hi", "max_tokens": "many"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": w.model, "messages": []}),
        ("/v1/completions", {"model": w.model, "prompt": "hi", "temperature": -1}),
        ("/v1/completions", {"model": w.model, "prompt": "hi", "n": 1 << 20}),
        ("/v1/completions", {"model": w.model, "prompt": [1 << 30]}),
    ]
    path, body = rng.choice(cases)
    return path, body, 1, 0


async def send(client, base_url: str, headers: dict, kind: str, w: Workload, rng: random.Random) -> Outcome:
    """One exchange, read to its end (or closed midway for `cancel`)."""
    path, body, choices, max_tokens = build(kind, w, rng)
    out = Outcome(kind, max_completion_tokens=max_tokens)
    start = time.perf_counter()
    stream = isinstance(body, dict) and body.get("stream", False)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        async with client.stream("POST", base_url + path, content=content,
                                 headers={**headers, "content-type": "application/json"}) as response:
            out.status = response.status_code
            if response.status_code != 200:
                _refused(out, response, await response.aread())
            elif stream:
                await _read_stream(out, response, kind, choices, body)
            else:
                _read_whole(out, await response.aread(), choices)
    except Exception as exc:  # noqa: BLE001 - a lost request: the report names it
        out.state, out.detail = "lost", f"{type(exc).__name__}: {exc}"[:200]
    out.latency_s = time.perf_counter() - start
    return out


def _refused(out: Outcome, response, raw: bytes) -> None:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        out.state, out.detail = "lost", f"HTTP {out.status} without an error body"
        return
    out.detail = str(error.get("code"))
    if 400 <= out.status < 500:
        out.state = "rejected"
    elif out.status >= 500:
        out.state = "failed"
        if out.status == 503 and error.get("code") == "overloaded":
            out.overloaded = True
            if "retry-after" not in response.headers:
                out.state, out.detail = "lost", "503 overloaded without Retry-After"
    else:
        out.state, out.detail = "lost", f"unexpected HTTP {out.status}"


async def _read_stream(out: Outcome, response, kind: str, choices: int, body: dict) -> None:
    reader = SSEReader()
    start = time.perf_counter()
    async for line in response.aiter_lines():
        reader.feed(line)
        if reader.text_events and out.ttft_s is None:
            out.ttft_s = time.perf_counter() - start
        if kind == "cancel" and reader.events >= CANCEL_AFTER_EVENTS and not reader.done and not reader.errors:
            out.state = "cancelled"
            out.prompt_tokens = len(body["prompt"])
            out.completion_tokens = reader.events  # each event holds at least one new token
            return  # leaving the block closes the connection midway
    out.state, detail = reader.verdict(choices)
    out.detail = detail
    if out.state == "completed" and reader.usage:
        out.prompt_tokens = reader.usage["prompt_tokens"]
        out.completion_tokens = reader.usage["completion_tokens"]
        out.finished_choices = choices
    elif out.state == "completed":
        out.state, out.detail = "lost", "no usage chunk"


def _read_whole(out: Outcome, raw: bytes, choices: int) -> None:
    try:
        data = json.loads(raw)
        reasons = [c["finish_reason"] for c in data["choices"]]
        usage = data["usage"]
    except (ValueError, KeyError, TypeError):
        out.state, out.detail = "lost", "a 200 answer that is not a whole completion"
        return
    if len(reasons) != choices or not all(reasons):
        out.state, out.detail = "lost", f"finish reasons {reasons}"
        return
    out.state = "completed"
    out.prompt_tokens = usage["prompt_tokens"]
    out.completion_tokens = usage["completion_tokens"]
    out.finished_choices = choices
