"""`run_batch`: the OpenAI batch JSONL runner (vLLM's `run-batch` file format)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from deepinfer.serve.api.types import SamplingParams

SMALL = dict(max_num_seqs=4, max_model_len=512, page_size=64, prefill_chunk=128, prefill_mode="full")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from deepinfer import LLM

    # named like the embedded random model, so its compiled steps are shared with test_llm.py in one process
    return LLM("tiny-v4.1-short", cache_dir=tmp_path_factory.mktemp("batch") / "tiny-v4.1-short-seed0", **SMALL)


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def read(path) -> list[dict]:
    return [json.loads(row) for row in path.read_text(encoding="utf-8").splitlines()]


def test_good_and_malformed_lines_keep_input_order(llm, tmp_path):
    from deepinfer.serve.api.batch import run_batch

    user = [{"role": "user", "content": "What is the capital of France?"}]
    too_long = list(range(3, 603))
    rows = [
        line("chat-1", CHAT, {"model": "tiny", "messages": user, "max_tokens": 3, "temperature": 0,
                              "logprobs": True, "top_logprobs": 2}),
        '{"custom_id": "broken", "method": "POST", ',  # bad JSON
        line("cmpl-1", COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                                     "logprobs": 2, "top_k": 5, "ignore_eos": True}),
        line("embed-1", "/v1/embeddings", {"input": "hello"}),  # unknown url
        line("chat-bad-temp", CHAT, {"messages": user, "temperature": -1}),  # invalid parameter
        line("cmpl-long", COMPLETIONS, {"prompt": too_long, "max_tokens": 2}),  # prompt too long
        line("chat-stream", CHAT, {"messages": user, "stream": True}),
        "",  # blank lines are not requests
        line("cmpl-ids", COMPLETIONS, {"prompt": [0, 791, 6102, 294], "max_tokens": 3, "temperature": 0,
                                       "stop": ["never-there"], "seed": 7}),
        json.dumps({"method": "POST", "url": CHAT, "body": {"messages": user}}),  # no custom_id
        line("chat-2", CHAT, {"messages": user, "max_completion_tokens": 2, "temperature": 0,
                              "frequency_penalty": 0.5, "n": 1}),
        line("chat-n", CHAT, {"messages": user, "n": 2, "max_tokens": 3, "seed": 5, "logprobs": True}),
        line("chat-unknown-field", CHAT, {"messages": user, "temprature": 0.5}),
        line("chat-long", CHAT, {"messages": [{"role": "user", "content": "word " * 700}], "max_tokens": 2}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(rows) + "\n", encoding="utf-8")
    summary = run_batch(llm, src, dst, use_tqdm=False)

    out = read(dst)
    expected_ids = ["chat-1", "broken", "cmpl-1", "embed-1", "chat-bad-temp", "cmpl-long", "chat-stream",
                    "cmpl-ids", None, "chat-2", "chat-n", "chat-unknown-field", "chat-long"]
    assert len(out) == len(expected_ids) == summary.total
    by_id = {}
    for row, custom_id in zip(out, expected_ids):
        if custom_id == "broken":  # the custom_id of a line that is not JSON is unknown
            assert row["custom_id"] is None
        else:
            assert row["custom_id"] == custom_id
        assert row["id"] and row["response"]["request_id"]
        by_id[custom_id] = row
    good = ["chat-1", "cmpl-1", "cmpl-ids", "chat-2", "chat-n"]
    assert summary.succeeded == len(good) and summary.failed == len(out) - len(good)

    for custom_id in good:
        row = by_id[custom_id]
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert len(body["choices"]) == (2 if custom_id == "chat-n" else 1) and body["model"] == "tiny-v4.1-short"
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0

    chat = by_id["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    choice = chat["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert "reasoning_content" not in choice["message"]  # thinking is off unless asked for
    assert choice["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 3
    assert len(choice["logprobs"]["content"]) == 3
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in choice["logprobs"]["content"])
    assert by_id["chat-2"]["response"]["body"]["usage"]["completion_tokens"] == 2
    # n = 2: one choice per sample (index 0 and 1), each its own 3 tokens, the usage counts both
    chat_n = by_id["chat-n"]["response"]["body"]
    assert [c["index"] for c in chat_n["choices"]] == [0, 1]
    assert [len(c["logprobs"]["content"]) for c in chat_n["choices"]] == [3, 3]
    assert chat_n["usage"]["completion_tokens"] == 6

    cmpl = by_id["cmpl-1"]["response"]["body"]
    assert cmpl["object"] == "text_completion" and cmpl["usage"]["prompt_tokens"] == 6  # BOS + 5
    assert cmpl["choices"][0]["finish_reason"] == "length" and cmpl["usage"]["completion_tokens"] == 4
    lp = cmpl["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == cmpl["choices"][0]["text"] or "\ufffd" in "".join(lp["tokens"])

    # the batch answers are the engine's: the same request through generate gives the same tokens
    ref = llm.generate({"prompt_token_ids": [0, 791, 6102, 294]}, SamplingParams(max_tokens=3, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert by_id["cmpl-ids"]["response"]["body"]["choices"][0]["text"] == ref.text

    errors = {
        "broken": ("line 2", "invalid JSON"),
        "embed-1": ("line 4", "url", "/v1/embeddings"),
        "chat-bad-temp": ("line 5", "temperature"),
        "cmpl-long": ("line 6", "prompt", "context"),
        "chat-stream": ("line 7", "stream"),
        None: ("line 10", "custom_id"),
        "chat-unknown-field": ("line 13", "temprature"),
        "chat-long": ("line 14", "context length"),
    }
    for custom_id, needles in errors.items():
        row = by_id[custom_id]
        assert row["response"]["status_code"] == 400 and row["response"]["body"] is None
        message = row["error"]["message"]
        for needle in needles:
            assert needle in message, (custom_id, message)
    assert by_id["chat-bad-temp"]["error"]["param"] == "temperature"
    assert not llm.engine.has_unfinished()


def test_metrics_are_exported_for_prometheus(llm, tmp_path):
    from prometheus_client import generate_latest

    from deepinfer.serve.api.batch import metrics_registry, run_batch

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("c", COMPLETIONS, {"prompt": [0, 5, 6], "max_tokens": 2, "temperature": 0}) + "\n")
    before = llm.get_metrics()
    summary = run_batch(llm, src, dst, prometheus_port=0, use_tqdm=False)  # serves while running
    assert summary.succeeded == 1
    after = llm.get_metrics()
    assert after["vllm:generation_tokens"] - before["vllm:generation_tokens"] == 2

    text = generate_latest(metrics_registry(llm)).decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        assert f"\n{name}{{" in text, name
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-v4.1-short"}' in text
    assert f'vllm:generation_tokens_total{{engine="0",model_name="tiny-v4.1-short"}} {float(after["vllm:generation_tokens"])}' in text


def test_metrics_server_answers_during_a_batch(llm, tmp_path, monkeypatch):
    import deepinfer.serve.api.batch as batch

    scraped = []
    start = batch._start_metrics_server

    def start_and_scrape(llm_, port):
        server, thread = start(llm_, port)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        scraped.append(urllib.request.urlopen(url, timeout=10).read().decode())
        return server, thread

    monkeypatch.setattr(batch, "_start_metrics_server", start_and_scrape)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("c", COMPLETIONS, {"prompt": [0, 5, 6], "max_tokens": 1, "temperature": 0}) + "\n")
    batch.run_batch(llm, src, dst, prometheus_port=0, use_tqdm=False)
    assert scraped and "vllm:num_requests_waiting" in scraped[0]


def test_response_format_and_structured_outputs_lines(llm, tmp_path):
    """A `response_format` json_schema line answers with JSON valid under its schema; a bad schema
    or regex fails its own line, naming the field, and the other lines still run."""
    import jsonschema

    from deepinfer.serve.api.batch import run_batch

    # a schema with no room for whitespace (llguidance's JSON allows it between tokens, where a
    # random model may write it until max_tokens; the engine's tests use compact JSON)
    schema = {"anyOf": [{"enum": ["alpha", "beta"]}, {"type": "integer", "minimum": 0, "maximum": 99}]}
    # (a chat response_format renders a system block: with the bundled V4 tokenizer its
    # <｜System｜> is the stand-in placeholder, `serve.text.chat.STAND_IN_SYSTEM_TOKEN`)
    rows = [
        line("chat-schema", CHAT, {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 60,
                                   "temperature": 0, "response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "n", "schema": schema}}}),
        line("schema", COMPLETIONS, {"prompt": "A city and its rank:", "max_tokens": 60, "temperature": 0,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "city", "schema": schema}}}),
        line("bad-schema", COMPLETIONS, {"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}),
        line("bad-regex", COMPLETIONS, {"prompt": "Code:", "structured_outputs": {"regex": "[0-9"}}),
        line("choice", COMPLETIONS, {"prompt": "Mood:", "max_tokens": 8, "temperature": 0,
                                     "structured_outputs": {"choice": ["happy", "sad"]}}),
        line("free", COMPLETIONS, {"prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(rows) + "\n", encoding="utf-8")
    summary = run_batch(llm, src, dst, use_tqdm=False)
    by_id = {row["custom_id"]: row for row in read(dst)}
    assert summary.succeeded == 4 and summary.failed == 2
    answer = by_id["schema"]["response"]["body"]["choices"][0]
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["text"]), schema)
    message = by_id["chat-schema"]["response"]["body"]["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), schema)
    assert by_id["choice"]["response"]["body"]["choices"][0]["text"] in ("happy", "sad")
    assert by_id["bad-schema"]["error"]["param"] == "response_format.json_schema"
    assert "strin" in by_id["bad-schema"]["error"]["message"]
    assert by_id["bad-regex"]["error"]["param"] == "structured_outputs"
    assert "line 4: structured_outputs.regex: " in by_id["bad-regex"]["error"]["message"]


def test_completion_echo_returns_the_prompt_and_its_logprobs_first(llm, tmp_path):
    """vLLM's `echo`: the prompt's text before the completion's, and with `logprobs` the prompt
    tokens' logprobs (null for the first) before the generated ones; `max_tokens: 0` with echo
    scores the prompt only. Scores and tokens are those `generate` gives the same request with
    `prompt_logprobs`."""
    from deepinfer.serve.api.batch import run_batch

    prompt, ids = "The capital of France is", [0, 791, 6102, 294, 4817]
    sampling = {"max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    rows = [
        line("plain", COMPLETIONS, {"prompt": prompt, **sampling}),
        line("echo", COMPLETIONS, {"prompt": prompt, "echo": True, **sampling}),
        line("echo-no-logprobs", COMPLETIONS, {"prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0}),
        line("score-ids", COMPLETIONS, {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1}),
        line("echo-not-bool", COMPLETIONS, {"prompt": prompt, "echo": "yes"}),
        line("zero-no-echo", COMPLETIONS, {"prompt": prompt, "max_tokens": 0}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(rows) + "\n", encoding="utf-8")
    run_batch(llm, src, dst, use_tqdm=False)
    by_id = {row["custom_id"]: row for row in read(dst)}

    echo_body = by_id["echo"]["response"]["body"]
    echo = echo_body["choices"][0]
    prompt_ids = llm.encode_prompt(prompt)
    n = len(prompt_ids)
    # the reference: the same request through generate, asking for the prompt's logprobs (a
    # scored prefill: the same programs as the echo line, so the same bits)
    ref = llm.generate({"prompt_token_ids": prompt_ids},
                       SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert echo["text"] == prompt + ref.outputs[0].text
    assert echo_body["usage"] == by_id["plain"]["response"]["body"]["usage"]  # echo adds no generated tokens
    lp = echo["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    entries = [*ref.prompt_logprobs[1:], *ref.outputs[0].logprobs]
    chosen = [*prompt_ids[1:], *ref.outputs[0].token_ids]
    assert lp["token_logprobs"][1:] == [entry[token].logprob for entry, token in zip(entries, chosen)]
    for i, entry in enumerate(entries, start=1):
        top = sorted((lp_.rank, lp_.logprob) for lp_ in entry.values() if lp_.rank <= 2)
        assert sorted(lp["top_logprobs"][i].values(), reverse=True) == [v for _, v in top]
    # text offsets index the echoed text: the prompt's tokens (BOS shows nothing), then the generated ones
    text, offsets = echo["text"], lp["text_offset"]
    assert offsets[0] == offsets[1] == 0 and offsets[n] == len(prompt)
    for i in range(1, n - 1):
        assert text[offsets[i]:offsets[i + 1]] == llm.tokenizer.decode([prompt_ids[i]])

    bare = by_id["echo-no-logprobs"]["response"]["body"]["choices"][0]
    assert bare["logprobs"] is None and bare["text"].startswith(prompt) and len(bare["text"]) > len(prompt)

    score_body = by_id["score-ids"]["response"]["body"]
    score = score_body["choices"][0]
    assert score["text"] == llm.tokenizer.decode(ids)
    assert score_body["usage"]["completion_tokens"] == 0 and score_body["usage"]["prompt_tokens"] == len(ids)
    assert len(score["logprobs"]["tokens"]) == len(ids) and score["logprobs"]["token_logprobs"][0] is None
    assert all(v <= 0 for v in score["logprobs"]["token_logprobs"][1:])

    assert by_id["echo-not-bool"]["error"]["param"] == "echo"
    assert "boolean" in by_id["echo-not-bool"]["error"]["message"]
    assert by_id["zero-no-echo"]["error"]["param"] == "max_tokens"
    assert not llm.engine.has_unfinished()
