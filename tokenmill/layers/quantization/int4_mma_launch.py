"""Launches of the INT4 tensor-core GEMV (`triton_int4_mma`): the `MmaGemv` record (warps, split-K,
groups a step and the loop's options), its text labels (`MmaGemv.label` / `parse_label`: benchmarks
and TOKENMILL_INT4_MMA_TABLE), the measured per-shape TABLE, the default rule for other shapes, and
which launches a weight's shape and group admit (`layout_fits`, `fits`). The process-wide switch of
the pipelined loop and the lookup that applies it (`config_for`) stay with the kernel.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MmaGemv:
    """A launch: WARPS channel blocks (16 outputs each) per CTA, SPLIT slices of K (whole groups;
    a power of two dividing them), GPC groups per loop step."""

    warps: int = 4
    split: int = 1
    gpc: int = 1
    early: bool = True  # every load issued before the arithmetic (`_asm`)
    zmma: bool = False  # zero points through a second mma per word (`_asm`)
    hint: bool = False  # weight loads past L1, 256-byte L2 fetches (`_asm`)
    pdl: bool = True  # programmatic dependent launch where the device has it (`triton_ops.pdl`)
    pre: bool = True  # under PDL, the first loop step's weight words loaded before the wait
    ahead: int = 0  # loop steps ahead whose words each step prefetches (0: none; `_asm`)
    ahead_l1: bool = False  # the prefetch into L1, not L2
    ring: int = 0  # K steps of words in flight through shared memory (cp.async; 0: loads to registers)
    maxnreg: int = 0  # registers a thread at most (ptxas `.maxnreg`; 0: its choice): more CTAs resident an SM
    pipe: bool = False  # each loop step loads the next one's words and scales under its arithmetic (`_pipe_asm`)

    def label(self) -> str:
        return (f"mma w{self.warps} s{self.split} g{self.gpc}{'' if self.early else ' late'}"
                f"{' zmma' if self.zmma else ''}{' hint' if self.hint else ''}"
                f"{f' a{self.ahead}' + ('l1' if self.ahead_l1 else '') if self.ahead else ''}"
                f"{f' r{self.ring}' if self.ring else ''}{f' m{self.maxnreg}' if self.maxnreg else ''}"
                f"{' pipe' if self.pipe else ''}"
                f"{'' if self.pdl else ' nopdl'}{'' if self.pre or not self.pdl else ' nopre'}")


# (N, K) -> the launch (Llama-8B's linears; other shapes: `default_config`). From
# `gpu_quant.py --parts int4b1` on an H100 (session 7, two rounds): us per norm + GEMV in a graph,
# against the default launch with PDL and without it (docs/results/gpu-int4-batch1.md).
# Session 8 (an H200, three rounds): the pipelined loop for gate_up (22.9-23.1 us against 24.6-24.8
# without; 8 warps 22.9 too) and qkv (9.1-9.2 / 9.6-9.7); it loses on down (17.0-17.7 / 14.2-14.3) and
# o (9.1-9.2 / 7.2-7.3). Session 7's H100 figures (without the loop) in the comments.
TABLE: dict[tuple[int, int], MmaGemv] = {
    (28672, 4096): MmaGemv(4, 2, hint=True, pipe=True),  # gate_up H100 27.2 / 27.1 (default 28.1, without PDL 29.7)
    (4096, 14336): MmaGemv(4, 16, hint=True),  # down 16.4 / 16.3 (17.0, 18.9)
    (6144, 4096): MmaGemv(4, 8, hint=True, pipe=True),  # qkv 10.0 / 9.8 (10.1, 11.7)
    (4096, 4096): MmaGemv(8, 16),  # o 8.0 / 8.0 (8.4, 10.3)
}
TABLE_ENV = "TOKENMILL_INT4_MMA_TABLE"  # "NxK=<label>;..." (labels as `MmaGemv.label` writes them): benchmarks' A/B


def parse_label(label: str) -> MmaGemv:
    """The launch `MmaGemv.label` names ("mma w4 s8 g1 hint nopdl"; the leading "mma" optional)."""
    words = label.split()
    if words and words[0] == "mma":
        words = words[1:]
    flags = {"late": ("early", False), "zmma": ("zmma", True), "hint": ("hint", True), "nopdl": ("pdl", False),
             "nopre": ("pre", False), "pipe": ("pipe", True)}
    try:
        fields = {"warps": int(words[0].removeprefix("w")), "split": int(words[1].removeprefix("s")),
                  "gpc": int(words[2].removeprefix("g"))}
        for w in words[3:]:
            if w.startswith("r") and w[1:].isdigit():
                fields.update(ring=int(w[1:]))
            elif w.startswith("m") and w[1:].isdigit():
                fields.update(maxnreg=int(w[1:]))
            elif w.startswith("a") and w.removesuffix("l1")[1:].isdigit():
                fields.update(ahead=int(w.removesuffix("l1")[1:]), ahead_l1=w.endswith("l1"))
            else:
                fields.update([flags[w]])
    except (IndexError, KeyError, ValueError) as e:
        raise ValueError(f"int4 mma launch label {label!r}: expected 'w<warps> s<split> g<gpc>' then any of "
                         f"{sorted(flags)}") from e
    return MmaGemv(**fields)


@functools.cache
def _env_table(text: str) -> dict[tuple[int, int], MmaGemv]:
    table = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        shape, _, label = item.partition("=")
        n, _, k = shape.partition("x")
        table[(int(n), int(k))] = parse_label(label)
    return table


def table() -> dict[tuple[int, int], MmaGemv]:
    """TABLE, with TOKENMILL_INT4_MMA_TABLE's entries over it (read when a launch is chosen: an
    engine's graphs capture them at start)."""
    text = os.environ.get(TABLE_ENV, "")
    return {**TABLE, **_env_table(text)} if text else TABLE


# Warps per SM the default launch aims at: a memory-bound stream wants many warps in flight (each
# holds 1 KB of loads per step); 52 registers a thread leave room for 9 CTAs of 4 warps per SM,
# so every CTA is resident in one wave.
TARGET_WARPS_PER_SM = 32


def default_config(n: int, k: int, group: int, sms: int = 132) -> MmaGemv:
    """Four warps a CTA; K split (a power of two dividing the groups, at most 16) until there are
    about TARGET_WARPS_PER_SM warps per SM."""
    blocks = n // 16
    groups = k // group
    split = 1
    while blocks * split * 2 <= TARGET_WARPS_PER_SM * sms and groups % (2 * split) == 0 and split < 16:
        split *= 2
    return MmaGemv(warps=4, split=split)


MAX_GROUP = 256  # a loop step unrolls a group's K steps (registers: 12 per 64 inputs)


def layout_fits(n: int, k: int, group: int) -> bool:
    """The mma layout holds a weight of N outputs, K inputs and this group size (64, 128 or 256:
    one group over all of K, GPTQ's -1, stays with the panels)."""
    return n % 16 == 0 and k % 64 == 0 and group % 64 == 0 and group <= MAX_GROUP and k % group == 0


def fits(n: int, k: int, group: int, c: MmaGemv) -> bool:
    groups = k // group
    return (layout_fits(n, k, group) and c.warps in (1, 2, 4, 8) and n % (16 * c.warps) == 0
            and c.split >= 1 and groups % c.split == 0 and (groups // c.split) % c.gpc == 0
            and (not c.ring or (c.ring % (group // 64 * c.gpc) == 0 and c.ring <= groups // c.split * (group // 64)
                                and c.ring * c.warps * 512 <= 48 * 1024 and not c.ahead))
            and (not c.pipe or (group == 128 and c.gpc == 1 and c.early and not (c.zmma or c.ring or c.ahead_l1))))


# The INT4 GEMMs' launch tables (above the GEMV's rows) are keyed by rows bucket, N and K.
GEMM_ROW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


def gemm_row_bucket(m: int) -> int | None:
    """The smallest bucket holding m rows, or None past the last."""
    return next((b for b in GEMM_ROW_BUCKETS if b >= m), None)


def parse_gemm_table(text: str, parse) -> dict[tuple[int, int, int], object]:
    """An override of a GEMM launch table ("256,4096,14336=<label>;..."): {(bucket, N, K): parse(label)}."""
    out: dict[tuple[int, int, int], object] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        key, _, label = item.partition("=")
        bucket, n, k = (int(v) for v in key.split(","))
        out[(bucket, n, k)] = parse(label)
    return out
