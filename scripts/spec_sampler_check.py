"""The speculative-decoding sampler on one device: times one step's sampling work for R requests
with K drafts each over V tokens (bfloat16 logits), checks that none of it syncs with the host, and
measures the memory each part allocates. Prints a table and writes a JSON record.

    python scripts/spec_sampler_check.py                    # R=256, K=4, V=49152, on CUDA
    python scripts/spec_sampler_check.py --device cpu --rows 8 --vocab 512 --iters 2   # a smoke run

Parts, per request mix (all greedy; all random top-k/top-p; mixed greedy/unseeded/seeded/min_tokens):
  plain_sample       Sampler.sample over R rows: a step without speculation, for scale
  sample_offsets     Sampler.sample over the T = R * (K + 1) flat rows at offsets 0..K
  verify_one_hot     given sample_offsets' tokens: flat -> padded, verify_drafts, advance
                     (n-gram drafts, greedy rows)
  target_probs       Sampler.probs over the T flat rows (the draft-model rule's p)
  draft_draw         one proposal position of the draft model: probs + draw over R rows
  rejection_sample   rejection_sample with flat p [T, V] and padded q [R, K, V]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.layers.sampling import Sampler, SamplingState  # noqa: E402
from tokenmill.layers.sampling.seeded_noise import NoiseStream  # noqa: E402
from tokenmill.layers.sampling.spec_layout import flat_rows, flat_to_padded  # noqa: E402
from tokenmill.layers.sampling.spec_verify import rejection_sample, verify_drafts  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

EOS = 2


def mix_params(mix: str, r: int) -> SamplingParams:
    if mix == "greedy":
        return SamplingParams(temperature=0.0)
    if mix == "random":
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    return [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9),
            SamplingParams(temperature=0.7, top_k=50, seed=r), SamplingParams(seed=r, min_p=0.05, min_tokens=8)][r % 4]


class Step:
    """One speculative step's inputs on the device, and the parts as callables."""

    def __init__(self, mix: str, rows: int, drafts: int, vocab: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        self.state = SamplingState(rows, vocab, [EOS], device)
        for r in range(rows):
            self.state.add(r, mix_params(mix, r))
        self.sampler = Sampler(self.state)
        self.k = drafts
        self.slots = torch.arange(rows, device=device)
        self.num_drafts = torch.full((rows,), drafts, dtype=torch.int64, device=device)  # the worst case
        self.num_tokens = rows * (drafts + 1)
        self.request, self.offset = flat_rows(self.num_drafts, self.num_tokens)
        self.flat_slots = self.slots[self.request]
        self.logits = (torch.randn(self.num_tokens, vocab, generator=g) * 3).to(device, torch.bfloat16)
        self.drafts = torch.randint(vocab, (rows, drafts), generator=g).to(device)
        self.q = torch.softmax(torch.randn(rows, drafts, vocab, generator=g) * 3, -1).to(device)
        self.p = self.sampler.probs(self.logits, self.flat_slots, self.offset)
        self.sampled = self.sampler.sample(self.logits, self.flat_slots, offsets=self.offset, record=False).sampled
        self.zero = torch.zeros(rows, dtype=torch.int64, device=device)

    def parts(self) -> dict:
        s = self.sampler
        rows_logits = self.logits[:len(self.slots)]
        return {
            "plain_sample": lambda: s.sample(rows_logits, self.slots, record=False),
            "sample_offsets": lambda: s.sample(self.logits, self.flat_slots, offsets=self.offset, record=False),
            "verify_one_hot": self.verify,
            "target_probs": lambda: s.probs(self.logits, self.flat_slots, self.offset),
            "draft_draw": lambda: s.draw(s.probs(rows_logits, self.slots, self.zero), self.slots, self.zero,
                                         NoiseStream.DRAFT),
            "rejection_sample": lambda: rejection_sample(s, self.slots, self.p, self.q, self.drafts, self.num_drafts),
        }

    def verify(self):
        emitted, num_emitted = verify_drafts(flat_to_padded(self.sampled, self.num_drafts, self.k, -1), self.drafts,
                                             self.num_drafts)
        self.sampler.advance(self.slots, num_emitted, emitted)
        return emitted


def timed_ms(fn, device: torch.device, iters: int) -> float:
    """Median wall time of one call, the device finished before and after."""
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def allocated_mb(fn, device: torch.device) -> float | None:
    """Peak memory the call allocated beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    del out
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def no_host_sync(fn, device: torch.device) -> bool:
    if device.type != "cuda":
        fn()
        return True
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as exc:
        print(f"host sync: {exc}")
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": args.rows, "drafts": args.drafts, "vocab": args.vocab,
              "logits_dtype": "bfloat16", "ms": {}, "allocated_mb": {}, "no_host_sync": {}}
    names = None
    for mix in ("greedy", "random", "mixed"):
        step = Step(mix, args.rows, args.drafts, args.vocab, device)
        parts = step.parts()
        names = list(parts)
        for name, fn in parts.items():
            for _ in range(3):  # warm-up
                fn()
            record["no_host_sync"][f"{mix}/{name}"] = no_host_sync(fn, device)
            record["ms"][f"{mix}/{name}"] = round(timed_ms(fn, device, args.iters), 4)
            record["allocated_mb"][f"{mix}/{name}"] = allocated_mb(fn, device)
        del step
    print(f"R={args.rows} K={args.drafts} V={args.vocab} on {record['device']}: median ms per call "
          f"(allocated MB)")
    print(f"{'part':18s}" + "".join(f"{mix:>22s}" for mix in ("greedy", "random", "mixed")))
    for name in names or []:
        cells = []
        for mix in ("greedy", "random", "mixed"):
            ms, mb = record["ms"][f"{mix}/{name}"], record["allocated_mb"][f"{mix}/{name}"]
            cells.append(f"{ms:9.3f}" + (f" ({mb:8.1f})" if mb is not None else " " * 11))
        print(f"{name:18s}" + "".join(f"{c:>22s}" for c in cells))
    ok = all(record["no_host_sync"].values())
    print(f"no host sync in any part: {ok}")
    print(json.dumps(record))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
