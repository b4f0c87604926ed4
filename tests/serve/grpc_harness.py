"""The in-process gRPC server the gRPC tests share: the tiny model, its engine's cache layout, a
module-scoped server, a reference engine and helpers to call and watch the server.

Every server here uses one cache layout (`BUDGET`), so the compiled steps are shared between
the servers and modules (every new jit shape costs seconds on 2 cores). Prompts and outputs stay
within one 64-token page so no second page-count bucket is compiled.
"""

from __future__ import annotations

import contextlib
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
from deepinfer.serve.grpc.server import LoadedModel, ServerSettings, ServerThread

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
