"""Asynchronous scheduling gives the synchronous engine's outputs, and leaks nothing.

A scripted mix of 24 requests (prompts of 5-300 tokens, greedy and seeded sampling, logprobs,
stop strings that span a token boundary, stop token ids, min_tokens, max_tokens) runs through
both engines on a page pool small enough to force preemptions. Requests arrive and are aborted
at points of a logical clock both engines share (tokens read so far, a request's own output
length), so the aborts hit requests whose next step is already in flight. Stops are made to
occur whatever the weights' rounding: a logit bias on the token "ab" (whose repetition "abab"
holds the stop string "ba" across the boundary) or on the stop id.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine

NUM_REQUESTS = 24
ABORTED = {"r05": 3, "r11": 2, "r17": 4}  # request -> its output length when it is aborted
FIRST_WAVE = 10  # the others arrive one by one as the engine's read tokens pass a threshold


@pytest.fixture(scope="module")
def model():
    # compact prefill (the default: encoder-only passes run deferred too); without fake-quant,
    # whose programs take twice as long to compile
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=5), load_tokenizer()


def make_engine(model, async_scheduling: bool) -> LLMEngine:
    config, params, tokenizer = model
    # 4 pages of 128 tokens for 4 slots: the first four requests (121-token prompts) fill them and
    # then each needs a second page: the newest are preempted. One prefill chunk per step (the
    # smallest token budget) keeps the programs to compile few.
    budget = CacheBudget(num_slots=4, max_model_len=512, page_size=128, num_pages=4)
    engine_config = EngineConfig(budget=budget, prefill_chunk=128, max_num_batched_tokens=131,
                                 async_scheduling=async_scheduling)
    return LLMEngine(params, config, tokenizer, engine_config)


def script(tokenizer) -> list[tuple[str, list[int], SamplingParams]]:
    ab, ok = tokenizer.token_to_id("ab"), tokenizer.token_to_id("ok")
    rng = np.random.default_rng(11)
    requests = []
    for i in range(NUM_REQUESTS):
        n = 120 if i < 4 else int(rng.choice([5, 40, 200, 300]))
        prompt = [0] + rng.integers(3, 128000, n).tolist()
        sampled = i % 3 != 0
        kind = "plain" if i < 4 or f"r{i:02d}" in ABORTED else ("string", "id", "min_tokens", "plain")[i % 4]
        params = dict(max_tokens=12 if i < 4 else int(rng.integers(6, 14)), temperature=0.9 if sampled else 0.0,
                      top_p=0.95 if i % 2 else 1.0, seed=100 + i if sampled else None,
                      logprobs=2 if i % 4 == 1 else None, ignore_eos=i % 5 != 0)
        if kind == "string":  # "ab" + "ab" holds "ba" across the boundary
            params.update(logit_bias={ab: 100.0 if not sampled else 6.0}, stop=["ba"])
        elif kind == "id":
            params.update(logit_bias={ok: 100.0 if not sampled else 6.0}, stop_token_ids=[ok])
        elif kind == "min_tokens":  # the stop id is banned for the first 3 tokens
            params.update(logit_bias={ok: 100.0}, stop_token_ids=[ok], min_tokens=3)
        requests.append((f"r{i:02d}", prompt, SamplingParams(**params)))
    return requests


def drive(engine: LLMEngine, requests) -> dict:
    """Run the script; returns every request's final output and the engine's step count."""
    pending = list(requests)
    for request in pending[:FIRST_WAVE]:
        engine.add_request(*request)
    pending = pending[FIRST_WAVE:]
    outputs, steps = {}, 0
    while engine.has_unfinished() or pending:
        read = engine.stats["generation_tokens"]
        while pending and read >= 6 * (NUM_REQUESTS - len(pending) - FIRST_WAVE + 1):
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            outputs[out.request_id] = out
        for rid, n in ABORTED.items():
            request = engine.requests.get(rid)
            if request is not None and len(request.output_ids) >= n:
                outputs[rid] = engine.abort(rid)
        steps += 1
        assert steps < 2000
    return outputs


def summary(out) -> tuple:
    c = out.outputs[0]
    logprobs = None if c.logprobs is None else [sorted((t, lp.logprob, lp.rank) for t, lp in e.items())
                                                for e in c.logprobs]
    return c.token_ids, c.finish_reason, c.stop_reason, c.text, c.cumulative_logprob, logprobs


def assert_nothing_leaked(engine: LLMEngine) -> None:
    layout = engine.cache.layout
    assert not engine.has_unfinished() and not engine.requests
    assert engine.cache.free_slots == layout.num_slots
    assert engine.cache.pages.free == layout.num_pages
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_async_scheduling_gives_the_synchronous_outputs(model):
    requests = script(model[2])
    runs = {}
    for async_scheduling in (False, True):
        engine = make_engine(model, async_scheduling)
        outputs = drive(engine, requests)
        assert_nothing_leaked(engine)
        assert engine.scheduler.num_preemptions >= 2, "the page pool should force preemptions"
        runs[async_scheduling] = {rid: summary(out) for rid, out in outputs.items()}
    sync, asynchronous = runs[False], runs[True]
    assert sorted(sync) == sorted(asynchronous) == sorted(rid for rid, _, _ in requests)
    for rid in sorted(sync):
        assert asynchronous[rid] == sync[rid], rid
    reasons = [sync[rid][1] for rid in sync]
    assert reasons.count("abort") == len(ABORTED)
    assert "stop" in reasons and "length" in reasons
    assert any(isinstance(sync[rid][2], str) for rid in sync), "a stop string should have ended a request"
    assert any(isinstance(sync[rid][2], int) for rid in sync), "a stop token id should have ended a request"
    for rid, n in ABORTED.items():
        assert len(sync[rid][0]) == n
    for rid, (_, params) in {rid: (p, params) for rid, p, params in requests}.items():
        if params.min_tokens:
            assert len(sync[rid][0]) > params.min_tokens and sync[rid][1] == "stop"


def test_a_request_shows_its_unread_tokens_as_placeholders():
    from deepinfer.serve.engine.placeholders import PLACEHOLDER
    from deepinfer.serve.engine.request import Request

    request = Request("r", None, [1, 2, 3], SamplingParams(), None, None, 0)
    request.output_ids, request.pending = [4, 5], 2
    assert request.length == 7 and request.known == 5
    assert request.ids(0, 7).tolist() == [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER]
    assert request.ids(2, 4).tolist() == [3, 4]
    assert request.ids(5, 9).tolist() == [PLACEHOLDER, PLACEHOLDER]
    request.pending = 0
    assert request.ids(3, 9).tolist() == [4, 5]
