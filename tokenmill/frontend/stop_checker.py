"""Stop-string matching on detokenized text, and how much of the text is safe to stream.

Text only ever grows at its end. After each delta, only the tail window that could
contain a stop string touching the new characters is searched
(new_chars + len(stop) - 1). Among the stop strings that match, the one starting
earliest wins (ties: the first listed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    keep: int  # the text is truncated to text[:keep]


class StopChecker:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """`stop`: non-empty strings (`SamplingParams.validate` checks them; an empty one would
        match everywhere)."""
        self.stop = tuple(stop)
        self.include = include_stop_str_in_output

    def find(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The stop string that the last `num_new_chars` characters of `text` completed, if any."""
        if num_new_chars <= 0:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(len(text) - num_new_chars - len(stop) + 1, 0)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        return StopMatch(stop, index + len(stop) if self.include else index)

    def safe_length(self, text: str) -> int:
        """How much of `text` may be shown while generation goes on.

        Without the stop string in the output, a tail that is a proper prefix of a stop
        string is held back: it would be cut if the stop string completes. Invariant:
        text shown is never past a later match's cut point.
        """
        if self.include:
            return len(text)
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return len(text) - held
