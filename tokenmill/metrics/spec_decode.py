"""Speculative decoding figures: the one place that derives them from the raw counters.

The counters (`SpecDecodeStats`) come from the scheduler (`scheduler_stats()`), the telemetry
report (since its last reset) or a server's /metrics; every printout and record (bench spec,
throughput and serve, `LLM.telemetry()` readers) goes through `spec_figures`:
  acceptance_rate         accepted / draft tokens
  mean_acceptance_length  1 + accepted / drafts: tokens a request emits per verified step with
                          drafts (its accepted drafts plus the one token the target adds)
  acceptance_per_position accepted (j+1)-th drafts / drafts (vLLM's per-position rate)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.protocol import SpecDecodeStats


def from_scheduler_stats(stats: Mapping[str, Any]) -> SpecDecodeStats:
    """The counters in `LLM.scheduler_stats()`'s dict (or a SchedulerStats' fields)."""
    return SpecDecodeStats(stats["spec_num_drafts"], stats["spec_num_draft_tokens"],
                           stats["spec_num_accepted_tokens"], list(stats["spec_accepted_per_position"]))


def since(before: SpecDecodeStats, after: SpecDecodeStats) -> SpecDecodeStats:
    """What was counted between two snapshots of the same engine."""
    earlier = before.accepted_per_position
    per_position = [a - (earlier[j] if j < len(earlier) else 0) for j, a in enumerate(after.accepted_per_position)]
    return SpecDecodeStats(after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                           after.num_accepted_tokens - before.num_accepted_tokens, per_position)


def spec_figures(c: SpecDecodeStats) -> dict:
    """The raw counts and the derived figures, as a JSON record's fields."""
    drafts, tokens, accepted = c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens
    return {"num_drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "accepted_per_position": list(c.accepted_per_position),
            "acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_per_position": [a / drafts if drafts else 0.0 for a in c.accepted_per_position]}


def format_spec_figures(f: dict) -> str:
    """The "== speculative decoding ==" block of the bench printouts."""
    per = ", ".join(f"{a:.2f}" for a in f["acceptance_per_position"])
    return "\n".join([
        "== speculative decoding ==",
        f"  drafts (verified steps)  {f['num_drafts']}",
        f"  draft tokens             {f['draft_tokens']}",
        f"  accepted tokens          {f['accepted_tokens']}",
        f"  acceptance rate          {f['acceptance_rate']:.1%}",
        f"  mean acceptance length   {f['mean_acceptance_length']:.2f}",
        f"  acceptance per position  {per}"])
