"""`tokenmill` command line: generate, serve, and bench."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.config import EngineArgs, add_engine_flags, engine_args_from_flags


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt (or chat message) and print the result",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=EngineArgs.model,
                   help="Hugging Face directory, .gguf file, Hub id (ORG/NAME, ORG/NAME:QUANT) or alias")
    p.add_argument("--prompt", required=True, help="the prompt text (the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_flags(p)
    p.set_defaults(func=_run_generate)


def _run_generate(ns) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.frontend.engine_frontend import EngineFrontend
    from tokenmill.sampling_params import SamplingParams

    frontend = EngineFrontend(engine_args_from_flags(ns, ns.model))  # resolves the flags; starts nothing
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sampling_seed)
    prompt = frontend.chat_prompt([{"role": "user", "content": ns.prompt}]) if ns.chat else ns.prompt
    request = frontend.prepare(prompt, params)  # the request's one check: bad flags fail before the model loads
    with LLM.from_frontend(frontend) as llm:
        out = llm.generate(request, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def _add_serve(sub) -> None:
    from tokenmill.entrypoints.openai.args import add_server_flags
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve MODEL over an OpenAI-compatible HTTP API (completions, chat, "
                                   "models, tokenize, metrics). Engine flags use vLLM's names.")
    p.add_argument("model", nargs="?", default=EngineArgs.model,
                   help=f"Hugging Face directory, .gguf file, Hub id (ORG/NAME, ORG/NAME:QUANT) or alias "
                        f"(default: {EngineArgs.model})")
    add_server_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=_run_serve)


def _run_serve(ns) -> int:
    from tokenmill.entrypoints.openai.args import settings_from_flags
    from tokenmill.entrypoints.openai.server import run

    from tokenmill.child_process import exit_now

    settings = settings_from_flags(ns)
    status = run(engine_args_from_flags(ns, ns.model), settings)  # see ExitStatus
    # Everything is shut down and reaped: skip the interpreter's teardown (seconds of GC), so a
    # supervisor sees the exit status at once.
    exit_now(int(status))
    return int(status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill LLM inference engine")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    bench = sub.add_parser("bench", help="benchmarks that print figures and a JSON record")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenmill.benchmarks import bf16_deviation, core_step, overhead, serve, soak, spec_decode, throughput
    throughput.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    soak.add_parser(bench_sub)
    overhead.add_parser(bench_sub)
    core_step.add_parser(bench_sub)
    spec_decode.add_parser(bench_sub)
    bf16_deviation.add_parser(bench_sub)
    from tokenmill.benchmarks import all_reduce, layout_check
    layout_check.add_parser(bench_sub)
    all_reduce.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2", "httpcore"):  # one INFO line per HTTP request (Hub downloads): too many
        logging.getLogger(name).setLevel(max(logging.getLogger().level, logging.WARNING))
    try:
        return ns.func(ns)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
