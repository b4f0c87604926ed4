"""Parallel sampling (`SamplingParams.n > 1`, `serve/engine/parallel_sampling.py`): one request's n
samples are exactly n requests with seeds seed + i, returned as one output; without a seed they
differ; they queue when the slots are fewer than n; an abort returns every sample so far.

The engine is the one of test_warmup.py's no-compile test (`WARM_ENGINE`, 2 slots), so the run
compiles its step programs once."""

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.engine import LLMEngine
from deepinfer.serve.engine.types import SamplingParams
from tests.serve.compilations import WARM_ENGINE

PROMPT = np.random.default_rng(4).integers(100, 100_000, 90).tolist()


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=True)
    return config, init_params(config, seed=0), load_tokenizer()


def _engine(model) -> LLMEngine:
    config, params, tokenizer = model
    return LLMEngine(params, config, tokenizer, WARM_ENGINE)


def _run(engine: LLMEngine, requests: list) -> dict:
    """Add `requests` ((id, prompt, params)) in order and step to the end: the outputs by id."""
    for request in requests:
        engine.add_request(*request)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in out, f"{o.request_id} returned twice"
            out[o.request_id] = o
    return out


def _samples(output) -> list:
    return [(c.index, tuple(c.token_ids), c.text, c.finish_reason,
             None if c.logprobs is None else tuple(next(iter(d.values())).logprob for d in c.logprobs))
            for c in output.outputs]


def test_n_samples_are_n_requests_with_seeds_seed_plus_i(model):
    """Three samples of a seeded request (beside a plain one) equal three requests with seeds
    7, 8, 9 added in the same order: the same tokens, text, finish reasons and logprobs bits.
    Only the parent's id comes back, its completions indexed 0-2. With 2 slots the third sample
    waits for a free one."""
    params = dict(temperature=1.0, top_p=0.9, max_tokens=6, ignore_eos=True, logprobs=1)
    other = ("other", PROMPT[:40], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    grouped = _run(_engine(model), [("group", PROMPT, SamplingParams(n=3, seed=7, **params)), other])
    assert sorted(grouped) == ["group", "other"]
    single = _run(_engine(model), [(f"s{i}", PROMPT, SamplingParams(seed=7 + i, **params)) for i in range(3)]
                  + [other])
    expected = [(i,) + s[1:] for i in range(3) for s in _samples(single[f"s{i}"])]
    got = grouped["group"]
    assert _samples(got) == expected
    assert got.finished and got.prompt_token_ids == single["s0"].prompt_token_ids
    assert _samples(grouped["other"]) == _samples(single["other"])
    assert len({s[1] for s in expected}) == 3  # (the three seeds sample three different texts)
    m = got.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_unseeded_samples_differ_and_an_abort_returns_every_sample(model):
    """Without a seed the n samples still get n different seeds (the engine draws one for the
    request); aborting the request after a few steps returns all n samples, those still running
    with finish reason "abort" and the tokens they had, and leaves nothing running."""
    engine = _engine(model)
    out = _run(engine, [("free", PROMPT, SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True))])
    texts = [tuple(c.token_ids) for c in out["free"].outputs]
    assert len(texts) == 2 and texts[0] != texts[1] and [c.index for c in out["free"].outputs] == [0, 1]

    engine.add_request("long", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True))
    early = []
    for _ in range(4):
        early += engine.step()
    assert early == []
    aborted = engine.abort("long")
    assert aborted.request_id == "long" and [c.index for c in aborted.outputs] == [0, 1, 2]
    assert {c.finish_reason for c in aborted.outputs} == {"abort"}
    assert any(c.token_ids for c in aborted.outputs)
    assert engine.abort("long") is None
    while engine.has_unfinished():
        assert engine.step() == []
    assert not engine.requests and not engine.scheduler.running


def test_sample_ids_are_checked_before_anything_is_queued(model):
    """A parent id already in use, or a sample id ("{i}_{id}", vLLM's form) that another request
    holds, is refused with the id named; nothing of the refused request is queued."""
    engine = _engine(model)
    sp = SamplingParams(n=2, max_tokens=2)
    engine.add_request("0_x", PROMPT[:10], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'0_x', the id of one of its n=2 samples"):
        engine.add_request("x", PROMPT[:10], sp)
    engine.add_request("y", PROMPT[:10], sp)
    with pytest.raises(ValueError, match="request_id 'y' is already in use"):
        engine.add_request("y", PROMPT[:10], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt_token_ids: id 200000"):
        engine.add_request("z", [200000], sp)
    assert sorted(engine.requests) == ["0_x", "0_y", "1_y"]
    out = _run(engine, [])
    assert sorted(out) == ["0_x", "y"] and len(out["y"].outputs) == 2
