"""`serve.engine.warmup`: the warm-up compiles every shape the engine then uses, and leaves the
engine as it found it.

The jitted steps (with and without the sampler) are replaced by recorders here (no compilation: fast), so the
test compares shapes: what the engine asks for under a seeded mix of requests (prompts across
every page bucket, several prefilled together, chunks below the compact-prefill floor, greedy /
temperature / top-p sampling) must be a subset of what `warm_up` ran. The real compilation is
checked end to end in `test_grpc.py::test_warmup_compiles_before_serving`.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine import runner as runner_module
from deepinfer.serve.engine.sampler import SampleOutput
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.warmup import step_shapes, warm_up

BUDGET = CacheBudget(num_slots=4, max_model_len=1024, page_size=64)


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1", fake_quant=True)
    return config, init_params(config, seed=0), load_tokenizer()


@pytest.fixture
def recorded(monkeypatch):
    """Replace the jitted steps by recorders of their shapes (a sampling step records its
    logprobs variant where the plain one records all_logits)."""
    calls = {"step": []}

    def fake_step(params, config, layout, cache, batch, *, all_logits=False, decoder=True, kernels=None):
        B, T = batch.tokens.shape
        calls["step"].append((B, T, batch.page_table.shape[1], all_logits, decoder))
        counts = np.zeros((config.num_hidden_layers, config.n_routed_experts), np.int64)
        return cache, np.zeros((B, config.vocab_size), np.float32), counts

    def fake_engine_step(params, cache, state, batch, rows, *, config, layout, kernels=None, head=None):
        B, T = batch.tokens.shape
        calls["step"].append((B, T, batch.page_table.shape[1], head.num_logprobs, True))
        counts = np.zeros((config.num_hidden_layers, config.n_routed_experts), np.int64)
        return cache, state, SampleOutput(tokens=np.full(B, 5, np.int32)), counts

    monkeypatch.setattr(runner_module, "forward_step", fake_step)
    monkeypatch.setattr(runner_module, "engine_step", fake_engine_step)
    return calls


def make_engine(model, **engine_kw) -> LLMEngine:
    config, params, tokenizer = model
    return LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, **engine_kw))


def engine_state(engine):
    return (engine.cache.pages.free, engine.cache.free_slots, dict(engine.stats), engine.has_unfinished(),
            len(engine.requests), engine.scheduler.num_preemptions, engine._step_count,
            str(engine._seeds.bit_generator.state), engine.runner.expert_load.sum(),
            engine.cache.page_table.tolist())


@pytest.mark.parametrize("engine_kw", [dict(prefill_chunk=256, prefill_rows=2),
                                       dict(prefill_chunk=384, prefill_mode="full")])
def test_the_engine_only_uses_warmed_shapes(model, recorded, engine_kw):
    engine = make_engine(model, **engine_kw)
    engine.runner.expert_load += 7  # statistics the warm-up must not touch
    before = engine_state(engine)
    report = warm_up(engine)
    assert engine_state(engine) == before
    assert report.shapes == step_shapes(engine) and len(report.seconds) == len(report.shapes)
    warmed_steps = set(recorded["step"])
    assert len(warmed_steps) == len(report.shapes)  # one call per shape
    recorded["step"].clear()

    rng = random.Random(0)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=20)]
    n = 0
    for burst in range(6):  # bursts: several prompts are prefilled in the same step
        for _ in range(rng.randint(1, 4)):
            length = rng.choice([rng.randint(1, 130), rng.randint(130, 1000)])
            params = rng.choice(kinds)
            out = rng.randint(1, min(200, BUDGET.max_model_len - length - 1))
            engine.add_request(f"r{n}", [0] + [100 + (7 * i) % 5000 for i in range(length - 1)],
                               dataclasses.replace(params, max_tokens=out, ignore_eos=True))
            n += 1
        for _ in range(rng.randint(1, 40)):
            if engine.has_unfinished():
                engine.step()
    while engine.has_unfinished():
        engine.step()
    used_steps = set(recorded["step"])
    assert used_steps <= warmed_steps, sorted(used_steps - warmed_steps)
    # the mix is wide enough to mean something: several page buckets, prefill and decode, and
    # (compact prefill) encoder-only chunks and two-row prefills
    assert len({k[2] for k in used_steps}) >= 4 and {k[1] == 1 for k in used_steps} == {True, False}
    if engine.engine_config.prefill_mode == "compact":
        assert {k[4] for k in used_steps if k[1] > 1} == {True, False}
        assert any(k[0] == 2 and k[1] > 1 for k in used_steps)


def test_warm_up_refuses_a_busy_engine(model, recorded):
    engine = make_engine(model)
    engine.add_request("busy", [0, 5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)
    assert recorded["step"] == []


def test_step_shapes_follow_the_layout(model):
    shapes = step_shapes(make_engine(model, prefill_chunk=256, prefill_rows=2))
    decode = [(s.rows, s.pages) for s in shapes if s.kind == "decode"]
    assert decode == [(4, 1), (4, 2), (4, 4), (4, 8), (4, 16)]
    prefill = {(s.rows, s.tokens, s.pages, s.decoder) for s in shapes if s.kind == "prefill"}
    assert (1, 256, 1, True) not in prefill  # a 129+ token chunk never ends in the first page
    # chunks start at multiples of 256: one of at most 128 tokens ends in (0, 128] or past 256
    assert not {(1, 128, 4, True), (2, 128, 4, True), (1, 128, 4, False)} & prefill
    assert (2, 256, 4, True) in prefill and (1, 128, 8, True) in prefill
    assert (1, 256, 4, True) in prefill and (2, 128, 16, True) in prefill
    assert (1, 128, 16, False) in prefill  # ends in (512, 1024], below the floor 1023 - 140
    assert {s.kind for s in shapes} == {"prefill", "decode"}  # sampling is part of the steps
