"""`run_batch` on hostile input: every bad line is that line's error and its neighbours complete;
duplicate custom_ids, a failing engine step, and resuming an interrupted run."""

from __future__ import annotations

import io
import json
import math
import random
import sys

import pytest

from deepinfer.serve.api.batch_lines import split_lines
from deepinfer.serve.api.batch_resume import read_previous
from tests.serve.test_batch import CHAT, COMPLETIONS, line, llm, read  # noqa: F401 - llm: the shared fixture

USER = [{"role": "user", "content": "Hi"}]


def run(llm, tmp_path, rows, name="out.jsonl", **kwargs):
    from deepinfer.serve.api.batch import run_batch

    src, dst = tmp_path / "in.jsonl", tmp_path / name
    src.write_bytes(b"".join((r if isinstance(r, bytes) else r.encode()) + b"\n" for r in rows))
    return run_batch(llm, src, dst, use_tqdm=False, **kwargs), dst


def ok(row) -> bool:
    return row["error"] is None and row["response"]["status_code"] == 200


def valid(rng: random.Random, custom_id: str) -> str:
    n = rng.randint(1, 2)
    if rng.random() < 0.5:
        return line(custom_id, CHAT, {"messages": USER, "max_tokens": n, "temperature": 0})
    prompt = rng.choice(["Hello", [0, 791, 6102], "The capital of France is"])
    return line(custom_id, COMPLETIONS, {"prompt": prompt, "max_tokens": n, "temperature": rng.choice([0, 0.7]),
                                         "seed": rng.randint(0, 99)})


# field -> values of a wrong type or out of range (each must be rejected naming the field)
WRONG = {
    "max_tokens": ["10", 1.5, [], True, -1, 0, 10 ** 30, math.inf],
    "max_completion_tokens": ["10", 2.5, True, 0],
    "temperature": ["hot", [], {}, True, -0.5, math.nan, math.inf],
    "top_p": ["x", 0, 1.5, math.nan],
    "stop": [5, [1], {}, [""], True],
    "seed": ["7", 1.5, True, [1]],
    "presence_penalty": ["x", 3, -3, math.nan],
    "frequency_penalty": ["x", 2.5, math.nan],
    "logit_bias": ["x", [], {"abc": 1}, {"5": "x"}, {"-1": 1}, {"5": math.nan}],
    "n": [-1, "1", 0, 1.5],
    "top_k": ["x", 1.5, -2],
    "min_p": ["x", 2, -0.1],
    "repetition_penalty": [0, "x", -1],
    "min_tokens": [-1, "x", 1.5, 50],
    "ignore_eos": ["yes", 1],
    "stop_token_ids": [5, ["x"], [-1]],
    "include_stop_str_in_output": ["no", 0],
    "skip_special_tokens": ["no", 1],
    "spaces_between_special_tokens": [1, "x"],
    "logprobs": ["x", 2.5, [True]],
    "top_logprobs": ["x", 2.5],
}
CHAT_WRONG = {
    "messages": ["hi", [], [1], [{"role": "user", "content": 5}], [{"role": 5, "content": "x"}], [{"content": "x"}],
                [{"role": "robot", "content": "x"}], {"role": "user"}],
    "tools": ["x", [1], {"a": 1}],
    "tool_choice": [5, "sometimes"],
    "reasoning_effort": [5, "extreme"],
    "chat_template_kwargs": [[], {"foo": 1}, {"thinking": "yes"}],
    "thinking": ["yes", {"type": "maybe"}],
}
PROMPT_WRONG = [5, [], [1.5], [-1], [10 ** 9], {"a": 1}, [[1, 2], [3]], "", True]


def bad_lines(rng: random.Random, vocab: int):
    """(custom_id, raw line, needles): the error message must contain one of the needles."""
    cases = []

    def add(needles, make):
        custom_id = f"bad-{len(cases)}"
        cases.append((custom_id, make(custom_id), needles))

    for field, values in WRONG.items():
        for value in values:
            url, body = rng.choice([(CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "Hi"})])
            body = {**body, "max_tokens": 2, field: value}
            if field == "top_logprobs" and url == CHAT:
                body["logprobs"] = True
            if field in ("max_tokens", "max_completion_tokens"):
                del body["max_tokens"]
                body[field] = value
            add((field,), lambda c, url=url, body=body: line(c, url, body))
    for field, values in CHAT_WRONG.items():
        for value in values:
            add((field, "messages"),
                lambda c, f=field, v=value: line(c, CHAT, {"messages": USER, "max_tokens": 2, f: v}))
    for value in PROMPT_WRONG:
        add(("prompt",), lambda c, v=value: line(c, COMPLETIONS, {"prompt": v, "max_tokens": 2}))
    # out-of-vocabulary token ids: a line's error, from the engine's checks or from a failed step
    oov = ("outside", "vocab")
    add((*oov, "logit_bias"), lambda c: line(c, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2,
                                                              "logit_bias": {str(vocab + 7): 3}}))
    add((*oov, "logit_bias"), lambda c: line(c, CHAT, {"messages": USER, "max_tokens": 2,
                                                       "logit_bias": {str(vocab): -1}}))
    add((*oov, "stop_token_ids"), lambda c: line(c, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 1,
                                                                  "stop_token_ids": [vocab + 100]}))
    # the line itself
    for field, value in [("method", "GET"), ("url", "/v1/embeddings"), ("url", 5), ("url", ["x"]), ("body", "x"),
                         ("body", None), ("custom_id", 5), ("custom_id", None)]:
        add((field,), lambda c, f=field, v=value: json.dumps(
            {"custom_id": c, "method": "POST", "url": COMPLETIONS, "body": {"prompt": "Hi"}, f: v}))
    for field in ("custom_id", "method", "url", "body"):
        def missing(c, f=field):
            data = {"custom_id": c, "method": "POST", "url": COMPLETIONS, "body": {"prompt": "Hi"}}
            del data[f]
            return json.dumps(data)
        add((field,), missing)
    add(("prompt",), lambda c: line(c, COMPLETIONS, {"max_tokens": 2}))
    add(("messages",), lambda c: line(c, CHAT, {"max_tokens": 2}))
    add(("colour",), lambda c: json.dumps({"custom_id": c, "method": "POST", "url": CHAT, "body": {}, "colour": 1}))
    add(("temprature",), lambda c: line(c, CHAT, {"messages": USER, "temprature": 0.5}))
    add(("stream",), lambda c: line(c, COMPLETIONS, {"prompt": "Hi", "stream": True}))
    # not JSON, not an object, not UTF-8, nested too deeply (anywhere)
    add(("invalid JSON",), lambda c: line(c, CHAT, {"messages": USER})[:-3])
    add(("JSON object",), lambda c: json.dumps([c]))
    for _ in range(6):
        good = line("u", CHAT, {"messages": [{"role": "user", "content": "caf\u00e9 \u2028 ok"}]}).encode()
        at = rng.randrange(len(good))
        add(("UTF-8",), lambda c, good=good, at=at: good[:at] + rng.choice([b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80"])
            + good[at:])
    for depth in (900, 2000, 5000):  # 900 parses (limits vary with the stack); what reads it must cope
        deep = "[" * depth + "]" * depth
        add(("nested too deeply", "JSON object"), lambda c, d=deep: d)
        add(("nested too deeply", "custom_id"), lambda c, d=deep: '{"custom_id": ' + d + "}")
        for field in ("messages", "logit_bias", "stop", "tools", "url", "prompt"):
            url, body = (COMPLETIONS, {"max_tokens": 2}) if field == "prompt" else (CHAT, {"messages": USER})
            if field == "url":
                head = json.dumps({"custom_id": "", "method": "POST", "body": {}})[:-1] + ', "url": '
                add(("nested too deeply", field), lambda c, d=deep, h=head: h.replace('""', f'"{c}"') + d + "}")
            else:
                head = line("", url, body)[:-2] + f', "{field}": '
                add(("nested too deeply", field), lambda c, d=deep, h=head: h.replace('""', f'"{c}"', 1) + d + "}}")
    return cases


def test_fuzzed_lines_each_fail_alone_and_neighbours_complete(llm, tmp_path):
    rng = random.Random(12)
    cases = bad_lines(rng, llm.config.vocab_size)
    rows, expect = [], []  # expect: (custom_id or None, needles or None for a valid line)
    for custom_id, raw, needles in rng.sample(cases, len(cases)):
        if rng.random() < 0.3:
            good_id = f"good-{len(rows)}"
            rows.append(valid(rng, good_id))
            expect.append((good_id, None))
        rows.append(raw)
        expect.append((custom_id, needles))
    assert len(rows) >= 200

    summary, dst = run(llm, tmp_path, rows)
    out = read(dst)
    assert len(out) == len(rows) == summary.total
    problems = []
    for number, (row, (custom_id, needles), raw) in enumerate(zip(out, expect, rows), start=1):
        error = row["error"]
        if needles is None:
            if not (ok(row) and row["custom_id"] == custom_id
                    and row["response"]["body"]["usage"]["completion_tokens"] >= 1):
                problems.append(("a valid line failed", raw, error))
        elif error is None or row["response"]["body"] is not None or row["response"]["status_code"] not in (400, 500):
            problems.append(("a bad line ran", raw, row))
        elif not (error["message"].startswith(f"line {number}: ") and error["line"] == number
                  and any(n in error["message"] for n in needles) and row["custom_id"] in (custom_id, None)):
            problems.append((f"the error does not name {needles}", raw, error))
    assert not problems, "\n".join(f"{what}: {str(raw)[:200]} -> {str(got)[:300]}" for what, raw, got in problems)
    n_good = sum(needles is None for _, needles in expect)
    assert (summary.succeeded, summary.failed) == (n_good, len(rows) - n_good)
    assert not llm.engine.has_unfinished()


def test_out_of_vocabulary_ids_fail_their_lines_only(llm, tmp_path):
    vocab = llm.config.vocab_size
    rows = [
        line("before", COMPLETIONS, {"prompt": [0, 791, 6102], "max_tokens": 2, "temperature": 0}),
        line("bias", COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "logit_bias": {str(vocab + 3): 5}}),
        line("chat", CHAT, {"messages": USER, "max_tokens": 2, "temperature": 0}),
        line("stops", CHAT, {"messages": USER, "max_tokens": 2, "min_tokens": 2, "stop_token_ids": [1, vocab]}),
        line("after", COMPLETIONS, {"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
        line("stops-no-min", COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [vocab]}),
    ]
    summary, dst = run(llm, tmp_path, rows)
    out = {row["custom_id"]: row for row in read(dst)}
    assert [row["custom_id"] for row in read(dst)] == ["before", "bias", "chat", "stops", "after", "stops-no-min"]
    for custom_id in ("before", "chat", "after"):
        assert ok(out[custom_id]) and out[custom_id]["response"]["body"]["usage"]["completion_tokens"] == 2
    for custom_id, number, field in (("bias", 2, "logit_bias"), ("stops", 4, "stop_token_ids")):
        message = out[custom_id]["error"]["message"]
        assert message.startswith(f"line {number}: ") and any(n in message for n in ("outside", "vocab", field))
    # an out-of-vocabulary stop id is never sampled; with no min_tokens the engine may accept it or refuse it
    assert ok(out["stops-no-min"]) or "stop_token_ids" in out["stops-no-min"]["error"]["message"]
    assert summary.failed in (2, 3) and not llm.engine.has_unfinished()


def test_a_failing_engine_step_fails_only_the_line_that_causes_it(llm, tmp_path, monkeypatch):
    poison = 4242
    settle = llm.engine._settle  # reads a step's sampled tokens

    def settle_or_fail(rows):
        if any(poison in sampled.request.prompt_token_ids for sampled in rows):
            raise RuntimeError("poisoned row in the step")
        return settle(rows)

    monkeypatch.setattr(llm.engine, "_settle", settle_or_fail)
    rows = [line(f"c{i}", COMPLETIONS, {"prompt": [0, 11 + i, poison if i == 3 else 12], "max_tokens": 2,
                                        "temperature": 0}) for i in range(7)]
    summary, dst = run(llm, tmp_path, rows)
    out = read(dst)
    assert [row["custom_id"] for row in out] == [f"c{i}" for i in range(7)]
    assert out[3]["response"]["status_code"] == 500 and out[3]["error"]["type"] == "server_error"
    assert out[3]["error"]["message"] == ("line 4: the engine failed running this request: "
                                          "RuntimeError: poisoned row in the step")
    assert all(ok(row) and row["response"]["body"]["usage"]["completion_tokens"] == 2
               for i, row in enumerate(out) if i != 3)
    assert (summary.succeeded, summary.failed) == (6, 1) and not llm.engine.has_unfinished()


def test_an_output_write_error_stops_the_run(llm, tmp_path, monkeypatch):
    import deepinfer.serve.api.batch as batch

    flush = batch._OrderedWriter.flush

    def flush_then_fail(writer):
        flush(writer)
        if writer.next:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(batch._OrderedWriter, "flush", flush_then_fail)
    rows = [line(f"w{i}", COMPLETIONS, {"prompt": [0, 30 + i], "max_tokens": 2, "temperature": 0}) for i in range(3)]
    with pytest.raises(OSError, match="No space left"):  # not retried as if a step had failed
        run(llm, tmp_path, rows)
    assert not llm.engine.has_unfinished()


def test_duplicate_custom_ids_are_errors_after_the_first(llm, tmp_path):
    body = {"prompt": [0, 5, 6], "max_tokens": 1, "temperature": 0}
    rows = [line("a", COMPLETIONS, body), line("b", COMPLETIONS, body), line("a", COMPLETIONS, body),
            line("a", CHAT, {"messages": USER})]
    summary, dst = run(llm, tmp_path, rows)
    out = read(dst)
    assert [row["custom_id"] for row in out] == ["a", "b", "a", "a"]
    assert ok(out[0]) and ok(out[1])
    for number, row in ((3, out[2]), (4, out[3])):
        assert row["error"]["message"].startswith(f"line {number}: custom_id: duplicate 'a' (first used on line 1)")
        assert row["error"]["param"] == "custom_id"
    assert (summary.succeeded, summary.failed) == (2, 2)


def test_undecodable_and_deeply_nested_lines_do_not_stop_the_file(llm, tmp_path):
    good = line("good", CHAT, {"messages": [{"role": "user", "content": "caf\u00e9\u2028x"}], "max_tokens": 1})
    latin1 = b'{"custom_id": "latin-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}'
    rows = [latin1,
            '{"custom_id": "deep", "body": ' + "[" * 3000 + "]" * 3000 + "}",
            json.dumps(json.loads(good), ensure_ascii=False)]  # a raw U+2028 in a string is not a line break
    summary, dst = run(llm, tmp_path, rows)
    out = read(dst)
    assert len(out) == 3 and ok(out[2]) and out[2]["custom_id"] == "good"
    column = latin1.index(b"\xe9") + 1
    assert out[0]["error"]["message"] == (f"line 1: not valid UTF-8: byte 0xe9 at column {column} "
                                          "(invalid continuation byte)")
    assert out[1]["error"]["message"] == "line 2: invalid JSON: nested too deeply"
    assert (summary.succeeded, summary.failed) == (1, 2)


def test_standard_input_is_read_as_bytes(monkeypatch):
    from deepinfer.serve.api.batch import _read_input

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"a": 1}\n\xff\n'), encoding="utf-8"))
    assert _read_input("-") == b'{"a": 1}\n\xff\n'


def test_split_lines_reads_each_line_on_its_own():
    lines = split_lines(b"\xef\xbb\xbf{\"a\": 1}\r\n\n  \n\xff\xfe\n\"\xe2\x80\xa8\"\r\"x\"")
    assert [n for n, _ in lines] == [1, 4, 5, 6]
    assert lines[0][1] == '{"a": 1}' and lines[2][1] == '"\u2028"' and lines[3][1] == '"x"'
    assert "not valid UTF-8: byte 0xff at column 1" in str(lines[1][1])


# ---- resume --------------------------------------------------------------------------------------


def resume_rows(fixed: bool) -> list[str]:
    return [line(f"r{i}", COMPLETIONS, {"prompt": [0, 20 + i], "max_tokens": 1, "temperature": 0})
            if i != 2 or fixed else line("r2", COMPLETIONS, {"prompt": [0, 22], "max_tokens": 0})
            for i in range(5)]


def test_resume_keeps_done_lines_and_reruns_errors_and_a_truncated_line(llm, tmp_path):
    from deepinfer.serve.api.batch import read_previous as previous_of

    summary, dst = run(llm, tmp_path, resume_rows(fixed=False))
    assert (summary.succeeded, summary.failed) == (4, 1)
    first = dst.read_bytes().splitlines()
    # an interrupted run: r0 and r1 written, r2's error line, then half of r3's line
    dst.write_bytes(b"\n".join(first[:3]) + b"\n" + first[3][: len(first[3]) // 2])
    previous = previous_of(dst)
    assert previous.done_ids == {"r0", "r1"} and previous.dropped == 2

    summary, dst = run(llm, tmp_path, resume_rows(fixed=True), previous=previous)
    assert (summary.total, summary.succeeded, summary.failed, summary.skipped) == (3, 3, 0, 2)
    out = dst.read_bytes().splitlines()
    assert out[:2] == first[:2]  # the earlier results are kept as they were
    rows = [json.loads(r) for r in out]
    assert [r["custom_id"] for r in rows] == ["r0", "r1", "r2", "r3", "r4"] and all(ok(r) for r in rows)

    # resuming a finished run runs nothing and changes nothing
    summary, dst = run(llm, tmp_path, resume_rows(fixed=True), previous=previous_of(dst))
    assert (summary.total, summary.skipped) == (0, 5) and dst.read_bytes().splitlines() == out


def test_resume_without_an_output_file_runs_everything(llm, tmp_path):
    previous = read_previous(tmp_path / "none.jsonl")
    summary, dst = run(llm, tmp_path, resume_rows(fixed=True)[:2], name="none.jsonl", previous=previous)
    assert (summary.succeeded, summary.skipped) == (2, 0) and len(read(dst)) == 2


def test_read_previous_refuses_a_file_that_is_not_batch_output(tmp_path):
    result = {"id": "x", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(result) + "\nnot json\n" + json.dumps(result) + "\n")
    with pytest.raises(ValueError, match=r"out.jsonl: line 2 is not a run-batch result line"):
        read_previous(path)
    path.write_text(json.dumps({"a": 1}) + "\n" + json.dumps(result) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        read_previous(path)
    path.write_text(json.dumps(result) + "\n\n" + json.dumps(result)[:-1])  # truncated last line: dropped
    assert read_previous(path).done_ids == {"a"} and read_previous(path).dropped == 1
