"""The gRPC server (`deepinfer serve`), in-process on 127.0.0.1 with the tiny model: the stubs,
generation, abort and cancellation, malformed and fuzzed requests, warm-up (`grpc_harness.py`
holds the shared server; health, drain, auth, TLS, limits and the command: test_grpc_operations).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.engine import LLMEngine
from deepinfer.serve.grpc import deepinfer_engine_pb2 as pb
from deepinfer.serve.grpc import deepinfer_engine_pb2_grpc as pb_grpc
from deepinfer.serve.grpc.server import SERVICE_NAME, LoadedModel, ServerSettings, ServerThread
from tests.serve.compilations import WARM_ENGINE, counting_compiles
from tests.serve.grpc_harness import (BUDGET, GRPC_DIR, cache_state, collect, health_status, list_services, make_engine,
                                      prompt_ids, request, slow_steps, wait_released)
from tests.serve.grpc_harness import model, server, channel, stub, reference  # noqa: F401 - the shared fixtures


# ---- stubs ------------------------------------------------------------------------------------


# The generators stamp their own versions into the stubs (grpcio-tools: the lowest grpcio the
# stubs accept; protoc: the protobuf they were made for). A newer patch release of the tools
# changes only these: the stubs still match the proto, so the comparison leaves them out.
_TOOL_VERSIONS = (re.compile(r"GRPC_GENERATED_VERSION = '[0-9.]+'"),
                  re.compile(r"# Protobuf Python Version: [0-9.]+"),
                  re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
                             r"\s*\d+,\s*\d+,\s*\d+,"))


def _without_tool_versions(text: str) -> str:
    for pattern in _TOOL_VERSIONS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "<version>", text)
    return text


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    stage = tmp_path / "deepinfer" / "serve" / "grpc"
    stage.mkdir(parents=True)
    shutil.copy(GRPC_DIR / "deepinfer_engine.proto", stage)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", "deepinfer/serve/grpc/deepinfer_engine.proto"],
                   cwd=tmp_path, check=True)
    for name in ("deepinfer_engine_pb2.py", "deepinfer_engine_pb2.pyi", "deepinfer_engine_pb2_grpc.py"):
        made, committed = (stage / name).read_text(), (GRPC_DIR / name).read_text()
        assert _without_tool_versions(made) == _without_tool_versions(committed), f"{name} is stale: run regenerate.sh"
    # the committed stubs accept every grpcio that pyproject.toml allows
    floor = re.search(r'"grpcio>=([0-9.]+)"', (GRPC_DIR.parents[1] / "pyproject.toml").read_text()).group(1)
    stubs = (GRPC_DIR / "deepinfer_engine_pb2_grpc.py").read_text()
    stamped = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", stubs)
    assert tuple(map(int, stamped.group(1).split("."))) <= tuple(map(int, floor.split("."))), (stamped.group(1), floor)
    assert "from deepinfer.serve.grpc import deepinfer_engine_pb2" in (GRPC_DIR / "deepinfer_engine_pb2_grpc.py").read_text()


def test_sglang_field_numbers():
    sp = pb.SamplingParams.DESCRIPTOR.fields_by_name
    for name, number in (("temperature", 1), ("top_p", 2), ("top_k", 3), ("min_p", 4), ("frequency_penalty", 5),
                         ("presence_penalty", 6), ("repetition_penalty", 7), ("max_new_tokens", 8), ("stop", 9),
                         ("stop_token_ids", 10), ("logit_bias", 22)):
        assert sp[name].number == number
    for name in ("temperature", "top_p", "top_k", "seed", "max_new_tokens"):
        assert sp[name].has_presence, name
    req = pb.GenerateRequest.DESCRIPTOR
    assert [f.name for f in req.oneofs_by_name["input"].fields] == ["tokenized", "text", "chat"]
    assert [req.fields_by_name[n].number for n in ("request_id", "tokenized", "sampling_params", "stream",
                                                  "text", "chat")] == [1, 2, 4, 17, 18, 19]
    resp = pb.GenerateResponse.DESCRIPTOR.fields_by_name
    assert (resp["chunk"].number, resp["complete"].number, resp["error"].number) == (2, 3, 4)
    done = pb.GenerateComplete.DESCRIPTOR.fields_by_name
    assert (done["output_ids"].number, done["finish_reason"].number, done["matched_token_id"].number,
            done["matched_stop_str"].number) == (1, 2, 8, 9)


# ---- generation -------------------------------------------------------------------------------


def test_streaming_generate_equals_the_engine(server, stub, reference, model):
    config, _, tokenizer = model
    ids = prompt_ids(20, 1)
    req = request(ids, temperature=0.75, top_k=50, seed=7, max_new_tokens=12, ignore_eos=True)
    # the generated tokens' logprobs only (SGLang's router sends -1 too: 0 would add the prompt's)
    req.return_logprob, req.top_logprobs_num, req.logprob_start_len = True, 2, -1
    chunks, complete, error = collect(stub, req)
    assert error is None and complete is not None
    ref = reference(ids, SamplingParams(temperature=0.75, top_k=50, seed=7, max_tokens=12, ignore_eos=True,
                                        logprobs=2)).outputs[0]
    assert list(complete.output_ids) == ref.token_ids and len(ref.token_ids) == 12
    assert complete.text == ref.text and complete.finish_reason == ref.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(ids), 12)
    # the stream: one token per chunk, cumulative counts, text deltas adding up
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert [c.completion_tokens for c in chunks] == list(range(1, 13))
    assert all(c.prompt_tokens == len(ids) for c in chunks)
    assert "".join(c.text for c in chunks) == ref.text
    # logprobs (vLLM semantics: raw logprob of the sampled token, top-2 alternatives best first)
    lp = complete.output_logprobs
    assert list(lp.token_ids) == ref.token_ids
    expected = [entry[t].logprob for entry, t in zip(ref.logprobs, ref.token_ids)]
    np.testing.assert_allclose(lp.token_logprobs, expected, rtol=1e-5, atol=1e-5)
    for top, entry in zip(lp.top_logprobs, ref.logprobs):
        best = sorted((v.rank, t) for t, v in entry.items() if v.rank <= 2)
        assert list(top.token_ids) == [t for _, t in best] and len(top.values) == 2
        assert top.values[0] >= top.values[1]
    assert sum(len(c.output_logprobs.token_ids) for c in chunks) == 12

    # non-streaming, text input, greedy: only the completion, equal to the engine's
    text = "The capital of France is"
    chunks, complete, _ = collect(stub, request(text=text, stream=False, temperature=0.0, max_new_tokens=6,
                                                ignore_eos=True))
    text_ids = [config.bos_token_id, *tokenizer.encode(text, add_special_tokens=False).ids]
    ref = reference(text_ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).outputs[0]
    assert chunks == [] and list(complete.output_ids) == ref.token_ids and complete.text == ref.text
    assert complete.prompt_tokens == len(text_ids)
    wait_released(server)


def test_n_samples_stream_and_complete_by_index(server, stub, reference):
    """n = 3 (SGLang's per-sample messages): each sample's chunks carry its index and add up to its
    completion; one GenerateComplete per sample, in index order, equal to the engine's samples
    (seed + i); without streaming just the completions."""
    ids = prompt_ids(16, 5)
    sampling = dict(temperature=0.9, seed=11, max_new_tokens=6, ignore_eos=True)
    ref = reference(ids, SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=6, ignore_eos=True)).outputs
    for stream in (True, False):
        responses = list(stub.Generate(request(ids, stream=stream, n=3, **sampling), timeout=120.0))
        kinds = [r.WhichOneof("response") for r in responses]
        assert kinds == ["chunk"] * kinds.count("chunk") + ["complete"] * 3, kinds
        completes = [r.complete for r in responses[-3:]]
        assert [c.index for c in completes] == [0, 1, 2]
        assert [list(c.output_ids) for c in completes] == [c.token_ids for c in ref]
        assert [c.text for c in completes] == [c.text for c in ref]
        chunks = [r.chunk for r in responses[:-3]]
        assert (len(chunks) > 0) == stream
        for i, completion in enumerate(ref):
            mine = [c for c in chunks if c.index == i]
            assert [t for c in mine for t in c.token_ids] == (completion.token_ids if stream else [])
    wait_released(server)


def test_constrained_generate(server, stub):
    """A choice and a regex constraint come back complete and valid (JSON Schemas: the engine's
    tests and `_bad_cases`)."""
    req = request(prompt_ids(10, 3), temperature=0.0, max_new_tokens=20)
    req.sampling_params.choice.choices.extend(["red", "green", "blue"])
    _, complete, error = collect(stub, req)
    assert error is None and complete.finish_reason == "stop" and complete.text in ("red", "green", "blue")
    req = request(prompt_ids(14, 4), temperature=0.7, seed=1, max_new_tokens=40)
    req.sampling_params.regex = "[0-9]{2}-(yes|no)"
    _, complete, error = collect(stub, req)
    assert error is None and complete.finish_reason == "stop"
    assert re.fullmatch("[0-9]{2}-(yes|no)", complete.text), complete.text
    wait_released(server)


def test_stop_token_and_stream_interval(server, stub, reference):
    ids = prompt_ids(12, 2)
    free = reference(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)).outputs[0].token_ids
    stop_at = free[4]
    chunks, complete, _ = collect(stub, request(ids, temperature=0.0, max_new_tokens=8, ignore_eos=True,
                                                stop_token_ids=[stop_at], stream_interval=2))
    n = free.index(stop_at) + 1
    assert list(complete.output_ids) == free[:n]
    assert complete.finish_reason == "stop" and complete.WhichOneof("matched_stop") == "matched_token_id"
    assert complete.matched_token_id == stop_at
    assert all(len(c.token_ids) == 2 for c in chunks[:-1]) and [t for c in chunks for t in c.token_ids] == free[:n]

    # a stop string: cut from the text, reported as matched_stop_str
    tokenizer = server.server.engine.tokenizer
    free_text = tokenizer.decode(free, skip_special_tokens=True)
    k, stop = next((k, tokenizer.decode([t]).strip()) for k, t in enumerate(free) if k >= 2
                   and len(tokenizer.decode([t]).strip()) >= 3
                   and tokenizer.decode([t]).strip() not in tokenizer.decode(free[:k]))
    _, complete, _ = collect(stub, request(ids, temperature=0.0, max_new_tokens=8, ignore_eos=True, stop=[stop]))
    assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
    assert complete.text == free_text[:free_text.index(stop)] and list(complete.output_ids) == free[:k + 1]

    # detokenize off: token ids only
    chunks, complete, _ = collect(stub, request(ids, temperature=0.0, max_new_tokens=3, ignore_eos=True,
                                                detokenize=False))
    assert list(complete.output_ids) == free[:3] and complete.text == "" and all(c.text == "" for c in chunks)


def test_chat_input_and_tokenize(server, stub, model):
    config, _, tokenizer = model
    from deepinfer.serve.text.chat import prepare_chat

    messages = [{"role": "user", "content": "Say hi"}]
    chat = pb.ChatInput(messages_json=json.dumps(messages), thinking_mode=pb.THINKING_MODE_DISABLED)
    expected = prepare_chat(messages, model_type=config.model_type, tokenizer=tokenizer, thinking=False)
    tok = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
    assert list(tok.input_ids) == expected.token_ids and tok.count == len(expected.token_ids)
    assert tok.prompt == expected.prompt and tok.max_context_length == BUDGET.max_model_len
    tok = stub.Tokenize(pb.TokenizeRequest(text="hello world"), timeout=30)
    assert list(tok.input_ids) == [config.bos_token_id, *tokenizer.encode("hello world", add_special_tokens=False).ids]

    req = pb.GenerateRequest(chat=chat, stream=True,
                             sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    chunks, complete, error = collect(stub, req)
    assert error is None and complete.prompt_tokens == len(expected.token_ids)
    assert complete.completion_tokens == 5 and complete.HasField("chat")
    assert not complete.chat.HasField("reasoning_content") and complete.reasoning_tokens == 0
    assert "".join(c.text for c in chunks) == complete.text


def test_model_and_server_info(server, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.served_model_name == "tiny-v4.1-test" and info.model_type == "deepseek_v41"
    assert (info.max_context_length, info.max_req_input_len, info.vocab_size) == (512, 511, 129280)
    assert list(info.eos_token_ids) == [1] and info.bos_token_id == 0 and info.is_generation
    s = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert s.serving_status == "SERVING" and not s.is_paused and s.server_type == "grpc"
    assert (s.total_slots, s.total_pages) == (4, 32)
    assert s.server_args["server"]["host"] == "127.0.0.1"
    metrics = s.scheduler_info["metrics"]
    assert metrics["vllm:generation_tokens"] > 0
    assert metrics["vllm:time_to_first_token_seconds"]["count"] > 0
    assert metrics["vllm:request_success"]["length"] > 0
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=30)
    assert health.healthy and health.message == "serving"


def test_reflection_lists_the_services(server, channel):
    names = list_services(channel)
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(iter(refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)]), timeout=30)))
    assert resp.file_descriptor_response.file_descriptor_proto


# ---- abort and cancellation -------------------------------------------------------------------


def test_abort_rpc_releases_the_cache(server, stub):
    wait_released(server)
    before = cache_state(server)
    with slow_steps(server, 0.02):
        call = stub.Generate(request(prompt_ids(10, 3), rid="to-abort", temperature=0.0, max_new_tokens=50,
                                     ignore_eos=True), timeout=60)
        first = next(call)
        assert first.WhichOneof("response") == "chunk" and first.request_id == "to-abort"
        assert cache_state(server)[0] < before[0]  # it holds a page
        assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).success
        rest = list(call)
    assert rest[-1].WhichOneof("response") == "complete" and rest[-1].complete.finish_reason == "abort"
    assert len(rest[-1].complete.output_ids) < 50
    wait_released(server)
    assert cache_state(server) == before
    assert not stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=10).success


def test_client_cancellation_releases_the_cache(server, stub):
    wait_released(server)
    before = cache_state(server)
    with slow_steps(server, 0.02):
        calls = [stub.Generate(request(prompt_ids(8, 10 + i), temperature=0.0, max_new_tokens=50, ignore_eos=True),
                               timeout=60) for i in range(3)]
        for call in calls:
            assert next(call).WhichOneof("response") == "chunk"
        assert cache_state(server)[1] == before[1] - 3  # three slots held
        for call in calls:
            call.cancel()
        t0 = time.monotonic()
        wait_released(server, timeout=10)
        released_in = time.monotonic() - t0
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    assert cache_state(server) == before
    assert released_in < 5.0


def test_failure_mid_stream_is_reported_in_band(server, stub):
    engine = server.server.engine
    original = engine.step
    calls = {"n": 0}

    def failing():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return original()

    engine.step = failing
    try:
        chunks, complete, error = collect(stub, request(prompt_ids(8, 4), temperature=0.0, max_new_tokens=20,
                                                        ignore_eos=True))
    finally:
        del engine.step
    assert complete is None and error is not None
    assert "injected step failure" in error.message and error.http_status_code == "500"
    wait_released(server)
    _, complete, error = collect(stub, request(prompt_ids(8, 4), temperature=0.0, max_new_tokens=3))
    assert error is None and complete.completion_tokens == 3  # the server keeps serving


def test_an_engine_that_keeps_failing_goes_not_serving(model):
    with ServerThread(lambda: make_engine(model), ServerSettings(port=0, warmup=False)) as srv:
        assert srv.wait_ready(300)
        engine = srv.server.engine

        def broken():
            raise RuntimeError("device lost")

        engine.step = broken
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = pb_grpc.LlmEngineStub(ch)
            for i in range(3):
                _, complete, error = collect(stub, request(prompt_ids(8, i), max_new_tokens=2))
                assert complete is None and "device lost" in error.message
            deadline = time.monotonic() + 10
            while health_status(ch) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, request(prompt_ids(8, 9), max_new_tokens=2))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "device lost" in e.value.details()
        del engine.step
        assert engine.cache.pages.free == engine.cache.layout.num_pages


# ---- malformed requests -------------------------------------------------------------------------


def test_input_logprobs_are_the_engines_prompt_logprobs(server, stub, reference):
    """SGLang's input logprobs: with return_logprob and logprob_start_len 0 (the proto default),
    every prompt token's logprob (none for the first) and top alternatives, those of the engine's
    `prompt_logprobs`; from a later position, the same values from there; -1: none."""
    ids = prompt_ids(40, 3)
    ref = reference(ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2,
                                        prompt_logprobs=2))
    req = request(ids, temperature=0.0, max_new_tokens=4, ignore_eos=True, stream=False)
    req.return_logprob, req.top_logprobs_num = True, 2
    _, complete, error = collect(stub, req)
    assert error is None and list(complete.output_ids) == ref.outputs[0].token_ids
    got = complete.input_logprobs
    assert list(got.token_ids) == ids and len(got.token_logprobs) == len(got.top_logprobs) == 40
    assert not got.token_logprobs[0].HasField("value") and not got.top_logprobs[0].values
    for p in range(1, 40):
        entry = ref.prompt_logprobs[p]
        assert got.token_logprobs[p].value == np.float32(entry[ids[p]].logprob), p
        best = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= 2)
        assert list(got.top_logprobs[p].token_ids) == [t for _, t, _ in best], p
        assert list(got.top_logprobs[p].values) == [np.float32(v) for *_, v in best], p

    req.logprob_start_len = 25
    _, later, _ = collect(stub, req)
    assert list(later.input_logprobs.token_ids) == ids[25:]
    assert [v.value for v in later.input_logprobs.token_logprobs] == [v.value for v in got.token_logprobs[25:]]
    req.logprob_start_len = -1
    _, none, _ = collect(stub, req)
    assert not none.HasField("input_logprobs") and len(none.output_logprobs.token_ids) == 4


def _bad_cases(vocab: int):
    """(label, mutate(request), field named in the INVALID_ARGUMENT details)."""
    def sp(**kw):
        def mutate(req):
            for k, v in kw.items():
                if k == "logit_bias":
                    req.sampling_params.logit_bias.update(v)
                elif isinstance(v, list):
                    getattr(req.sampling_params, k).extend(v)
                else:
                    setattr(req.sampling_params, k, v)
        return mutate

    def set_input(kind, value):
        def mutate(req):
            if kind == "none":
                req.ClearField("tokenized")
            elif kind == "tokenized":
                req.tokenized.ClearField("input_ids")
                req.tokenized.input_ids.extend(value)
            elif kind == "text":
                req.text = value
            else:
                req.chat.messages_json = value
        return mutate

    def top(n):
        def mutate(req):
            req.return_logprob, req.top_logprobs_num = True, n
        return mutate

    def start(value):
        def mutate(req):
            req.return_logprob, req.logprob_start_len = True, value
        return mutate

    def tools(value):
        def mutate(req):
            req.chat.messages_json = '[{"role": "user", "content": "hi"}]'
            req.chat.tools_json = value
        return mutate

    def rid(value):
        def mutate(req):
            req.request_id = value
        return mutate

    return [
        ("negative max_new_tokens", sp(max_new_tokens=-1), "sampling_params.max_new_tokens"),
        ("zero max_new_tokens", sp(max_new_tokens=0), "sampling_params.max_new_tokens"),
        ("negative temperature", sp(temperature=-1.0), "sampling_params.temperature"),
        ("nan temperature", sp(temperature=float("nan")), "sampling_params.temperature"),
        ("top_p 2", sp(top_p=2.0), "sampling_params.top_p"),
        ("top_p 0", sp(top_p=0.0), "sampling_params.top_p"),
        ("top_k -5", sp(top_k=-5), "sampling_params.top_k"),
        ("min_p 3", sp(min_p=3.0), "sampling_params.min_p"),
        ("presence 9", sp(presence_penalty=9.0), "sampling_params.presence_penalty"),
        ("repetition -1", sp(repetition_penalty=-1.0), "sampling_params.repetition_penalty"),
        ("n -1", sp(n=-1), "sampling_params.n"),
        ("min over max", sp(max_new_tokens=2, min_new_tokens=5), "sampling_params.min_new_tokens"),
        ("empty stop string", sp(stop=[""]), "sampling_params.stop"),
        ("stop id outside vocab", sp(stop_token_ids=[vocab + 5]), "sampling_params.stop_token_ids"),
        ("unknown logit bias id", sp(logit_bias={str(vocab + 1): 2.0}), "sampling_params.logit_bias"),
        ("non-integer logit bias id", sp(logit_bias={"abc": 2.0}), "sampling_params.logit_bias"),
        ("infinite logit bias", sp(logit_bias={"5": float("inf")}), "sampling_params.logit_bias"),
        ("regex that does not compile", sp(regex="a["), "sampling_params.regex"),
        ("json_schema not JSON", sp(json_schema="{"), "sampling_params.json_schema"),
        ("json_schema of an unknown type", sp(json_schema='{"type": "strin"}'), "sampling_params.json_schema"),
        ("structural_tag", sp(structural_tag="{}"), "sampling_params.structural_tag"),
        ("stream_interval 0", sp(stream_interval=0), "sampling_params.stream_interval"),
        ("unknown cache TTL class", sp(cache_ttl_class="weekly"), "sampling_params.cache_ttl_class"),
        ("too many logprobs", top(50), "top_logprobs_num"),
        ("logprob_start_len -2", start(-2), "logprob_start_len"),
        ("logprob_start_len at the prompt's end", start(8), "logprob_start_len"),
        ("no input", set_input("none", None), "input"),
        ("empty token ids", set_input("tokenized", []), "tokenized.input_ids"),
        ("id outside vocab", set_input("tokenized", [0, vocab]), "tokenized.input_ids"),
        ("prompt beyond the context", set_input("tokenized", [0] + [100] * 600), "tokenized.input_ids"),
        ("prompt at the context", set_input("tokenized", [0] + [100] * 511), "tokenized.input_ids"),
        ("empty text", set_input("text", ""), "text"),
        ("text beyond the context", set_input("text", "word " * 2000), "text"),
        ("chat not JSON", set_input("chat", "[{"), "chat.messages_json"),
        ("chat not a list", set_input("chat", '{"role": "user"}'), "chat.messages_json"),
        ("chat bad role", set_input("chat", '[{"role": "wizard", "content": "x"}]'), "chat"),
        ("chat nested 2000 deep", set_input("chat", "[" * 2000 + "]" * 2000), "chat.messages_json"),
        ("chat unclosed nesting", set_input("chat", "[" * 2000), "chat.messages_json"),
        ("chat nested past the limit", set_input("chat", '[{"role": "user", "content": "x", "a": '
                                                 + "[" * 70 + "]" * 70 + "}]"), "chat.messages_json"),
        ("tools nested 2000 deep", tools('[{"a": ' * 1000 + "1" + "}]" * 1000), "chat.tools_json"),
        ("text over the byte bound", set_input("text", "a" * (512 * 128 + 1)), "text"),
        ("request_id over 256 bytes", rid("r" * 257), "request_id"),
        ("request_id with a line break", rid("a\nb"), "request_id"),
    ]


def _good_base(ids):
    return request(ids, temperature=0.5, seed=11, max_new_tokens=4)


def test_malformed_requests_get_invalid_argument_and_leave_a_good_stream_alone(server, stub, channel, reference,
                                                                               model):
    config = model[0]
    good_ids = prompt_ids(16, 5)
    good_params = SamplingParams(temperature=0.25, top_p=0.9, seed=123, max_tokens=40, ignore_eos=True)
    expected = reference(good_ids, good_params).outputs[0]
    result = {}

    def good_stream():
        result["out"] = collect(stub, request(good_ids, temperature=0.25, top_p=0.9, seed=123, max_new_tokens=40,
                                              ignore_eos=True))
        result["done_at"] = time.monotonic()

    cases = _bad_cases(config.vocab_size)
    rng = random.Random(0)
    fuzzed = []
    for _ in range(20):  # random pairs of bad fields: either may be named
        a, b = rng.sample(cases, 2)
        fuzzed.append((f"{a[0]} + {b[0]}", (a[1], b[1]), (a[2], b[2])))
    raw_generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate", request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)
    bad_utf8 = bytes([0x92, 0x01, 0x03]) + b"\xff\xfeA"  # field 18 (text), 3 bytes of invalid UTF-8

    hold = threading.Event()
    with slow_steps(server, 0.02, hold):
        worker = threading.Thread(target=good_stream)
        worker.start()
        time.sleep(0.3)  # the good stream is in flight (40 tokens need at least 0.8 s)
        hold.set()
        sent_until = None
        for label, mutate, field in cases:
            req = _good_base(prompt_ids(8, 6))
            mutate(req)
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, e.value.code(), e.value.details())
            assert e.value.details().startswith(field + ":"), (label, e.value.details())
        for label, mutates, fields in fuzzed:
            req = _good_base(prompt_ids(8, 7))
            for m in mutates:
                m(req)
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, e.value.details())
            assert e.value.details().split(":")[0] in fields, (label, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            list(raw_generate(bad_utf8, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request:")
        sent_until = time.monotonic()
        hold.clear()
        worker.join(120)
    assert result["done_at"] > sent_until, "the bad requests must overlap the good stream"
    chunks, complete, error = result["out"]
    assert error is None and list(complete.output_ids) == expected.token_ids and complete.text == expected.text
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    wait_released(server)
    assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).active_requests == 0


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(model):
    from deepinfer.serve.grpc import convert

    config, _, tokenizer = model
    per_token = convert.max_token_bytes(tokenizer)
    assert per_token == 128  # the longest entry of the pinned DeepSeek vocabulary

    class Untouchable:
        def encode(self, *args, **kwargs):
            raise AssertionError("the text was tokenized")

    kw = dict(tokenizer=Untouchable(), config=config, max_len=512, max_token_bytes=per_token)
    with pytest.raises(convert.InvalidArgument, match=r"^text: text of 4194305 bytes cannot fit the context of "
                                                      r"512 tokens \(at most 65536 bytes"):
        convert.prompt_from_input("text", "a" * (4 * 2 ** 20 + 1), **kw)
    with pytest.raises(convert.InvalidArgument, match="^text: text of 65538 bytes"):  # 2-byte characters
        convert.prompt_from_input("text", "é" * 32769, **kw)
    huge_user = pb.ChatInput(messages_json=json.dumps([{"role": "user", "content": "x" * 70000}]))
    with pytest.raises(convert.InvalidArgument, match="^chat.messages_json: the system and user messages of 70000"):
        convert.prompt_from_input("chat", huge_user, **kw)
    # at the bound the tokenizer decides (65536 bytes could be 512 tokens of 128 bytes)
    with pytest.raises(convert.InvalidArgument, match="^text: prompt of .* tokens does not fit"):
        convert.prompt_from_input("text", "a" * 65536, **{**kw, "tokenizer": tokenizer})


_METHODS = {"Generate": True, "Abort": False, "HealthCheck": False, "GetModelInfo": False,
            "GetServerInfo": False, "Tokenize": False}  # name -> server streaming


def _fuzz_cases(rng: random.Random, vocab: int):
    """(label, method, request bytes, expected field or None for "any clean status")."""
    cases = []
    for i in range(150):  # raw bytes: grpc/protobuf parse errors or requests that happen to parse
        data = rng.randbytes(rng.choice([0, 1, 2, 3, 8, 32, 200]))
        cases.append((f"raw bytes {i}", rng.choice(list(_METHODS)), data, None))
    bad = _bad_cases(vocab)
    for i in range(100):  # wrong types / values in one to three fields of a Generate request
        picked = rng.sample(bad, rng.randint(1, 3))
        req = _good_base(prompt_ids(8, 7))
        for _, mutate, _ in picked:
            mutate(req)
        cases.append((" + ".join(p[0] for p in picked), "Generate", req.SerializeToString(), {p[2] for p in picked}))
    huge_rid = "x" * (1 << 20)
    deep = "[" * 2000
    for label, method, msg, field in (
            ("1 MB request_id", "Generate", request(prompt_ids(8, 1), rid=huge_rid, max_new_tokens=2), "request_id"),
            ("1 MB request_id abort", "Abort", pb.AbortRequest(request_id=huge_rid), "request_id"),
            ("control request_id abort", "Abort", pb.AbortRequest(request_id="a\x00b"), "request_id"),
            ("4 MB text", "Generate", request(text="ab " * ((4 << 20) // 3), max_new_tokens=2), "text"),
            ("4 MB text tokenize", "Tokenize", pb.TokenizeRequest(text="é" * (2 << 20)), "text"),
            ("deep chat tokenize", "Tokenize", pb.TokenizeRequest(chat=pb.ChatInput(messages_json=deep)),
             "chat.messages_json"),
            ("deep tools tokenize", "Tokenize", pb.TokenizeRequest(chat=pb.ChatInput(
                messages_json='[{"role": "user", "content": "x"}]', tools_json=deep)), "chat.tools_json"),
            ("no tokenize input", "Tokenize", pb.TokenizeRequest(), "input"),
            ("bad thinking mode", "Tokenize", pb.TokenizeRequest(chat=pb.ChatInput(
                messages_json='[{"role": "user", "content": "x"}]', thinking_mode=7)), "chat.thinking_mode")):
        cases.append((label, method, msg.SerializeToString(), {field}))
    rng.shuffle(cases)
    return cases


def test_fuzzed_requests_get_clean_statuses_and_the_server_keeps_serving(server, stub, channel, reference, model):
    """A few hundred seeded bad requests to every method, while a good stream is in flight: each
    gets OK or INVALID_ARGUMENT naming a field, quickly; the good stream is unharmed."""
    good_ids = prompt_ids(16, 9)
    expected = reference(good_ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)).outputs[0]
    result = {}

    def good_stream():
        result["out"] = collect(stub, request(good_ids, temperature=0.0, max_new_tokens=40, ignore_eos=True))
        result["done_at"] = time.monotonic()

    calls = {name: (channel.unary_stream if streaming else channel.unary_unary)(
        f"/{SERVICE_NAME}/{name}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for name, streaming in _METHODS.items()}
    cases = _fuzz_cases(random.Random(1234), model[0].vocab_size)
    assert len(cases) > 250
    codes = {}
    hold = threading.Event()
    with slow_steps(server, 0.02, hold):
        worker = threading.Thread(target=good_stream)
        worker.start()
        time.sleep(0.3)  # the good stream is in flight (40 tokens need at least 0.8 s)
        hold.set()
        for label, method, data, fields in cases:
            started = time.monotonic()
            try:
                reply = calls[method](data, timeout=60)
                if _METHODS[method]:
                    list(reply)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
            codes[code] = codes.get(code, 0) + 1
            assert time.monotonic() - started < 10 or code == grpc.StatusCode.OK, (label, "slow rejection")
            if fields is None:  # raw bytes: parsed and answered, or refused as unparsable / invalid
                assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (label, code, details)
                if code != grpc.StatusCode.OK:
                    assert details.split(":")[0].replace("_", "").replace(".", "").isalnum(), (label, details)
            else:
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (label, code, details[:200])
                assert details.split(":")[0] in fields, (label, details[:200])
                assert len(details) < 2000, (label, "the details echo the input")
        sent_until = time.monotonic()
        hold.clear()
        worker.join(120)
    assert codes[grpc.StatusCode.INVALID_ARGUMENT] > 200 and set(codes) <= {grpc.StatusCode.OK,
                                                                             grpc.StatusCode.INVALID_ARGUMENT}
    assert result["done_at"] > sent_until, "the bad requests must overlap the good stream"
    chunks, complete, error = result["out"]
    assert error is None and list(complete.output_ids) == expected.token_ids
    wait_released(server)
    assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    _, complete, error = collect(stub, request(prompt_ids(8, 2), temperature=0.0, max_new_tokens=2))
    assert error is None and complete.completion_tokens == 2


def test_duplicate_request_id_is_refused(server, stub):
    with slow_steps(server, 0.02):
        call = stub.Generate(request(prompt_ids(8, 8), rid="dup", temperature=0.0, max_new_tokens=30,
                                     ignore_eos=True), timeout=60)
        next(call)
        with pytest.raises(grpc.RpcError) as e:
            collect(stub, request(prompt_ids(8, 8), rid="dup", max_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        call.cancel()
    wait_released(server)


@pytest.mark.slow
def test_warmup_compiles_before_serving(model):
    """SERVING (and warmup_complete) only once every shape is compiled; then a prompt that crosses
    a page bucket, greedy and sampled, compiles nothing."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, WARM_ENGINE)
    proceed = threading.Event()
    original_run = engine.runner.run

    def gated_run(*args, **kwargs):  # hold the warm-up at its first shape until the checks are done
        assert proceed.wait(120)
        return original_run(*args, **kwargs)

    engine.runner.run = gated_run
    srv = ServerThread(LoadedModel(engine, model_name="warm"), ServerSettings(port=0))
    try:
        with counting_compiles() as compiles:
            port = srv.start()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.LlmEngineStub(ch)
                info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
                deadline = time.monotonic() + 60
                while info.warmup_shapes_total == 0:  # the driver is still building the engine's limits
                    assert time.monotonic() < deadline
                    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
                assert not info.warmup_complete and (info.warmup_shapes_done, info.warmup_shapes_total) == (0, 6)
                assert health_status(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
                proceed.set()
                assert srv.wait_ready(600), srv.server.load_error
                del engine.runner.run
                info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
                assert info.warmup_complete and info.warmup_shapes_done == info.warmup_shapes_total == 6
                assert (info.free_pages, info.free_slots) == (info.total_pages, info.total_slots)
                assert engine.stats["steps"] == 0 and srv.server.metrics.snapshot()["vllm:prompt_tokens"] == 0
                compiles.clear()
                for seed, sampling in ((1, dict(temperature=0.0)), (2, dict(temperature=0.7, seed=5)),
                                       (3, dict(temperature=0.7, top_p=0.9, top_k=20))):
                    _, complete, error = collect(stub, request(prompt_ids(60, seed), max_new_tokens=20,
                                                               ignore_eos=True, **sampling))
                    assert error is None and complete.completion_tokens == 20  # ends on the second page
                assert compiles == [], f"{len(compiles)} compilation(s) after the warm-up"
    finally:
        proceed.set()
        srv.shutdown(grace=0)
