"""`LLM`: the embedded random-weight checkpoint, prompt forms, fidelity to the full forward, seeded
sampling in batches, vLLM's finish/stop reasons, chat encoding and parsing, metrics and logs.

One module-scoped `LLM` with a small cache budget serves most tests, so each step shape compiles
once. It is the embedded tiny-v4.1-short (random weights, `init_params` seed 0; one layer of each
tiny-v4.1 role, so a step compiles in about half the time) in a directory named like the embedded
one's, so the config (a static jit argument that includes the name) is the same in every test
module of this process (test_llm_fuzz and test_batch use the same model and budget).
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest

from deepinfer.serve.api.types import CompletionOutput, RequestOutput, SamplingParams
from tests.serve.compilations import COMPILE_EVENTS

MODEL = "tiny-v4.1-short"
SMALL = dict(max_num_seqs=4, max_model_len=512, page_size=64, prefill_chunk=128, prefill_mode="full")
GREEDY = dict(temperature=0.0, ignore_eos=True)
SYSTEM_STANDIN_ID = 128798  # a placeholder id renamed to <｜System｜> in the stand-in V4.1 tokenizer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("llm") / f"{MODEL}-seed0"


@pytest.fixture(scope="module")
def llm(cache_dir):
    from deepinfer import LLM

    return LLM(MODEL, cache_dir=cache_dir, **SMALL)


def random_prompt(n: int, seed: int) -> list[int]:
    return [0, *np.random.default_rng(seed).integers(3, 120000, n - 1).tolist()]


def only(outputs: list[RequestOutput]) -> CompletionOutput:
    assert len(outputs) == 1
    return outputs[0].outputs[0]


# ---- construction ------------------------------------------------------------------------------


def test_root_package_exports_are_lazy():
    import subprocess
    import sys

    code = ("import sys, deepinfer; assert 'jax' not in sys.modules; "
            "from deepinfer import LLM, SamplingParams; from deepinfer.serve.api import LLM as L2; "
            "assert LLM is L2 and SamplingParams.__name__ == 'SamplingParams'")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_embedded_random_model_is_written_once(llm, cache_dir, monkeypatch, tmp_path):
    import deepinfer.serve.api.embedded as embedded
    from deepinfer import LLM
    from deepinfer.model.checkpoint import INDEX_FILE
    from deepinfer.model.manifest import MANIFEST_FILE
    from deepinfer.model.verify import verify_checkpoint

    assert (cache_dir / INDEX_FILE).is_file() and (cache_dir / "config.json").is_file()
    assert verify_checkpoint(cache_dir).ok and (cache_dir / MANIFEST_FILE).is_file()  # written with its checksums
    assert llm.model_name == MODEL and llm.config.model_type == "deepseek_v41" and llm.config.num_layers == 5
    assert llm.config.dtype == "float32"
    assert not [p for p in cache_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dir left

    def fail(*args, **kwargs):
        raise AssertionError("the embedded checkpoint was written twice")

    monkeypatch.setattr(embedded, "write_checkpoint", fail)
    again = LLM(MODEL, cache_dir=cache_dir, **SMALL)
    assert again.model_dir == llm.model_dir
    assert embedded.ensure_random_checkpoint(cache_dir, MODEL) == (str(cache_dir), False)
    monkeypatch.undo()
    full = LLM("tiny-v4.1", cache_dir=tmp_path / "tiny-v4.1-seed0", **SMALL)  # the tests' reference model
    assert full.model_name == "tiny-v4.1" and full.config.num_layers == 10
    with pytest.raises(ValueError, match="no embedded random weights"):
        embedded.ensure_random_checkpoint(tmp_path / "v41", "deepseek-v4.1-flash")


def test_bad_cache_dir_and_models_are_rejected(tmp_path):
    from deepinfer import LLM

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="cache_dir"):
        LLM("tiny-v4.1", cache_dir=junk, **SMALL)
    with pytest.raises(ValueError, match="no weights"):
        LLM("deepseek-v4.1-flash", **SMALL)
    with pytest.raises(ValueError, match="neither a checkpoint directory"):
        LLM(str(tmp_path / "missing"), **SMALL)


def test_v4_checkpoint_is_rejected_with_a_clear_error(tmp_path):
    from deepinfer import LLM
    from deepinfer.model import load_config
    from deepinfer.model.config import to_hf_config

    # only the config is read before the model type is checked
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(load_config("tiny-v4"))))
    with pytest.raises(ValueError, match=r"DeepSeek-V4 model.*full forward"):
        LLM(str(tmp_path), **SMALL)


def test_unknown_argument_and_bad_settings_name_the_field(cache_dir):
    from deepinfer import LLM

    with pytest.raises(ValueError, match=r"^gpu_memory_utilisation: unknown LLM argument"):
        LLM(MODEL, cache_dir=cache_dir, gpu_memory_utilisation=0.9)
    with pytest.raises(ValueError, match="prefill_mode"):
        LLM(MODEL, cache_dir=cache_dir, prefill_mode="sparse")
    with pytest.raises(ValueError, match=r"keep_tokens: .*sliding window \(128\)"):
        LLM(MODEL, cache_dir=cache_dir, keep_tokens=100)
    with pytest.raises(ValueError, match="prefill_chunk"):
        LLM(MODEL, cache_dir=cache_dir, prefill_chunk=100)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\).*at least 135"):
        LLM(MODEL, cache_dir=cache_dir, max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="^min_page_bucket_tokens"):
        LLM(MODEL, cache_dir=cache_dir, min_page_bucket_tokens=0)


def test_prefill_settings_reach_the_engine(cache_dir):
    from deepinfer import LLM

    other = LLM(MODEL, cache_dir=cache_dir, **{**SMALL, "prefill_mode": "compact"}, keep_tokens=150,
                max_num_batched_tokens=1024, min_page_bucket_tokens=256)
    assert other.engine.engine_config.prefill_mode == "compact"
    assert other.engine.engine_config.min_page_bucket_tokens == other.engine.runner.min_page_tokens == 256
    assert other.engine.scheduler.max_num_batched_tokens == 1024
    assert other.engine.engine_config.keep_tokens == 150


def test_invalid_sampling_params_name_the_field(llm):
    with pytest.raises(ValueError, match=r"^temperature:"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"tempreature: unknown sampling parameter"):
        llm.generate("Hi", {"tempreature": 0.5}, use_tqdm=False)


# ---- generate ----------------------------------------------------------------------------------


def test_generate_accepts_every_prompt_form_in_order(llm):
    text = "The capital of France is"
    ids = llm.encode_prompt(text)
    assert ids[0] == llm.config.bos_token_id and ids[1:] == llm.tokenizer.encode(text).ids
    prompts = [text, [0, 791, 6102], {"prompt": "Hello"}, {"prompt_token_ids": ids}, [0, 5, 6, 7, 8]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids, [0, 791, 6102], llm.encode_prompt("Hello"), ids,
                                                  [0, 5, 6, 7, 8]]
    assert [o.prompt for o in outs] == [text, None, "Hello", None, None]
    assert all(len(o.outputs[0].token_ids) == 3 and o.finished for o in outs)
    # the same ids give the same greedy tokens, whatever the form
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    # a single prompt (not in a list) and one SamplingParams per prompt
    single = llm.generate({"prompt_token_ids": ids}, [SamplingParams(max_tokens=3, **GREEDY)], use_tqdm=False)
    assert only(single).token_ids == outs[0].outputs[0].token_ids


def test_a_bad_prompt_fails_the_whole_call_before_any_work(llm):
    good = SamplingParams(max_tokens=2, **GREEDY)
    steps = llm.engine.stats["steps"]
    cases = [
        (["fine", ""], r"prompt 1: .*empty"),
        (["fine", [0, 129280]], r"prompt 1: .*vocabulary"),
        ([[0, 1, 2], random_prompt(600, 0)], r"prompt 1: .*context"),
        ([{"prompt": "x", "image": 1}], r"prompt 0: unsupported prompt key"),
    ]
    for prompts, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            llm.generate(prompts, good, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: 1 given for 2 prompts"):
        llm.generate(["a", "b"], [good], use_tqdm=False)
    assert llm.engine.stats["steps"] == steps and not llm.engine.has_unfinished()


def test_greedy_generate_equals_a_naive_forward_loop(llm):
    from deepinfer.model import forward

    prompts = [random_prompt(11, 1), random_prompt(150, 2)]  # the long one spans two prefill chunks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, **GREEDY),
                        use_tqdm=False)
    # naive loop: full forward over the growing sequences, argmax at each sequence's end. The rows
    # are right-padded to one length (causal attention: padding after a position cannot change
    # its logits), so the loop compiles one shape.
    seqs = [list(p) for p in prompts]
    width = max(len(p) for p in prompts) + 4
    for _ in range(4):
        batch = np.full((len(seqs), width), llm.config.pad_token_id, np.int32)
        for row, seq in enumerate(seqs):
            batch[row, :len(seq)] = seq
        logits = np.asarray(forward(llm.params, llm.config, batch))
        for row, seq in enumerate(seqs):
            seq.append(int(logits[row, len(seq) - 1].argmax()))
    for out, prompt, seq in zip(outs, prompts, seqs):
        assert out.outputs[0].token_ids == seq[len(prompt):]
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    target = {"prompt_token_ids": random_prompt(20, 5)}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=5, ignore_eos=True)
    alone = only(llm.generate(target, params, use_tqdm=False)).token_ids
    others = [{"prompt_token_ids": random_prompt(n, 10 + n)} for n in (7, 33, 50)]
    mixed = llm.generate(
        [others[0], target, others[1], others[2], target],
        [SamplingParams(temperature=1.0, seed=1, max_tokens=7, ignore_eos=True), params,
         SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True),
         SamplingParams(max_tokens=6, **GREEDY), params],
        use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[4].outputs[0].token_ids == alone  # a second copy, in another slot
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=5, ignore_eos=True)
    assert only(llm.generate(target, other_seed, use_tqdm=False)).token_ids != alone


def test_finish_and_stop_reasons_follow_vllm(llm):
    prompt = {"prompt_token_ids": random_prompt(16, 7)}
    first = only(llm.generate(prompt, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False))
    tokens, text = first.token_ids, first.text
    assert len(tokens) == 8 and (first.finish_reason, first.stop_reason) == ("length", None)

    # a stop token id: generation ends on its first occurrence, which stays in token_ids
    stop_id = tokens[3]
    cut = tokens.index(stop_id)
    out = only(llm.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop_id], **GREEDY),
                            use_tqdm=False))
    assert out.token_ids == tokens[:cut + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    # a stop string: cut from the text (kept with include_stop_str_in_output), reported as stop_reason
    pieces = [llm.tokenizer.decode([t]) for t in tokens]
    stop = next(p.strip() for p in pieces[2:] if p.strip() and "\ufffd" not in p)
    at = text.index(stop)
    out = only(llm.generate(prompt, SamplingParams(max_tokens=8, stop=[stop, "never-there"], **GREEDY),
                            use_tqdm=False))
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[:at]
    assert out.token_ids == tokens[:len(out.token_ids)] and len(out.token_ids) < 8
    out = only(llm.generate(prompt, SamplingParams(max_tokens=8, stop=stop, include_stop_str_in_output=True,
                                                   **GREEDY), use_tqdm=False))
    assert out.text == text[:at + len(stop)] and out.stop_reason == stop

    # EOS (forced by a logit bias): finish_reason stop, stop_reason None, EOS kept in token_ids
    eos = llm.config.eos_token_id
    out = only(llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={eos: 1e4}),
                            use_tqdm=False))
    assert out.token_ids == [eos] and out.text == ""
    assert (out.finish_reason, out.stop_reason) == ("stop", None)


# ---- chat --------------------------------------------------------------------------------------


def test_chat_thinking_off_encodes_and_returns_the_content(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert ids[0] == 0 and ids.count(0) == 1  # exactly the template's BOS
    assert ids[-2:] == [128804, 128822]  # <｜Assistant｜></think>
    assert out.prompt.endswith("<｜Assistant｜></think>")
    completion = out.outputs[0]
    assert completion.reasoning_content is None and completion.tool_calls is None
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=False).lstrip("\n")
    # a list of conversations gives one output each, in order
    outs = llm.chat([messages, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2, **GREEDY),
                    use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs][0] == completion.token_ids[:2]
    with pytest.raises(ValueError, match=r"^enable_thinkin: unknown chat_template_kwargs key"):
        llm.chat(messages, chat_template_kwargs={"enable_thinkin": True}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"conversation 1:"):
        llm.chat([messages, [{"role": "nobody", "content": "x"}]], use_tqdm=False)


@pytest.fixture(scope="module")
def llm41(llm, cache_dir):
    """The same model with a stand-in V4.1 tokenizer: the V4 vocabulary lacks <｜System｜>, which
    the V4.1 template emits in thinking mode; a placeholder id takes its spelling."""
    import tokenizers

    from deepinfer import LLM

    spec = json.loads(llm.tokenizer.to_str())
    for token in spec["added_tokens"]:
        if token["id"] == SYSTEM_STANDIN_ID:
            token.update(content="<｜System｜>", special=False)
    return LLM(MODEL, cache_dir=cache_dir, tokenizer=tokenizers.Tokenizer.from_str(json.dumps(spec)), **SMALL)


def test_chat_thinking_mode_encodes_and_parses_reasoning(llm, llm41):
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = {"thinking": True, "reasoning_effort": "high"}
    out = llm41.chat(messages, SamplingParams(max_tokens=3, **GREEDY), chat_template_kwargs=kwargs, use_tqdm=False)[0]
    assert out.prompt_token_ids[-2:] == [128804, 128821]  # <｜Assistant｜><think>
    assert SYSTEM_STANDIN_ID in out.prompt_token_ids  # the effort line's <｜System｜>
    # the bundled V4 vocabulary lacks <｜System｜>: the engine spells it as that same placeholder
    bundled = llm.chat(messages, SamplingParams(max_tokens=1, **GREEDY), chat_template_kwargs=kwargs,
                       use_tqdm=False)[0]
    assert bundled.prompt_token_ids == out.prompt_token_ids
    completion = out.outputs[0]
    # random weights never close </think>: the whole answer is reasoning
    assert completion.text == ""
    assert completion.reasoning_content == llm41.tokenizer.decode(completion.token_ids, skip_special_tokens=False).lstrip("\n")

    # force </think> as the third token: suppressed (as a stop token) until min_tokens, then biased
    forced = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=2, stop_token_ids=[128822],
                            logit_bias={128822: 1e4})
    completion = llm41.chat(messages, forced, chat_template_kwargs={"thinking": True}, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids[-1] == 128822 and len(completion.token_ids) == 3
    assert (completion.finish_reason, completion.stop_reason) == ("stop", 128822)
    assert completion.reasoning_content == llm41.tokenizer.decode(completion.token_ids[:2], skip_special_tokens=False).lstrip("\n")
    assert completion.text == ""


def test_chat_output_parsing_splits_reasoning_content_and_tool_calls(llm41):
    from deepinfer.serve.api.llm import parse_chat_completion

    tok = llm41.tokenizer
    prompt = llm41.prepare_chat([{"role": "user", "content": "Capital of France?"}], thinking=True)

    def output(ids, text="", finish="stop", stop_reason=None):
        completion = CompletionOutput(0, text, ids, finish_reason=finish, stop_reason=stop_reason)
        return RequestOutput("x", None, prompt.token_ids, None, [completion], True)

    ids = tok.encode("Paris is the capital.", add_special_tokens=False).ids + [128822] \
        + tok.encode("Paris", add_special_tokens=False).ids + [1]
    parsed = parse_chat_completion(tok, prompt, output(ids))
    assert (parsed.reasoning_content, parsed.content) == ("Paris is the capital.", "Paris")
    # a matched stop string: the engine's (already cut) text is parsed
    parsed = parse_chat_completion(tok, prompt, output(ids[:-3], text="Let me see.</think>Par",
                                                       stop_reason="is"))
    assert (parsed.reasoning_content, parsed.content) == ("Let me see.", "Par")

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    prompt = llm41.prepare_chat([{"role": "user", "content": "Weather in Paris?"}], tools=tools, thinking=False)
    call = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    parsed = parse_chat_completion(tok, prompt, output(tok.encode(call, add_special_tokens=False).ids + [1]))
    assert parsed.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parsed.finish_reason == "tool_calls"


# ---- metrics, logs, profiling ----------------------------------------------------------------


def test_get_metrics_counts_tokens_and_requests(llm):
    before = llm.get_metrics()
    prompts = [random_prompt(9, 21), random_prompt(14, 22)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=3, **GREEDY),
                        use_tqdm=False)
    after = llm.get_metrics()
    assert after["vllm:prompt_tokens"] - before["vllm:prompt_tokens"] == 9 + 14
    assert after["vllm:generation_tokens"] - before["vllm:generation_tokens"] == 6
    assert after["vllm:request_success"]["length"] - before["vllm:request_success"]["length"] == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        new = after[name][len(before[name]):]
        assert len(new) == 2 and all(v >= 0 for v in new)
    assert after["vllm:request_generation_tokens"][-2:] == [3.0, 3.0]
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0 and after["vllm:num_preemptions"] == 0
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_periodic_stats_line_and_progress_bar(llm, caplog, capsys):
    llm.log_stats_interval = 0  # log after every step
    try:
        with caplog.at_level(logging.INFO, logger="deepinfer.llm"):
            llm.generate(["Hello there", "General"], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=True)
    finally:
        llm.log_stats_interval = 10.0
    line = re.compile(r"^Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: "
                      r"\d+\.\d tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: "
                      r"\d+\.\d%, Prefix cache hit rate: 0\.0%$")
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.llm"]
    assert messages and all(line.match(m) for m in messages), messages
    err = capsys.readouterr().err
    assert "Processed prompts" in err and re.search(r"est\. speed input: [\d.]+ toks/s, output: [\d.]+ toks/s", err)


@pytest.mark.slow
def test_a_call_compiles_before_its_first_step_at_the_defaults(cache_dir, monkeypatch):
    """`warmup` (on by default) at the engine defaults (compact prefill, 512-token chunks,
    128-token pages, the narrowest page table 2,048 tokens), on a fresh `LLM` whose params are
    loaded from the checkpoint (committed to their device): a 1,400-token prompt (two
    encoder-only chunks, one with the decoder) and a 2,020-token one that decodes across the
    2,048-token page bucket compile nothing inside the engine's steps (JAX's compile and
    cache-load events): the planned shapes ran before the first step, with inputs placed as the
    real steps' are."""
    import jax.monitoring

    from deepinfer import LLM

    llm = LLM(MODEL, cache_dir=cache_dir, max_num_seqs=4, max_model_len=4096)
    during, in_step = [], [False]
    step = llm.engine.step

    def counted_step():
        in_step[0] = True
        try:
            return step()
        finally:
            in_step[0] = False

    def on_event(name, seconds, **_):
        if name in COMPILE_EVENTS and in_step[0]:
            during.append(seconds)

    monkeypatch.setattr(llm.engine, "step", counted_step)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        outs = llm.generate([random_prompt(1400, 1), random_prompt(2020, 2)],
                            [SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=40, **GREEDY)],
                            use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 40]
    assert [str(s) for s in sorted(llm.engine.warmed_shapes, key=str)] == [
        "decode 4 rows x 1 tokens x 16 pages", "decode 4 rows x 1 tokens x 32 pages",
        "prefill 1 rows x 512 tokens x 16 pages", "prefill 1 rows x 512 tokens x 16 pages, encoder only"]
    assert during == [], f"{len(during)} compilation(s) inside engine steps"


def test_profile_writes_a_trace(llm, tmp_path):
    llm.start_profile(tmp_path / "trace")
    with pytest.raises(RuntimeError, match="already"):
        llm.start_profile(tmp_path / "other")
    llm.generate([[0, 5, 6]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    assert llm.stop_profile() == str(tmp_path / "trace")
    assert any(p.is_file() for p in (tmp_path / "trace").rglob("*"))
    with pytest.raises(RuntimeError, match="no profile"):
        llm.stop_profile()
