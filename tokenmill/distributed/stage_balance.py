"""Pipeline stage partitions balanced by measured time: pure arithmetic, no torch.

A pipeline runs at the pace of its slowest stage, and every other stage idles by the difference
(its bubble). Stage s's time is the sum of its decoder layers' times, plus the embedding on the
first stage and the final norm, LM head and sampling on the last. `balanced_partition` picks the
contiguous split that minimizes the slowest stage's time (ties: the smallest spread between
stages, then the most even layer counts, extra layers first). The costs come from timing one layer, the embedding
and the head on the device at start (`worker/stage_probe.py`); they are in any one unit.

A workload runs steps of different kinds whose costs differ in shape: a decode micro-batch pays
the LM head on every row, a prompt chunk on its last tokens only. `balanced_for_mix` takes the
costs of each kind with its share of the run and minimizes the sum of their slowest stages (each
kind's steps run at the pace of their own slowest stage; weights are the kinds' step counts, so
the sum is the run's time). Half layers (`distributed/layout.py`): where the probe also timed each layer's attention half
(`StageCosts.attention`), `balanced_halves` splits the model's half layers instead (attention,
MLP, attention, ...), so that a stage boundary may fall after a layer's attention: a decode
micro-batch's LM head costs more than a layer's share and less than two, and half a layer
evens the stages where whole layers cannot. `costs_from_stage_times` turns the
stage times of a run with a known partition (the step trace's medians) back into a layer's and
the head's cost, so that a run measures the split of the next.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    """Measured times (any unit, e.g. ms per decode micro-batch): one per decoder layer, the
    embedding (first stage), the final norm + LM head + sampling (last stage)."""

    layers: tuple[float, ...]
    embedding: float
    head: float
    # Per layer, the part of layers[i] that is its attention half (input norm, q/k/v, attention,
    # o_proj); () where halves were not timed (or the model's layers cannot be split).
    attention: tuple[float, ...] = ()

    def halves(self) -> StageCosts:
        """The same costs over half layers: (attention 0, MLP 0, attention 1, ...)."""
        if len(self.attention) != len(self.layers):
            raise ValueError("StageCosts.halves needs an attention time per layer")
        units = tuple(x for a, whole in zip(self.attention, self.layers) for x in (a, whole - a))
        return StageCosts(layers=units, embedding=self.embedding, head=self.head)

    def stage_times(self, partition: tuple[int, ...]) -> list[float]:
        times, start = [], 0
        for s, count in enumerate(partition):
            t = sum(self.layers[start:start + count])
            t += self.embedding if s == 0 else 0.0
            t += self.head if s == len(partition) - 1 else 0.0
            times.append(t)
            start += count
        return times


def balanced_partition(costs: StageCosts, num_stages: int, min_count: int = 1) -> tuple[int, ...]:
    """Layers per stage (each >= min_count, contiguous, summing to the layers) minimizing the
    slowest stage."""
    n = len(costs.layers)
    if not 1 <= num_stages * min_count <= n:
        raise ValueError(f"pipeline_parallel_size {num_stages} must be between 1 and the model's "
                         f"{n // min_count} layers")
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def time(s: int, a: int, b: int) -> float:  # stage s holding layers [a, b)
        return (prefix[b] - prefix[a] + (costs.embedding if s == 0 else 0.0)
                + (costs.head if s == num_stages - 1 else 0.0))

    # best[s][a]: (slowest, -fastest, sum of squared layer counts, counts) for stages s.. over layers a..
    inf = (float("inf"), 0.0, 0, ())
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[num_stages][n] = (0.0, -float("inf"), 0, ())
    for s in range(num_stages - 1, -1, -1):
        for a in range(n - (num_stages - s) * min_count + 1):
            for b in range(a + min_count, n - (num_stages - s - 1) * min_count + 1):
                rest = best[s + 1][b]
                if rest[0] == float("inf"):
                    continue
                t = time(s, a, b)
                cand = (max(t, rest[0]), max(-t, rest[1]), (b - a) ** 2 + rest[2], (b - a, *rest[3]))
                if _key(cand) < _key(best[s][a]):
                    best[s][a] = cand
    return best[0][0][3]


def balanced_halves(costs: StageCosts, num_stages: int) -> tuple[int, ...]:
    """Half layers per stage (each stage at least one layer's worth: 2), minimizing the slowest
    stage over `costs.halves()`: e.g. (33, 31) for 16.5,15.5 (`layout.split_from_halves`)."""
    return balanced_partition(costs.halves(), num_stages, min_count=2)


def _key(entry: tuple) -> tuple:
    slowest, neg_fastest, squares, counts = entry
    # Rounded so that float summation order does not decide between two splits equal in principle;
    # then the smallest spread, the most even counts, and extra layers on the earlier stages (as
    # `even_partition`: the last stage also runs the head).
    return (round(slowest, 9), round(slowest + neg_fastest, 9), squares, tuple(-c for c in counts))


def explain(costs: StageCosts, partition: tuple[int, ...], unit: str = "ms") -> str:
    """One line for the log: the partition, each stage's time and what an even split would give."""
    from tokenmill.distributed.layout import even_partition

    times = costs.stage_times(partition)
    even = even_partition(len(costs.layers), len(partition))
    even_times = costs.stage_times(even)
    per_layer = sum(costs.layers) / len(costs.layers)
    text = (f"{','.join(map(str, partition))} (stage times {' / '.join(f'{t:.3f}' for t in times)} {unit}; "
            f"a layer {per_layer:.3f}, embedding {costs.embedding:.3f}, norm + LM head + sampling "
            f"{costs.head:.3f}; slowest stage {max(times) / (sum(times) / len(times)):.3f}x the mean")
    if even != partition:
        text += (f"; the even split {','.join(map(str, even))} would give "
                 f"{' / '.join(f'{t:.3f}' for t in even_times)}")
    return text + ")"


def explain_halves(costs: StageCosts, halves: tuple[int, ...], unit: str = "ms") -> str:
    """One line for the log: a half-layer split (`balanced_halves`), its stage times, and the best
    whole-layer split's beside it."""
    times = costs.halves().stage_times(halves)
    whole = balanced_partition(costs, len(halves))
    whole_times = costs.stage_times(whole)
    attention = sum(costs.attention) / len(costs.attention)
    return (f"{','.join(f'{h / 2:g}' for h in halves)} (stage times {' / '.join(f'{t:.3f}' for t in times)} {unit}; "
            f"a layer {sum(costs.layers) / len(costs.layers):.3f} of which attention {attention:.3f}, "
            f"embedding {costs.embedding:.3f}, norm + LM head + sampling {costs.head:.3f}; whole layers "
            f"{','.join(map(str, whole))} would give {' / '.join(f'{t:.3f}' for t in whole_times)})")


_MAX_SPLITS = 200_000  # contiguous splits `balanced_for_mix` enumerates at most


def balanced_for_mix(phases: list[tuple[float, StageCosts]], num_stages: int) -> tuple[int, ...]:
    """Layers per stage minimizing sum(weight * slowest stage time) over the step kinds `phases`
    ((weight: the kind's step count, costs of one step) each, over the same layers); ties as
    `balanced_partition`. One phase is
    `balanced_partition`; more enumerate every contiguous split (ValueError past _MAX_SPLITS)."""
    if len(phases) == 1:
        return balanced_partition(phases[0][1], num_stages)
    n = len(phases[0][1].layers)
    if not 1 <= num_stages <= n or any(len(c.layers) != n for _, c in phases):
        raise ValueError(f"pipeline_parallel_size {num_stages} must be between 1 and the model's {n} layers "
                         f"(the same in every phase)")
    if _count_splits(n, num_stages) > _MAX_SPLITS:
        raise ValueError(f"pipeline_parallel_size {num_stages}: too many splits of {n} layers to weigh phases")
    best_key, best = None, None
    for split in _splits(n, num_stages):
        total = sum(w * max(c.stage_times(split)) for w, c in phases)
        spread = sum(w * (max(t) - min(t)) for w, c in phases for t in [c.stage_times(split)])
        key = (round(total, 9), round(spread, 9), sum(k * k for k in split), tuple(-k for k in split))
        if best_key is None or key < best_key:
            best_key, best = key, split
    return best


def costs_from_stage_times(stage_times: list[float], partition: tuple[int, ...],
                           embedding: float = 0.0) -> StageCosts:
    """A layer's and the head's cost from each stage's measured time under `partition`: a layer
    is the first stages' time per layer (`embedding` taken off the first; the mean over the
    stages before the last), the head is the last stage's time beyond its layers (at least 0)."""
    if len(stage_times) != len(partition) or len(partition) < 2:
        raise ValueError("costs_from_stage_times needs the times and layer counts of two or more stages")
    per_layer = [(t - (embedding if s == 0 else 0.0)) / k
                 for s, (t, k) in enumerate(zip(stage_times[:-1], partition[:-1]))]
    layer = sum(per_layer) / len(per_layer)
    head = max(0.0, stage_times[-1] - partition[-1] * layer)
    return StageCosts(layers=(layer,) * sum(partition), embedding=embedding, head=head)


def _count_splits(n: int, k: int) -> int:
    from math import comb
    return comb(n - 1, k - 1)


def _splits(n: int, k: int):
    """Every composition of n into k positive parts."""
    if k == 1:
        yield (n,)
        return
    for first in range(1, n - k + 2):
        for rest in _splits(n - first, k - 1):
            yield (first, *rest)
