"""The order in which each rank issues its point-to-point sends and receives, and whether the
ranks' orders can deadlock.

NCCL does not promise that the kernels of two communicators run side by side: they may run one
after the other, in the order each rank issued them. Then the ranks' orders must agree. Pair
each send with its receive (same sender, receiver and channel, n-th with n-th); draw an edge from
each operation to the next one its rank issued. A cycle through matched pairs is a possible
hang: every pair in it waits for an operation its rank issued before it, whose own pair waits in
turn. Pipeline stages issue activations one way (`act`) and, with device tokens, sampled tokens
the other (`tokens`): `pp_tokens.py` explains the order they keep.

Tests and debugging only: with TOKENMILL_P2P_ORDER_LOG=DIR every rank records its operations
and writes them to DIR/rank<N>.json at shutdown; `find_cycle` reads them back.
"""

from __future__ import annotations

import json
import os

ENV = "TOKENMILL_P2P_ORDER_LOG"

Op = tuple[int, str, str]  # (peer rank, "send" | "recv", channel)


class P2POrderLog:
    def __init__(self, rank: int, directory: str) -> None:
        self.rank, self.directory = rank, directory
        self.ops: list[Op] = []

    @staticmethod
    def from_env(rank: int, environ=os.environ) -> P2POrderLog | None:
        directory = environ.get(ENV)
        return P2POrderLog(rank, directory) if directory else None

    def record(self, peer: int, kind: str, channel: str) -> None:
        self.ops.append((peer, kind, channel))

    def write(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{self.rank}.json"), "w") as f:
            json.dump({"rank": self.rank, "ops": self.ops}, f)


def load(directory: str) -> dict[int, list[Op]]:
    logs = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                data = json.load(f)
            logs[int(data["rank"])] = [tuple(op) for op in data["ops"]]
    return logs


def find_cycle(logs: dict[int, list[Op]]) -> str | None:
    """None when one global order of the matched pairs keeps every rank's own order; else a
    description of a cycle (a hang if the communicators' kernels run serialized), or of an
    operation without its match."""
    # Each operation -> its pair's id: (sender, receiver, channel, n).
    pair_of: dict[tuple[int, int], tuple] = {}
    counts: dict[tuple, int] = {}
    for rank, ops in logs.items():
        for i, (peer, kind, channel) in enumerate(ops):
            sender, receiver = (rank, peer) if kind == "send" else (peer, rank)
            key = (sender, receiver, channel, kind)
            n = counts.get(key, 0)
            counts[key] = n + 1
            pair_of[(rank, i)] = (sender, receiver, channel, n)
    for (sender, receiver, channel, kind), n in counts.items():
        other = counts.get((sender, receiver, channel, "recv" if kind == "send" else "send"), 0)
        if other != n:
            return f"{n} {kind}s {sender}->{receiver} on {channel!r} but {other} matches"
    edges: dict[tuple, set] = {}
    for rank, ops in logs.items():
        for i in range(1, len(ops)):
            a, b = pair_of[(rank, i - 1)], pair_of[(rank, i)]
            if a != b:
                edges.setdefault(a, set()).add((b, rank))
    # Depth-first search for a cycle (iterative: logs run to thousands of operations).
    state: dict[tuple, int] = {}  # 1: on the stack, 2: done
    for root in list(edges):
        if state.get(root):
            continue
        stack = [(root, iter(edges.get(root, ())))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            for child, rank in children:
                if state.get(child) == 1:
                    cycle = path[path.index(child):] + [child]
                    return "cycle: " + " -> ".join(f"{c}:{s}->{r}#{n}" for s, r, c, n in cycle)
                if not state.get(child):
                    state[child] = 1
                    stack.append((child, iter(edges.get(child, ()))))
                    path.append(child)
                    break
            else:
                state[node] = 2
                stack.pop()
                path.pop()
    return None
