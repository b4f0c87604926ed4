"""A bounded load test of the gRPC server: 64 concurrent streaming clients on loopback.

Each client sends streaming Generate calls back to back for LOAD_SECONDS (and at most
MAX_REQUESTS_PER_CLIENT of them); calls still running TAIL_SECONDS after that are cancelled.
Checks: no RPC error and no in-band error, every completion consistent with its stream, and no
page or slot leaked at the end. Prints p50/p99 time-to-first-token and inter-token latency as the
clients see them, plus throughput (`pytest -s` shows the lines) and writes them to
`grpc_load.json` in the test's tmp dir.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import grpc
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.warmup import warm_up
from deepinfer.serve.grpc import deepinfer_engine_pb2 as pb
from deepinfer.serve.grpc import deepinfer_engine_pb2_grpc as pb_grpc
from deepinfer.serve.grpc.metrics import percentile
from deepinfer.serve.grpc.server import LoadedModel, ServerSettings, ServerThread

CLIENTS = 64
CHANNELS = 8  # clients share HTTP/2 connections, 8 streams each
LOAD_SECONDS = 30.0
TAIL_SECONDS = 5.0
MAX_REQUESTS_PER_CLIENT = 40
BUDGET = CacheBudget(num_slots=8, max_model_len=256, page_size=64)


@pytest.fixture(scope="module")
def server():
    config = load_config("tiny-v4.1-short", fake_quant=True)
    engine = LLMEngine(init_params(config, seed=0), config, load_tokenizer(),
                       EngineConfig(budget=BUDGET, prefill_chunk=128))
    # compile every shape the load can reach (prompt + output within one page: prefill of 1, 2, 4
    # and 8 rows, decode) before measuring; a shape compiled inside the 30 s window would stall all
    # 64 clients for ~10 s. The server's full warm-up would also compile page buckets never reached.
    warm_up(engine, max_len=BUDGET.page_size)
    srv = ServerThread(LoadedModel(engine, model_name="tiny-v4.1-load"),
                       ServerSettings(port=0, max_concurrent_streams=CLIENTS, max_queue=CLIENTS, warmup=False))
    srv.start()
    assert srv.wait_ready(300), srv.server.load_error
    yield srv
    srv.shutdown(grace=0)


def _request(rng: random.Random, client: int, i: int) -> pb.GenerateRequest:
    # prompt + output stay within one 64-token page (one compiled page bucket)
    n_prompt, n_out = rng.randint(8, 32), rng.randint(8, 24)
    ids = [0] + [rng.randrange(100, 100_000) for _ in range(n_prompt - 1)]
    # greedy or plain temperature sampling: top-p / top-k sort the whole vocabulary, which costs
    # more on 2 CPU cores than the tiny model's step itself
    temperature = 0.0 if rng.random() < 0.5 else 0.8
    sp = pb.SamplingParams(max_new_tokens=n_out, ignore_eos=True, seed=client * 1000 + i, temperature=temperature)
    return pb.GenerateRequest(request_id=f"load-{client}-{i}", tokenized=pb.TokenizedInput(input_ids=ids),
                              sampling_params=sp, stream=True)


async def _client(stub, client: int, stop_at: float, stats: dict) -> None:
    rng = random.Random(client)
    for i in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= stop_at:
            return
        req = _request(rng, client, i)
        sent = time.monotonic()
        last = None
        tokens: list[int] = []
        call = stub.Generate(req, timeout=LOAD_SECONDS + TAIL_SECONDS + 60)
        stats["calls"].append(call)
        try:
            async for resp in call:
                now = time.monotonic()
                kind = resp.WhichOneof("response")
                if kind == "chunk":
                    n = len(resp.chunk.token_ids)
                    if last is None:
                        stats["ttft"].append(now - sent)
                        n -= 1
                    if n > 0:
                        stats["itl"].extend([(now - last) / n] * n if last is not None else [0.0] * n)
                    last = now
                    tokens.extend(resp.chunk.token_ids)
                elif kind == "complete":
                    c = resp.complete
                    if list(c.output_ids) != tokens or c.completion_tokens != req.sampling_params.max_new_tokens:
                        stats["errors"].append(f"{req.request_id}: completion does not match its stream")
                    stats["completed"] += 1
                    stats["tokens"] += len(tokens)
                    stats["e2e"].append(now - sent)
                else:
                    stats["errors"].append(f"{req.request_id}: in-band error {resp.error.message}")
        except (asyncio.CancelledError, grpc.RpcError) as e:
            cancelled = isinstance(e, asyncio.CancelledError) or e.code() == grpc.StatusCode.CANCELLED
            if cancelled and stats["cancelling"]:  # cancelled by us after the tail window
                stats["cancelled"] += 1
                stats["tokens"] += len(tokens)
                return
            if isinstance(e, asyncio.CancelledError):
                raise
            stats["errors"].append(f"{req.request_id}: {e.code()} {e.details()}")
            return
        finally:
            stats["calls"].remove(call)


async def _run_load(port: int) -> dict:
    stats = {"ttft": [], "itl": [], "e2e": [], "errors": [], "completed": 0, "cancelled": 0, "tokens": 0,
             "calls": [], "cancelling": False}
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(CHANNELS)]
    try:
        stubs = [pb_grpc.LlmEngineStub(ch) for ch in channels]
        start = time.monotonic()
        stop_at = start + LOAD_SECONDS
        tasks = [asyncio.ensure_future(_client(stubs[c % CHANNELS], c, stop_at, stats)) for c in range(CLIENTS)]
        done, pending = await asyncio.wait(tasks, timeout=LOAD_SECONDS + TAIL_SECONDS)
        stats["cancelling"] = True
        for call in list(stats["calls"]):
            call.cancel()  # still running after the tail: cancelled, which must free their cache too
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        stats["elapsed"] = time.monotonic() - start
    finally:
        for ch in channels:
            await ch.close()
    return stats


@pytest.mark.slow
def test_64_streaming_clients(server, tmp_path):
    compiled = set(server.server.engine.runner.compile_seconds)
    stats = asyncio.run(_run_load(server.port))
    assert stats["errors"] == [], stats["errors"][:5]
    late = set(server.server.engine.runner.compile_seconds) - compiled
    assert not late, f"shapes compiled during the load (missing from the warm-up): {sorted(map(str, late))}"
    assert stats["completed"] > 0 and len(stats["ttft"]) > 0

    # nothing leaked: every stream ended, every page and slot is free again
    layout = server.server.engine.cache.layout
    deadline = time.monotonic() + 15
    while True:
        free_pages, free_slots, busy = server.in_engine(
            lambda e: (e.cache.pages.free, e.cache.free_slots, e.has_unfinished()))
        if (free_pages, free_slots, busy, server.server.active_requests) == (
                layout.num_pages, layout.num_slots, False, 0):
            break
        assert time.monotonic() < deadline, (free_pages, free_slots, busy, server.server.active_requests)
        time.sleep(0.05)

    info = server.run(_server_metrics(server.server))
    report = {
        "clients": CLIENTS,
        "channels": CHANNELS,
        "cache_slots": BUDGET.num_slots,
        "load_seconds": LOAD_SECONDS,
        "elapsed_seconds": round(stats["elapsed"], 3),
        "requests_completed": stats["completed"],
        "requests_cancelled_at_the_end": stats["cancelled"],
        "generated_tokens": stats["tokens"],
        "output_tokens_per_second": round(stats["tokens"] / stats["elapsed"], 2),
        "ttft_p50_s": round(percentile(stats["ttft"], 50), 4),
        "ttft_p99_s": round(percentile(stats["ttft"], 99), 4),
        "itl_p50_s": round(percentile(stats["itl"], 50), 4),
        "itl_p99_s": round(percentile(stats["itl"], 99), 4),
        "e2e_p50_s": round(percentile(stats["e2e"], 50), 4),
        "server_ttft_p50_s": info["vllm:time_to_first_token_seconds"]["p50"],
        "server_itl_p50_s": info["vllm:inter_token_latency_seconds"]["p50"],
    }
    path = tmp_path / "grpc_load.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\ngRPC load: {CLIENTS} streaming clients over {CHANNELS} channels, {BUDGET.num_slots} cache slots, "
          f"{report['elapsed_seconds']:.1f} s: {report['requests_completed']} requests completed "
          f"({report['requests_cancelled_at_the_end']} cancelled at the end), {report['generated_tokens']} tokens, "
          f"{report['output_tokens_per_second']:.1f} output tokens/s")
    print(f"gRPC load: TTFT p50 {report['ttft_p50_s'] * 1e3:.0f} ms, p99 {report['ttft_p99_s'] * 1e3:.0f} ms; "
          f"ITL p50 {report['itl_p50_s'] * 1e3:.1f} ms, p99 {report['itl_p99_s'] * 1e3:.1f} ms "
          f"(written to {path})")
    assert report["output_tokens_per_second"] > 0


async def _server_metrics(server):
    return server.metrics.snapshot(server.gauges())
