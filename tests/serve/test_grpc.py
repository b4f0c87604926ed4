"""The gRPC server (`deepinfer serve`), in-process on 127.0.0.1 with the tiny model.

One module-scoped server does most of the work (every new jit shape costs seconds on 2 cores;
all servers here share one cache layout, so the compiled steps are shared too). Prompts and
outputs stay within one 64-token page so no second page-count bucket is compiled.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.grpc import deepinfer_engine_pb2 as pb
from deepinfer.serve.grpc import deepinfer_engine_pb2_grpc as pb_grpc
from deepinfer.serve.grpc.server import SERVICE_NAME, LoadedModel, ServerSettings, ServerThread
from tests.serve.compilations import COMPILE_EVENTS, WARM_ENGINE

GRPC_DIR = Path(__file__).resolve().parents[2] / "serve" / "grpc"
BUDGET = CacheBudget(num_slots=4, max_model_len=512, page_size=64)
TOKEN = "test-token-0123456789"


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=True)
    return config, init_params(config, seed=0), load_tokenizer()


def make_engine(model) -> LLMEngine:
    config, params, tokenizer = model
    return LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, prefill_chunk=128))


@pytest.fixture(scope="module")
def server(model):
    srv = ServerThread(lambda: LoadedModel(make_engine(model), model_name="tiny-v4.1-test"),
                       ServerSettings(port=0, shutdown_grace_s=1.0, warmup=False))
    srv.start()
    assert srv.wait_ready(300), srv.server.load_error
    yield srv
    srv.shutdown(grace=0)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.LlmEngineStub(channel)


@pytest.fixture(scope="module")
def reference(model):
    """A separate engine over the same weights: what Generate must reproduce."""
    engine = make_engine(model)
    counter = iter(range(10 ** 6))

    def run(ids, params: SamplingParams):
        rid = f"ref-{next(counter)}"
        engine.add_request(rid, ids, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    return out
        raise AssertionError("the reference request did not finish")

    return run


# ---- helpers ----------------------------------------------------------------------------------


def prompt_ids(n: int, seed: int) -> list[int]:
    return [0] + np.random.default_rng(seed).integers(100, 100_000, n - 1).tolist()


def request(ids=None, *, text=None, stream=True, rid="", **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=rid, stream=stream, sampling_params=pb.SamplingParams(**sampling))
    if text is not None:
        req.text = text
    elif ids is not None:
        req.tokenized.input_ids.extend(ids)
    return req


def collect(stub, req, metadata=None, timeout=120.0):
    """(chunks, complete, error) of one Generate call."""
    chunks, complete, error = [], None, None
    for resp in stub.Generate(req, metadata=metadata, timeout=timeout):
        kind = resp.WhichOneof("response")
        assert complete is None and error is None, "nothing may follow complete / error"
        if kind == "chunk":
            chunks.append(resp.chunk)
        elif kind == "complete":
            complete = resp.complete
        else:
            error = resp.error
    return chunks, complete, error


def cache_state(srv):
    return srv.in_engine(lambda e: (e.cache.pages.free, e.cache.free_slots, e.has_unfinished()))


def full_cache(srv):
    layout = srv.server.engine.cache.layout
    return layout.num_pages, layout.num_slots, False


def wait_released(srv, timeout=15.0):
    """Wait until no stream is in flight and every page and slot is free again."""
    deadline = time.monotonic() + timeout
    while True:
        state = cache_state(srv)
        if state == full_cache(srv) and srv.server.active_requests == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"cache not released: {state} vs {full_cache(srv)}, "
                                 f"{srv.server.active_requests} active")
        time.sleep(0.02)


@contextlib.contextmanager
def slow_steps(srv, delay: float, hold: threading.Event | None = None):
    """Make every engine step take at least `delay` seconds (keeps streams in flight); while
    `hold` is set the engine takes no step at all (requests are still added and refused between
    steps), so a stream in flight stays in flight however slowly the machine sends the others."""
    engine = srv.server.engine
    original = engine.step

    def slow():
        time.sleep(delay)
        return [] if hold is not None and hold.is_set() else original()

    engine.step = slow
    try:
        yield
    finally:
        del engine.step


def list_services(channel, metadata=None) -> list[str]:
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          metadata=metadata, timeout=30)
    return [s.name for r in responses for s in r.list_services_response.service]


def health_status(channel, service="") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


# ---- stubs ------------------------------------------------------------------------------------


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    stage = tmp_path / "deepinfer" / "serve" / "grpc"
    stage.mkdir(parents=True)
    shutil.copy(GRPC_DIR / "deepinfer_engine.proto", stage)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", "deepinfer/serve/grpc/deepinfer_engine.proto"],
                   cwd=tmp_path, check=True)
    for name in ("deepinfer_engine_pb2.py", "deepinfer_engine_pb2.pyi", "deepinfer_engine_pb2_grpc.py"):
        assert (stage / name).read_text() == (GRPC_DIR / name).read_text(), f"{name} is stale: run regenerate.sh"
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
    req.return_logprob, req.top_logprobs_num = True, 2
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
        ("n 2", sp(n=2), "sampling_params.n"),
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
    import jax.monitoring

    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, WARM_ENGINE)
    proceed = threading.Event()
    original_run = engine.runner.run

    def gated_run(*args, **kwargs):  # hold the warm-up at its first shape until the checks are done
        assert proceed.wait(120)
        return original_run(*args, **kwargs)

    engine.runner.run = gated_run
    compiles = []

    def on_event(name, seconds, **_):
        if name in COMPILE_EVENTS:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    srv = ServerThread(LoadedModel(engine, model_name="warm"), ServerSettings(port=0))
    try:
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
                _, complete, error = collect(stub, request(prompt_ids(60, seed), max_new_tokens=20, ignore_eos=True,
                                                           **sampling))
                assert error is None and complete.completion_tokens == 20  # ends on the second page
            assert compiles == [], f"{len(compiles)} compilation(s) after the warm-up"
    finally:
        proceed.set()
        jax.monitoring.unregister_event_duration_listener(on_event)
        srv.shutdown(grace=0)


# ---- health, drain, auth, TLS, limits -----------------------------------------------------------


def test_health_transitions_and_graceful_drain(model):
    gate = threading.Event()

    def loader():  # "loading the weights" until the test lets it finish
        assert gate.wait(120)
        return LoadedModel(make_engine(model), model_name="drain-test")

    srv = ServerThread(loader, ServerSettings(port=0, shutdown_grace_s=1.0, warmup=False))
    port = srv.start()
    registry = srv.server.metrics_registry()  # made while loading, as `deepinfer serve` does
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.LlmEngineStub(ch)
            for service in ("", SERVICE_NAME):
                assert health_status(ch, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, request(prompt_ids(8, 1), max_new_tokens=2))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
            gate.set()
            assert srv.wait_ready(300)
            from prometheus_client import generate_latest

            assert 'model_name="drain-test"' in generate_latest(registry).decode()  # the served model
            for service in ("", SERVICE_NAME):
                assert health_status(ch, service) == health_pb2.HealthCheckResponse.SERVING

            with slow_steps(srv, 0.05):
                short = stub.Generate(request(prompt_ids(8, 2), temperature=0.0, max_new_tokens=3, ignore_eos=True),
                                      timeout=60)
                long = stub.Generate(request(prompt_ids(8, 3), temperature=0.0, max_new_tokens=50, ignore_eos=True),
                                     timeout=60)
                first_short, first_long = next(short), next(long)
                assert first_short.WhichOneof("response") == first_long.WhichOneof("response") == "chunk"
                drain = threading.Thread(target=srv.shutdown, kwargs={"grace": 1.0})
                drain.start()
                deadline = time.monotonic() + 5
                while health_status(ch) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert health_status(ch, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert srv.server.active_requests >= 1  # still draining
                with pytest.raises(grpc.RpcError) as e:
                    collect(stub, request(prompt_ids(8, 4), max_new_tokens=2))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                short_rest, long_rest = list(short), list(long)
                drain.join(60)
        assert short_rest[-1].complete.finish_reason == "length"  # finished within the grace period
        assert long_rest[-1].complete.finish_reason == "abort"  # aborted when the grace period ran out
        assert srv.server.state == "STOPPED" and not srv.server.driver.is_alive()
        engine = srv.server.engine
        assert engine.cache.pages.free == engine.cache.layout.num_pages
        assert engine.cache.free_slots == engine.cache.layout.num_slots
    finally:
        gate.set()
        srv.shutdown(grace=0)


def _self_signed_cert(directory: Path):
    if shutil.which("openssl") is None:
        return None
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def secure(model, tmp_path_factory):
    """A server with a bearer token, TLS (when openssl is there) and a queue of one beyond the slots."""
    tls = _self_signed_cert(tmp_path_factory.mktemp("tls"))
    settings = ServerSettings(port=0, auth_token=TOKEN, max_queue=1, shutdown_grace_s=0.5, warmup=False,
                              tls_cert=str(tls[0]) if tls else None, tls_key=str(tls[1]) if tls else None)
    srv = ServerThread(lambda: make_engine(model), settings)
    srv.start()
    assert srv.wait_ready(300)
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=tls[0].read_bytes())
        ch = grpc.secure_channel(f"127.0.0.1:{srv.port}", creds,
                                 options=[("grpc.ssl_target_name_override", "localhost")])
    else:
        ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield srv, ch, tls is not None
    ch.close()
    srv.shutdown(grace=0)


def test_bearer_token_on_every_rpc(secure):
    srv, ch, _ = secure
    stub = pb_grpc.LlmEngineStub(ch)
    good = (("authorization", f"Bearer {TOKEN}"),)
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        for call in (lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30),
                     lambda md: stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=30),
                     lambda md: stub.Abort(pb.AbortRequest(request_id="x"), metadata=md, timeout=30),
                     lambda md: stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=md, timeout=30),
                     lambda md: collect(stub, request(prompt_ids(8, 1), max_new_tokens=2), metadata=md),
                     lambda md: list_services(ch, metadata=md)):
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good, timeout=30).vocab_size == 129280
    for scheme in ("bearer", "BEARER", "bEaReR"):  # the scheme is case-insensitive (RFC 7235)
        md = (("authorization", f"{scheme} {TOKEN}"),)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30).vocab_size == 129280
    for value in (f"Basic {TOKEN}", "Bearer", f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN}x"):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", value),), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, value
    _, complete, _ = collect(stub, request(prompt_ids(8, 1), temperature=0.0, max_new_tokens=2), metadata=good)
    assert complete.completion_tokens == 2
    assert SERVICE_NAME in list_services(ch, metadata=good)
    # the standard health service stays open (load balancers probe it without credentials)
    assert health_status(ch) == health_pb2.HealthCheckResponse.SERVING
    assert "<set>" == srv.server.settings.public_dict()["auth_token"]


def test_tls_rejects_plaintext_clients(secure):
    srv, _, tls = secure
    if not tls:
        pytest.skip("openssl is not installed: no certificate to test TLS with")
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as plain:
        with pytest.raises(grpc.RpcError) as e:
            health_status(plain)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_queue_limit_gives_resource_exhausted(secure):
    srv, ch, _ = secure
    stub = pb_grpc.LlmEngineStub(ch)
    md = (("authorization", f"Bearer {TOKEN}"),)
    calls = []
    with slow_steps(srv, 0.03):
        try:
            for i in range(5):  # 4 slots + a queue of 1
                calls.append(stub.Generate(request(prompt_ids(8, 20 + i), temperature=0.0, max_new_tokens=50,
                                                   ignore_eos=True), metadata=md, timeout=60))
            deadline = time.monotonic() + 30
            while srv.server.active_requests < 5:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, request(prompt_ids(8, 30), max_new_tokens=2), metadata=md)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in e.value.details()
        finally:
            for call in calls:
                call.cancel()
    wait_released(srv)
    _, complete, _ = collect(stub, request(prompt_ids(8, 30), temperature=0.0, max_new_tokens=2), metadata=md)
    assert complete.completion_tokens == 2


def test_bad_tls_files_are_named_before_binding(model, tmp_path, capsys):
    from deepinfer.serve.grpc.cli import run_serve
    from deepinfer.serve.grpc.tls import TlsFileError

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tls, other = _self_signed_cert(tmp_path / "a"), _self_signed_cert(tmp_path / "b")
    if tls is None:
        pytest.skip("openssl is not installed: no certificate to test TLS with")
    (cert, key), (_, other_key) = tls, other
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    for c, k, flag, named, needle in ((garbage, key, "--tls-cert", garbage, "no PEM certificate"),
                                      (key, key, "--tls-cert", key, "no PEM certificate"),
                                      (cert, garbage, "--tls-key", garbage, "no PEM private key"),
                                      (cert, cert, "--tls-key", cert, "no PEM private key"),
                                      (cert, other_key, "--tls-key", other_key, "does not match the certificate")):
        assert run_serve(_serve_args("--tls-cert", str(c), "--tls-key", str(k))) == 2
        err = capsys.readouterr().err
        assert f"{flag}: " in err and str(named) in err and needle in err and "Failed to bind" not in err, err
        # an embedding program gets the same error from start(), before anything binds
        srv = ServerThread(lambda: make_engine(model),
                           ServerSettings(port=0, tls_cert=str(c), tls_key=str(k), warmup=False))
        with pytest.raises(TlsFileError, match=needle):
            srv.start()


def test_a_non_loopback_bind_needs_tls_or_a_token(tmp_path, capsys):
    from deepinfer.serve.grpc.cli import build_settings, run_serve

    for host in ("0.0.0.0", "::", "192.0.2.7", "example.com"):
        with pytest.raises(ValueError, match="allow_insecure_remote"):
            ServerSettings(host=host)
        assert ServerSettings(host=host, auth_token=TOKEN).host == host
        assert ServerSettings(host=host, allow_insecure_remote=True).host == host
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert ServerSettings(host=host).exposure().endswith("(loopback only), TLS off, bearer-token auth off")
    settings = ServerSettings(host="0.0.0.0", auth_token=TOKEN, port=7)
    assert settings.exposure() == ("0.0.0.0:7 (reachable from other machines), TLS off, "
                                   "bearer-token auth on (health service open)")
    assert run_serve(_serve_args("--host", "0.0.0.0")) == 2
    assert "--allow-insecure-remote" in capsys.readouterr().err
    assert build_settings(_serve_args("--host", "::", "--allow-insecure-remote")).allow_insecure_remote
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert build_settings(_serve_args("--host", "0.0.0.0", "--auth-token-file", str(token_file))).auth_token == TOKEN


# ---- the `serve` command ------------------------------------------------------------------------


def _serve_args(*argv: str):
    import argparse

    from deepinfer.serve.grpc.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="deepinfer")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_command_rejects_bad_arguments(tmp_path, capsys):
    from deepinfer.serve.grpc.cli import run_serve

    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    spaced = tmp_path / "spaced-token"
    spaced.write_text("two words\n")
    for argv, needle in ((["--port", "70000"], "--port"),
                         (["--tls-cert", str(empty)], "--tls-cert and --tls-key"),
                         (["--auth-token-file", str(empty)], "is empty"),
                         (["--auth-token-file", str(spaced)], "one line without spaces"),
                         (["--auth-token-file", str(tmp_path / "missing")], "cannot read"),
                         (["--auth-health"], "--auth-health"),
                         (["--max-queue", "-1"], "--max-queue"),
                         (["--max-concurrent-streams", "0"], "--max-concurrent-streams"),
                         (["--prefill-chunk", "100"], "multiple of 128"),
                         (["--model", str(tmp_path / "nowhere")], "--model")):
        args = _serve_args(*argv)
        assert args.func is run_serve
        assert run_serve(args) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    args = _serve_args()
    assert (args.host, args.port) == ("127.0.0.1", 50051)  # loopback by default


def test_serve_command_serves_and_drains_on_sigterm(tmp_path):
    import os
    import signal

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    script = ("import argparse, sys\n"
              "from deepinfer.serve.grpc.cli import add_serve_parser\n"
              "p = argparse.ArgumentParser()\n"
              "add_serve_parser(p.add_subparsers())\n"
              "a = p.parse_args(sys.argv[1:])\n"
              "sys.exit(a.func(a))\n")
    stderr = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--port", "0", "--auth-token-file", str(token_file), "--no-warmup",
         "--max-model-len", "256", "--max-num-seqs", "2", "--page-size", "64", "--prefill-chunk", "128",
         "--served-model-name", "cli-test", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})  # the embedded model is written there
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, (line, (tmp_path / "stderr.log").read_text())
        assert "(loopback only), TLS off, bearer-token auth on (health service open)" in line, line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        line = proc.stdout.readline()
        assert "Prometheus metrics on http://127.0.0.1:" in line, line
        metrics_url = line.split("metrics on ")[1].strip()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            deadline = time.monotonic() + 120
            while health_status(ch) != health_pb2.HealthCheckResponse.SERVING:  # open without the token
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.log").read_text()
                time.sleep(0.2)
            stub = pb_grpc.LlmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                     timeout=10)
            assert info.served_model_name == "cli-test" and info.max_context_length == 256
        import urllib.request

        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            exposition = r.read().decode()
        assert 'vllm:num_requests_running{engine="0",model_name="cli-test"} 0.0' in exposition
        assert "vllm:time_to_first_token_seconds_bucket" in exposition
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert "draining" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
