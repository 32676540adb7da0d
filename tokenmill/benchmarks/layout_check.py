"""Teacher-forced logits check: do two engine layouts (one process, TP=2, PP=2, sync or async
scheduling, ...) compute the same model, up to rounding?

Every layout scores the same token sequences: a prompt plus a fixed continuation (the base
layout's greedy one, generated once), all of it given as the prompt, so no layout ever sees its
own picks and a difference at one position cannot cascade into the next. Each position's full
log-distribution comes back through the engine's own API (prompt logprobs with k = the vocabulary
size). A pair of layouts is compared position by position:
  - |delta logprob| / std of that position's logits (shift-free: the std of logprobs and of logits
    is the same): mean, p99, max over every (position, token);
  - top-1 agreement and ordered top-k agreement (the fraction of positions whose k best tokens
    come in the same order).

What "up to rounding" means is measured, not assumed: the reference spread is two different but
valid one-process runs of the same model (the base: all sequences in one batch, whole prompts
in one step; the reference: one sequence at a time, prefilled in small chunks, so every matmul
and the attention see other shapes and splits). A layout passes when each of its mean, p99 and max
is within `factor` times the reference's (each floored at an eighth of the dtype's epsilon, for a
reference that happens to be exact). The default factor of 4: a split layout adds
roundings of its own (partial sums reduced across ranks, in the model dtype) on top of those a
different one-process reduction has, so it may differ more, but by a small factor; a wrong shard
moves logits by a large fraction of their spread, far beyond it.

    tokenmill bench layouts --model DIR --dtype bfloat16 --layouts tp2,pp2,tp2-sync
    python -m tokenmill.benchmarks.layout_check --model DIR --layouts tp=2,async=0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_FACTOR = 4.0
TOP_K = 5
# Named layouts; anything else is `key=value,...` over _KEYS (e.g. "tp=2,pp=1,async=0").
PRESETS: dict[str, dict[str, Any]] = {
    "one": {},
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2-sync": dict(tensor_parallel_size=2, async_scheduling=False),
    "pp2-sync": dict(pipeline_parallel_size=2, async_scheduling=False),
    "tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}
_KEYS = {"tp": ("tensor_parallel_size", int), "pp": ("pipeline_parallel_size", int),
         "async": ("async_scheduling", lambda v: v not in ("0", "false", "off")),
         "eager": ("enforce_eager", lambda v: v not in ("0", "false", "off")),
         "seqs": ("max_num_seqs", int), "chunk": ("max_num_batched_tokens", int),
         # the pipeline's layers per stage, ':' between stages (',' separates keys): split=4.5:3.5
         "split": ("pp_layer_partition", lambda v: v.replace(":", ","))}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A name and the LLM(...) arguments that make this layout (on top of the shared ones)."""

    name: str
    engine: Mapping[str, Any]

    @classmethod
    def parse(cls, text: str) -> Layout:
        if text in PRESETS:
            return cls(text, PRESETS[text])
        engine = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in _KEYS or not value:
                raise ValueError(f"layout {text!r}: {item!r} is not one of {sorted(PRESETS)} "
                                 f"nor key=value with key in {sorted(_KEYS)}")
            field, convert = _KEYS[key]
            engine[field] = convert(value)
        return cls(text, engine)


def base_layout(**engine: Any) -> Layout:
    """One process (one worker), all sequences in one batch. `engine`: e.g. single_process=True."""
    return Layout("one", engine)


def reference_layout(sequences: Sequence[Sequence[int]], **engine: Any) -> Layout:
    """The base model reduced another valid way: one sequence per step, in chunks of a third of the
    shortest sequence (each chunk attends to the KV cache of the ones before it)."""
    chunk = max(2, min(len(s) for s in sequences) // 3)
    return Layout(f"one-seq1-chunk{chunk}", dict(max_num_seqs=1, max_num_batched_tokens=chunk,
                                                 async_scheduling=False, **engine))


@dataclasses.dataclass(frozen=True)
class Spread:
    """How far layout `label` lands from the base, over `positions` positions."""

    label: str
    positions: int
    mean: float  # |delta logprob| / std(logits) over every (position, token)
    p99: float
    max: float
    top1: float  # fraction of positions with the same argmax
    topk: float  # fraction of positions with the same top-k, in order

    def ratios(self, reference: Spread, floor: float) -> dict[str, float]:
        return {f: getattr(self, f) / max(getattr(reference, f), floor) for f in ("mean", "p99", "max")}


def compare(label: str, a: Sequence[np.ndarray], b: Sequence[np.ndarray], k: int = TOP_K) -> Spread:
    """`a`, `b`: per sequence, [positions, vocab] logprobs of two layouts; `b` sets the scale."""
    x, y = np.concatenate(a).astype(np.float64), np.concatenate(b).astype(np.float64)
    if x.shape != y.shape:
        raise ValueError(f"{label}: logprobs of shape {x.shape} vs {y.shape}")
    z = (np.abs(x - y) / y.std(axis=1, keepdims=True)).ravel()
    top_x, top_y = np.argsort(-x, axis=1, kind="stable")[:, :k], np.argsort(-y, axis=1, kind="stable")[:, :k]
    return Spread(label, x.shape[0], float(z.mean()), float(np.quantile(z, 0.99)), float(z.max()),
                  float((top_x[:, 0] == top_y[:, 0]).mean()), float((top_x == top_y).all(axis=1).mean()))


def rounding_floor(dtype: str) -> float:
    """An eighth of the dtype's epsilon (relative to the logits' std): below the reference spread
    seen on CPU in float32 (~4 eps) and bfloat16 (~eps / 2), there only so that a reference that
    happens to be exact does not make every rounding a failure."""
    import torch
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype: name one (float32, bfloat16, float16), got {dtype!r}")
    return torch.finfo(getattr(torch, dtype)).eps / 8


@dataclasses.dataclass(frozen=True)
class Verdict:
    spread: Spread
    ratios: dict[str, float]  # to the reference's (floored) mean, p99, max
    factor: float

    @property
    def passed(self) -> bool:
        return all(r <= self.factor for r in self.ratios.values())


def judge(spread: Spread, reference: Spread, dtype: str, factor: float = DEFAULT_FACTOR) -> Verdict:
    return Verdict(spread, spread.ratios(reference, rounding_floor(dtype)), factor)


def vocab_size(model: str) -> int:
    from tokenmill.model.arch import model_arch
    from tokenmill.model.hf_config import load_hf_config
    return model_arch(load_hf_config(model)).vocab_size


def _engine(model: str, layout: Layout, common: Mapping[str, Any], vocab: int):
    from tokenmill import LLM
    return LLM(model, **{**common, "max_logprobs": vocab, **layout.engine})


def greedy_continuations(model: str, layout: Layout, prompts: Sequence[Sequence[int]], num_tokens: int,
                         common: Mapping[str, Any]) -> list[list[int]]:
    """Each prompt followed by `layout`'s greedy continuation of `num_tokens` tokens."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
    with _engine(model, layout, common, 0) as llm:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def teacher_forced_logprobs(model: str, layout: Layout, sequences: Sequence[Sequence[int]],
                            common: Mapping[str, Any], vocab: int | None = None,
                            probe: Callable[[str, Any], None] | None = None) -> list[np.ndarray]:
    """Per sequence, float32 [len - 1, vocab]: row i is log p(. | tokens <= i) under `layout`.
    `probe(layout name, engine)`: more checks in the same engine, after the scoring."""
    vocab = vocab or vocab_size(model)
    with _engine(model, layout, common, vocab) as llm:
        scores = _score(llm, layout, sequences, vocab)
        if probe is not None:
            probe(layout.name, llm)
        return scores


def continue_and_score(model: str, layout: Layout, prompts: Sequence[Sequence[int]], num_tokens: int,
                       common: Mapping[str, Any], vocab: int | None = None,
                       probe: Callable[[str, Any], None] | None = None
                       ) -> tuple[list[list[int]], list[np.ndarray]]:
    """`greedy_continuations` and then `teacher_forced_logprobs` of them, in one engine (one start
    fewer: the base layout's two runs of `check_layouts`, passed to it as `base`)."""
    from tokenmill import SamplingParams
    vocab = vocab or vocab_size(model)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
    with _engine(model, layout, common, vocab) as llm:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        scores = _score(llm, layout, sequences, vocab)
        if probe is not None:
            probe(layout.name, llm)
        return sequences, scores


def _score(llm, layout: Layout, sequences: Sequence[Sequence[int]], vocab: int) -> list[np.ndarray]:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outs):
        rows = out.prompt_logprobs[1:]  # the first token has no prediction
        dense = np.full((len(rows), vocab), np.nan, dtype=np.float32)
        for i, row in enumerate(rows):
            ids = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
            dense[i, ids] = [lp.logprob for lp in row.values()]
        if len(rows) != len(seq) - 1 or np.isnan(dense).any():
            raise RuntimeError(f"layout {layout.name}: incomplete prompt logprobs ({len(rows)} rows for "
                               f"{len(seq)} tokens, {int(np.isnan(dense).sum())} missing entries)")
        result.append(dense)
    return result


def random_prompts(vocab: int, lengths: Sequence[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    """Prompts of random token ids in [low, vocab) (below `low`: pad, bos, eos by convention)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    dtype: str
    reference: Spread
    verdicts: list[Verdict]

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "reference": dataclasses.asdict(self.reference),
                "layouts": [{**dataclasses.asdict(v.spread), "ratios": v.ratios, "factor": v.factor,
                             "passed": v.passed} for v in self.verdicts]}


def check_layouts(model: str, layouts: Sequence[Layout], sequences: Sequence[Sequence[int]],
                  common: Mapping[str, Any], factor: float = DEFAULT_FACTOR,
                  envs: Mapping[str, Mapping[str, str]] | None = None,
                  one_process: Mapping[str, Any] | None = None,
                  base: list[np.ndarray] | None = None,
                  probe: Callable[[str, Any], None] | None = None) -> LayoutReport:
    """Scores `sequences` under the base, the reference and each layout; judges each layout's
    spread from the base against the reference's. `envs`: per layout name, environment variables
    set while its engine runs (a test's planted fault). `one_process`: extra engine arguments of
    the base and the reference (tests: single_process=True). `base`: the base's scores, already
    computed (`continue_and_score`). `probe`: run in the reference's and each layout's engine
    (`teacher_forced_logprobs`)."""
    import os
    vocab = vocab_size(model)
    if base is None:
        base = teacher_forced_logprobs(model, base_layout(**(one_process or {})), sequences, common, vocab)
    ref_layout = reference_layout(sequences, **(one_process or {}))
    reference = compare(ref_layout.name, teacher_forced_logprobs(model, ref_layout, sequences, common, vocab, probe),
                        base)
    dtype = str(common.get("dtype", "float32"))
    verdicts = []
    for layout in layouts:
        env = dict((envs or {}).get(layout.name, {}))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            got = teacher_forced_logprobs(model, layout, sequences, common, vocab, probe)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        verdicts.append(judge(compare(layout.name, got, base), reference, dtype, factor))
    return LayoutReport(dtype, reference, verdicts)


def format_report(report: LayoutReport) -> str:
    head = (f"{'layout vs one process':<24} {'dtype':<9} {'pos':>5} {'mean':>9} {'p99':>9} {'max':>9} "
            f"{'top1':>6} {'top' + str(TOP_K):>6}  ratio to reference (mean/p99/max)")
    lines = [head, "  (|delta logprob| / std of the position's logits)"]

    def row(s: Spread, tail: str) -> str:
        return (f"{s.label:<24} {report.dtype:<9} {s.positions:>5} {s.mean:>9.2e} {s.p99:>9.2e} {s.max:>9.2e} "
                f"{s.top1:>6.3f} {s.topk:>6.3f}  {tail}")

    lines.append(row(report.reference, "(reference spread)"))
    for v in report.verdicts:
        r = v.ratios
        lines.append(row(v.spread, f"{r['mean']:.2f}/{r['p99']:.2f}/{r['max']:.2f} "
                                   f"{'ok' if v.passed else 'FAIL'} (limit {v.factor:g})"))
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("layouts", help="teacher-forced logits of engine layouts (TP, PP, ...) vs one process",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.config import add_engine_flags
    p.add_argument("--model", required=True, help="a HF directory (its vocabulary is scored in full)")
    p.add_argument("--layouts", default="tp2,pp2,tp2-sync",
                   help=f"presets separated by ',' ({', '.join(PRESETS)}), or layouts separated by ';' "
                        f"where custom ones are key=value lists ({', '.join(_KEYS)}): 'tp=2,async=0;pp2'")
    p.add_argument("--prompt-lens", default="5,17,40,64", help="lengths of the random prompts")
    p.add_argument("--continuation", type=int, default=16, help="greedy tokens appended to each prompt")
    p.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                   help="a layout fails when its mean, p99 or max exceeds this multiple of the reference's")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None)
    add_engine_flags(p)  # shared by every layout; a layout's own keys (and the reference's) win
    p.set_defaults(dtype="float32")


def parse_layouts(text: str) -> list[Layout]:
    """'tp2,pp2' (presets) or 'tp=2,async=0;pp=2' (';' between custom layouts)."""
    if ";" in text or "=" in text:
        return [Layout.parse(t) for t in text.split(";") if t]
    return [Layout.parse(t) for t in text.split(",") if t]


def run(ns) -> int:
    from tokenmill.benchmarks.record import machine_info, versions
    from tokenmill.config import EngineArgs, engine_args_from_flags
    defaults = dataclasses.asdict(EngineArgs(model=ns.model))
    common = {k: v for k, v in dataclasses.asdict(engine_args_from_flags(ns, ns.model)).items()
              if k != "model" and v != defaults[k]}
    common["dtype"] = ns.dtype
    vocab = vocab_size(ns.model)
    prompts = random_prompts(vocab, [int(n) for n in ns.prompt_lens.split(",")], ns.prompt_seed)
    sequences = greedy_continuations(ns.model, base_layout(), prompts, ns.continuation, common)
    report = check_layouts(ns.model, parse_layouts(ns.layouts), sequences, common, ns.factor)
    print(format_report(report), flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"benchmark": "layout_check", "model": ns.model, "machine": machine_info(),
                       "versions": versions(), **report.as_dict()}, f, indent=2)
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
