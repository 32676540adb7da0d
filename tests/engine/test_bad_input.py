"""Bad input is refused up front: one ValueError naming the field and its limit, raised before any
work is done (no request reaches the scheduler, no step runs), and the engine then serves normally."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil

import gguf
import numpy as np
import pytest

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tests.helpers.tiny_gguf import gguf_name, permute_rows
from tests.helpers.tiny_models import TINY_VOCAB_SIZE, make_tiny_config, make_tiny_hf_model, make_tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill import cli

MAX_MODEL_LEN = 128
GOOD_PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7]}
GOOD_PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = tiny_llm(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    engine.reference = engine.generate(GOOD_PROMPT, GOOD_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert len(engine.reference) == 6
    return engine


def long_prompt(n: int) -> dict:
    return {"prompt_token_ids": [3 + i % 200 for i in range(n)]}


# (prompt, params, words the message must contain: the field, then its limit)
CASES = {
    "empty-text": ("", SamplingParams(), ["prompt", "empty"]),
    "empty-ids": ({"prompt_token_ids": []}, SamplingParams(), ["prompt", "empty"]),
    "prompt-fills-context": (long_prompt(MAX_MODEL_LEN), SamplingParams(), ["prompt", f"max_model_len is {MAX_MODEL_LEN}"]),
    "prompt+max_tokens": (long_prompt(100), SamplingParams(max_tokens=29), ["max_tokens", f"max_model_len={MAX_MODEL_LEN}"]),
    "temperature-nan": ("hi", SamplingParams(temperature=NAN), ["temperature", "finite"]),
    "temperature-inf": ("hi", SamplingParams(temperature=INF), ["temperature", "finite"]),
    "temperature-negative": ("hi", SamplingParams(temperature=-0.5), ["temperature", ">= 0"]),
    "top_p-0": ("hi", SamplingParams(top_p=0.0), ["top_p", "(0, 1]"]),
    "top_p-1.5": ("hi", SamplingParams(top_p=1.5), ["top_p", "(0, 1]"]),
    "top_p-nan": ("hi", SamplingParams(top_p=NAN), ["top_p", "finite"]),
    "top_k-2": ("hi", SamplingParams(top_k=-2), ["top_k", "-1"]),
    "min_p-2": ("hi", SamplingParams(min_p=2.0), ["min_p", "[0, 1]"]),
    "max_tokens-negative": ("hi", SamplingParams(max_tokens=-3), ["max_tokens", ">= 1"]),
    "max_tokens-0": ("hi", SamplingParams(max_tokens=0), ["max_tokens", ">= 1"]),
    "min_tokens>max_tokens": ("hi", SamplingParams(min_tokens=5, max_tokens=4), ["min_tokens", "max_tokens=4"]),
    "n-0": ("hi", SamplingParams(n=0), ["n", ">= 1"]),
    "logprobs-21": ("hi", SamplingParams(logprobs=21), ["logprobs", "[0, 20]"]),
    "prompt_logprobs-21": ("hi", SamplingParams(prompt_logprobs=21), ["prompt_logprobs", "[0, 20]"]),
    "presence_penalty-3": ("hi", SamplingParams(presence_penalty=3.0), ["presence_penalty", "[-2, 2]"]),
    "repetition_penalty-0": ("hi", SamplingParams(repetition_penalty=0.0), ["repetition_penalty", "> 0"]),
    "seed-negative": ("hi", SamplingParams(seed=-1), ["seed", "[0, 2**63)"]),
    "token-id-over-vocab": ({"prompt_token_ids": [5, TINY_VOCAB_SIZE]}, SamplingParams(),
                            ["prompt_token_ids", str(TINY_VOCAB_SIZE)]),
    "token-id-negative": ({"prompt_token_ids": [5, -1]}, SamplingParams(), ["prompt_token_ids", str(TINY_VOCAB_SIZE)]),
    "token-id-not-int": ({"prompt_token_ids": [5, "7"]}, SamplingParams(), ["prompt_token_ids", "integers"]),
    "stop_token_ids-over-vocab": ("hi", SamplingParams(stop_token_ids=[TINY_VOCAB_SIZE + 1]),
                                  ["stop_token_ids", str(TINY_VOCAB_SIZE)]),
    "logit_bias-over-vocab": ("hi", SamplingParams(logit_bias={TINY_VOCAB_SIZE: 1.0}),
                              ["logit_bias", str(TINY_VOCAB_SIZE)]),
    "logit_bias-value": ("hi", SamplingParams(logit_bias={5: 101.0}), ["logit_bias", "[-100, 100]"]),
    "stop-empty-string": ("hi", SamplingParams(stop=[""]), ["stop", "non-empty"]),
    "stop-without-detokenize": ("hi", SamplingParams(stop=["x"], detokenize=False), ["stop", "detokenize"]),
    "prompt-wrong-type": (42, SamplingParams(), ["prompt", "int"]),
}


def expect_one_value_error(fn, words: list[str]) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    err = info.value
    assert type(err) is ValueError, f"expected a plain ValueError, got {type(err).__name__}"
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__), \
        f"the ValueError wraps another error: {err.__context__!r}"
    message = str(err)
    for word in words:
        assert word in message, f"{word!r} not in the message {message!r}"
    return message


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_refused_before_any_work(llm, case):
    prompt, params, words = CASES[case]
    if case == "empty-text" and llm.get_tokenizer()("").input_ids:
        pytest.skip("this tokenizer adds tokens to an empty string")
    steps_before = llm.engine.scheduler.step_id
    # The bad prompt comes second: the good one before it must not start either.
    expect_one_value_error(lambda: llm.generate([GOOD_PROMPT, prompt], [GOOD_PARAMS, params], use_tqdm=False),
                           words)
    assert llm.engine.scheduler.step_id == steps_before, "a step ran before the input was refused"
    assert_engine_idle(llm)
    out = llm.generate(GOOD_PROMPT, GOOD_PARAMS, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == llm.reference and out.finish_reason == "length"


def test_mismatched_params_list(llm):
    steps_before = llm.engine.scheduler.step_id
    expect_one_value_error(lambda: llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GOOD_PARAMS], use_tqdm=False),
                           ["sampling_params", "2 prompts"])
    assert llm.engine.scheduler.step_id == steps_before


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate(long_prompt(MAX_MODEL_LEN - 3), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


# ---------------------------------------------------------------- bad models


def test_unknown_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    expect_one_value_error(lambda: tiny_llm(missing), ["model", "no-such-model", "config.json"])


def test_unsupported_architecture_config_only(tmp_path):
    """A directory with nothing but a GPT-2 config.json: refused by name before anything is loaded."""
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 300, "n_embd": 64,
        "n_layer": 2, "n_head": 4, "bos_token_id": 1, "eos_token_id": 2}))
    message = expect_one_value_error(lambda: tiny_llm(str(path)),
                                     ["GPT2LMHeadModel", "LlamaForCausalLM"])
    assert "not supported" in message


def test_unsupported_architecture_full_dir(tiny_model_dir, tmp_path):
    path = tmp_path / "renamed"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    expect_one_value_error(lambda: tiny_llm(str(path)), ["GPT2LMHeadModel", "LlamaForCausalLM"])


def write_tiny_gguf_with_tokenizer(path, bad_tensor: str | None = None) -> None:
    """A complete tiny llama GGUF (config, byte-level tokenizer, F32 weights); `bad_tensor` is
    stored as Q8_1, a type the gguf package cannot dequantize."""
    config = make_tiny_config("llama")
    model = make_tiny_hf_model(config, seed=0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    vocab = [t for t, _ in sorted(make_tiny_tokenizer().get_vocab().items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3 if i < 3 else 1 for i in range(len(vocab))])  # 3: control
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_merges([])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    for hf_name, param in model.state_dict().items():
        name = gguf_name(hf_name)
        arr = param.detach().numpy().astype(np.float32)
        if ".attn_q." in name:
            arr = permute_rows(arr, config.num_attention_heads)
        elif ".attn_k." in name:
            arr = permute_rows(arr, config.num_key_value_heads)
        if name == bad_tensor:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_tensor_type(tmp_path):
    good = tmp_path / "good.gguf"
    write_tiny_gguf_with_tokenizer(good)  # the same file without the bad tensor loads and runs
    engine = tiny_llm(str(good))
    assert len(engine.generate(GOOD_PROMPT, GOOD_PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 6
    bad = tmp_path / "bad.gguf"
    write_tiny_gguf_with_tokenizer(bad, bad_tensor="blk.1.ffn_up.weight")
    expect_one_value_error(lambda: tiny_llm(str(bad)), ["blk.1.ffn_up.weight", "Q8_1"])


# ---------------------------------------------------------------- the CLI


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(r"\berror:", line)]


def test_cli_generate_prints_text(tiny_model_dir):
    code, out, err = run_cli(["--log-level", "WARNING", "generate", "--model", tiny_model_dir, "--prompt", "hi",
                              "--max-tokens", "4", "--kv-cache-memory-gb", "0.01"])
    assert code == 0, err
    assert out.strip(), "nothing printed"
    assert not error_lines(err)


BAD_FLAGS = {
    "max-tokens": (["--max-tokens", "-1"], ["max_tokens"]),
    "temperature": (["--temperature", "nan"], ["temperature"]),
    "top-p": (["--top-p", "1.5"], ["top_p"]),
    "block-size": (["--block-size", "3"], ["block_size"]),
    "not-an-int": (["--max-tokens", "many"], ["--max-tokens", "many"]),  # argparse's own type check
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_cli_bad_flag_value(tiny_model_dir, case):
    flags, words = BAD_FLAGS[case]
    code, out, err = run_cli(["--log-level", "WARNING", "generate", "--model", tiny_model_dir, "--prompt", "hi",
                              "--kv-cache-memory-gb", "0.01", "--single-process", *flags])
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1, f"expected one error: line, got {err!r}"
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in err and not out


@pytest.mark.parametrize("case", ["max-tokens", "temperature", "top-p"])
def test_cli_bad_sampling_flag_fails_before_loading(tiny_model_dir, monkeypatch, case):
    import tokenmill.entrypoints.llm as llm_module

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the sampling flags were checked")

    monkeypatch.setattr(llm_module, "LLM", no_engine)
    flags, words = BAD_FLAGS[case]
    code, _, err = run_cli(["--log-level", "WARNING", "generate", "--model", tiny_model_dir, "--prompt", "hi",
                            "--single-process", *flags])
    assert code == 2 and len(error_lines(err)) == 1 and words[0] in err
