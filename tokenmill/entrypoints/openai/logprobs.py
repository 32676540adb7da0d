"""Engine logprob rows ({token id: Logprob}, the chosen token first) in OpenAI's two shapes."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.outputs import Logprob

_FLOOR = -9999.0  # JSON has no -inf: impossible tokens get this instead (as in vLLM)


def _value(lp: float) -> float:
    return lp if math.isfinite(lp) else _FLOOR


def _token(entry: Logprob) -> str:
    return entry.decoded_token or ""


def _top(row: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((e for e in row.values() if e.rank is not None and e.rank <= k), key=lambda e: e.rank)


def completion_logprobs(rows: list[dict[int, Logprob] | None], k: int, offset: int = 0) -> dict[str, Any]:
    """Legacy completions: tokens, token_logprobs, top_logprobs (the chosen token and the top k,
    as vLLM returns them) and text_offset, counting characters from `offset`. A None row
    (no logprob) shows as an empty token."""
    tokens, values, tops, offsets = [], [], [], []
    for row in rows:
        chosen = next(iter(row.values())) if row else None
        text = _token(chosen) if chosen is not None else ""
        tokens.append(text)
        values.append(_value(chosen.logprob) if chosen is not None else None)
        if chosen is None:
            tops.append(None)
        else:
            top = {_token(chosen): _value(chosen.logprob)}
            for e in _top(row, k):
                top.setdefault(_token(e), _value(e.logprob))
            tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(rows: list[dict[int, Logprob]], k: int) -> list[dict[str, Any]]:
    """Chat completions: one entry per generated token, with its `top_logprobs` (k of them)."""
    content = []
    for row in rows:
        chosen = next(iter(row.values()))
        content.append({**_entry(chosen), "top_logprobs": [_entry(e) for e in _top(row, k)]})
    return content


def _entry(e: Logprob) -> dict[str, Any]:
    text = _token(e)
    return {"token": text, "logprob": _value(e.logprob), "bytes": list(text.encode("utf-8"))}
