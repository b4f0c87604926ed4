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
from deepinfer.model.kv_cache import CacheLayout
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine import runner as runner_module
from deepinfer.serve.engine.sampler import SampleOutput
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig
from deepinfer.serve.engine.runner import page_bucket, page_buckets
from deepinfer.serve.engine.shape_plan import planned_shapes
from deepinfer.serve.engine.types import MAX_LOGPROBS
from deepinfer.serve.engine.warmup import pending_shapes, step_shapes, warm_up
from tests.serve.compilations import WARM_ENGINE, counting_compiles

BUDGET = CacheBudget(num_slots=4, max_model_len=1024, page_size=64)


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=True)
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
        k = head.num_logprobs
        if k is None:
            return cache, state, SampleOutput(tokens=np.full(B, 5, np.int32)), counts
        return cache, state, SampleOutput(np.full(B, 5, np.int32), np.zeros(B, np.float32), np.ones(B, np.int32),
                                          np.zeros((B, k), np.int32), np.zeros((B, k), np.float32)), counts

    monkeypatch.setattr(runner_module, "forward_step", fake_step)
    monkeypatch.setattr(runner_module, "engine_step", fake_engine_step)
    return calls


def make_engine(model, **engine_kw) -> LLMEngine:
    """An engine of BUDGET whose narrowest page table is one page (the default's is 2,048
    tokens, all of BUDGET): its steps cross page buckets."""
    config, params, tokenizer = model
    engine_kw.setdefault("min_page_bucket_tokens", 64)
    return LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, **engine_kw))


def engine_state(engine):
    return (engine.cache.pages.free, engine.cache.free_slots, dict(engine.stats), engine.has_unfinished(),
            len(engine.requests), engine.scheduler.num_preemptions, engine._step_count,
            str(engine._seeds.bit_generator.state), engine.runner.expert_load.sum(),
            engine.cache.page_table.tolist())


@pytest.mark.parametrize(("engine_kw", "reach"), [(dict(prefill_chunk=256, max_num_batched_tokens=512), None),
                                                  (dict(prefill_chunk=384, prefill_mode="full"), None),
                                                  (dict(prefill_chunk=128), 400)])
def test_the_engine_only_uses_warmed_shapes(model, recorded, engine_kw, reach):
    """Warmed up to `reach` tokens (None: the context), requests that stay within it only use
    warmed shapes."""
    engine = make_engine(model, **engine_kw)
    engine.runner.expert_load += 7  # statistics the warm-up must not touch
    before = engine_state(engine)
    report = warm_up(engine, max_len=reach)
    assert engine_state(engine) == before
    assert report.shapes == step_shapes(engine, reach) and len(report.seconds) == len(report.shapes)
    warmed_steps = set(recorded["step"])
    assert len(warmed_steps) == len(report.shapes)  # one call per shape
    recorded["step"].clear()

    rng = random.Random(0)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=20)]
    n = 0
    limit = reach or BUDGET.max_model_len
    for burst in range(6):  # bursts: several prompts are prefilled in the same step
        for _ in range(rng.randint(1, 4)):
            length = rng.choice([rng.randint(1, 130), rng.randint(130, limit - 24)])
            params = rng.choice(kinds)
            out = rng.randint(1, min(200, limit - length - 1))
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
    # (compact prefill) encoder-only chunks and multi-row prefills
    assert len({k[2] for k in used_steps}) >= 4 and {k[1] == 1 for k in used_steps} == {True, False}
    if engine.engine_config.prefill_mode == "compact":
        assert {k[4] for k in used_steps if k[1] > 1} == {True, False}
    assert any(k[0] >= 2 and k[1] > 1 for k in used_steps)


def test_warm_up_compiles_each_shape_once_and_never_under_a_running_request(model, recorded):
    engine = make_engine(model)
    engine.add_request("queued", [0, 5, 6], SamplingParams(max_tokens=2))  # waiting: no slot or page yet
    short = warm_up(engine, max_len=100)
    assert {s.pages for s in short.shapes if s.kind != "sample"} == {1, 2}  # ends in (0, 64] and (64, 128]
    rest = warm_up(engine)  # only what the first call left out
    assert not set(short.shapes) & set(rest.shapes)
    assert set(short.shapes) | set(rest.shapes) == set(step_shapes(engine))
    assert warm_up(engine).shapes == [] and pending_shapes(engine) == []
    assert len(recorded["step"]) == len({*recorded["step"]})  # no shape ran twice
    engine.step()  # "queued" is admitted and runs
    with pytest.raises(RuntimeError, match="no running request"):
        warm_up(engine)


def test_step_shapes_follow_the_layout(model):
    shapes = step_shapes(make_engine(model, prefill_chunk=256, max_num_batched_tokens=512))
    decode = [(s.rows, s.pages) for s in shapes if s.kind == "decode"]
    assert decode == [(4, 1), (4, 2), (4, 4), (4, 8), (4, 16)]
    prefill = {(s.rows, s.tokens, s.pages, s.decoder) for s in shapes if s.kind == "prefill"}
    assert (1, 256, 1, True) not in prefill  # a 129+ token chunk never ends in the first page
    # within the token budget (512), several rows only of 128-token chunks
    assert all(r * t <= 512 and (r == 1 or t == 128) for r, t, _, _ in prefill)
    assert {r for r, _, _, _ in prefill} == {1, 2, 4}
    assert (4, 128, 4, True) in prefill and (1, 128, 8, True) in prefill
    assert (1, 256, 4, True) in prefill and (2, 128, 16, True) in prefill and (2, 256, 4, True) not in prefill
    assert (1, 128, 16, False) in prefill  # ends in (512, 1024], below the floor 1023 - 140
    assert {s.kind for s in shapes} == {"prefill", "decode"}  # sampling is part of the steps


def test_the_narrowest_page_table_covers_min_page_bucket_tokens(model):
    """By default a step reads at least 2,048 tokens' worth of pages: BUDGET's 1,024-token
    context is one page bucket (prefill and decode), and a longer context starts at 2,048."""
    shapes = step_shapes(make_engine(model, min_page_bucket_tokens=2048))
    assert {s.pages for s in shapes} == {16} and [s.rows for s in shapes if s.kind == "decode"] == [4]
    long = CacheLayout(num_slots=4, page_size=64, num_pages=512, max_pages_per_slot=128)
    assert page_buckets(long) == [32, 64, 128]
    assert [page_bucket(long, n) for n in (1, 2048, 2049, 4096, 4097, 8192)] == [32, 32, 64, 64, 128, 128]
    assert page_buckets(long, 64) == [1, 2, 4, 8, 16, 32, 64, 128] and page_bucket(long, 65, 64) == 2
    with pytest.raises(ValueError, match="min_page_bucket_tokens"):
        EngineConfig(min_page_bucket_tokens=0)


def recorded_key(shape) -> tuple:
    """How the recorders above log a step of `shape` (one dp rank)."""
    head = (MAX_LOGPROBS if shape.logprobs else None) if shape.decoder else False
    return (shape.rows, shape.tokens, shape.pages, head, shape.decoder)


def add_mix(engine, seed: int, count: int, limit: int, *, stop_early: bool = False) -> None:
    """`count` requests of mixed lengths (1 .. `limit` - 24 tokens), sampling kinds and logprobs;
    with `stop_early` some may end on token 5, which the recorders always sample."""
    rng = random.Random(seed)
    for i in range(count):
        length = rng.choice([rng.randint(1, 130), rng.randint(130, limit - 24)])
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True,
                                max_tokens=rng.randint(1, min(200, limit - length - 1)),
                                logprobs=rng.choice([None, None, 2]))
        if stop_early and rng.random() < 0.5:
            params = dataclasses.replace(params, stop_token_ids=[5], min_tokens=rng.randint(0, params.max_tokens))
        engine.add_request(f"r{i}", [0] + [100 + (7 * j) % 5000 for j in range(length - 1)], params)


@pytest.mark.parametrize(("engine_kw", "count", "budget"), [
    (dict(), 3, BUDGET),
    (dict(prefill_chunk=256, max_num_batched_tokens=512), 9, BUDGET),  # more requests than slots: a queue
    (dict(prefill_chunk=128, prefill_mode="full"), 6, BUDGET),
    (dict(prefill_chunk=256), 6, dataclasses.replace(BUDGET, num_pages=16)),  # preemptions
    # prefix cache: the prompts share their first tokens (hits, replays, waits for a prefix)
    (dict(prefill_chunk=256, prefix_cache=PrefixCacheConfig()), 6, BUDGET),
])
def test_planned_shapes_are_the_shapes_the_engine_uses(model, recorded, engine_kw, count, budget):
    """The dry run of the scheduler names exactly the step shapes of a batch that runs to its
    max_tokens, whatever the queue, prefill rows, prefill mode, logprobs or preemptions; the
    engine is left as it was."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, **engine_kw))
    add_mix(engine, seed=count, count=count, limit=budget.max_model_len)
    before = engine_state(engine)
    planned = planned_shapes(engine)
    assert engine_state(engine) == before
    assert len(planned) == len(set(planned))
    while engine.has_unfinished():
        engine.step()
    used = set(recorded["step"])
    planned_prefill = {recorded_key(s) for s in planned if s.kind == "prefill"}
    assert {k for k in used if k[1] > 1} == planned_prefill
    # decode: every bucket a request's decodes cross (early stops need no other)
    assert {k for k in used if k[1] == 1} <= {recorded_key(s) for s in planned if s.kind == "decode"}
    if budget.num_pages:
        assert engine.scheduler.num_preemptions > 0
    if engine.cache.prefix is not None:
        assert engine.scheduler.prefix_stats["hits"] > 0


def test_planned_decode_shapes_cover_early_stops(model, recorded):
    """Requests that stop early (a stop token) use no decode shape that was not planned."""
    engine = make_engine(model)
    add_mix(engine, seed=11, count=4, limit=BUDGET.max_model_len, stop_early=True)
    planned = {recorded_key(s) for s in planned_shapes(engine)}
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert {o.outputs[0].finish_reason for o in finished} == {"stop", "length"}
    assert set(recorded["step"]) <= planned, sorted(set(recorded["step"]) - planned)


def test_planned_shapes_of_one_long_prompt(model):
    """A 1,357-token prompt at the engine defaults (compact prefill, 512-token chunks) is two
    encoder-only chunks, one chunk with the decoder, then decodes, all in the narrowest page
    table (2,048 tokens): 3 shapes where everything its length can reach is more than 4 times
    as many."""
    engine = LLMEngine(model[1], model[0], model[2],
                       EngineConfig(budget=CacheBudget(num_slots=8, max_model_len=4096, page_size=128)))
    engine.add_request("a", [0] + list(range(1, 1357)), SamplingParams(max_tokens=256))
    planned = [str(s) for s in planned_shapes(engine)]
    assert planned == ["prefill 1 rows x 512 tokens x 16 pages, encoder only",
                       "prefill 1 rows x 512 tokens x 16 pages", "decode 8 rows x 1 tokens x 16 pages"]
    assert len(step_shapes(engine, 1357 + 256)) > 4 * len(planned)


@pytest.mark.slow
def test_nothing_compiles_after_the_warm_up(model):
    """Real XLA compilations (JAX's compile and cache-load events), not the runner's bookkeeping: after
    the warm-up, prompts of mixed lengths whose prefills and generations cross page buckets,
    admitted while others decode, greedy and sampled, compile nothing. The engine is the one of
    test_grpc.py's warm-up test (`WARM_ENGINE`: the run compiles its programs once); the programs
    this process holds are dropped first, so the warm-up loads or compiles every one of them."""
    import jax

    config, params, tokenizer = model
    jax.clear_caches()
    engine = LLMEngine(params, config, tokenizer, WARM_ENGINE)
    with counting_compiles() as compiles:
        report = warm_up(engine)
        assert compiles, "the warm-up compiled nothing: the listener hears no compilation"
        assert {s.pages for s in report.shapes if s.kind == "decode"} == {1, 2}
        compiles.clear()
        requests = [(30, 50, SamplingParams(temperature=0.0)),  # decodes across the 64-token page
                    (100, 20, SamplingParams(temperature=0.8, seed=3)),  # prefills into the second page
                    (5, 3, SamplingParams(temperature=0.7, top_p=0.9, top_k=20))]
        for i, (length, out, params) in enumerate(requests):
            engine.add_request(f"r{i}", [0] + [100 + 7 * j for j in range(length - 1)],
                               dataclasses.replace(params, max_tokens=out, ignore_eos=True))
        finished = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o for o in engine.step()})
        assert {rid: len(o.outputs[0].token_ids) for rid, o in finished.items()} == {"r0": 50, "r1": 20, "r2": 3}
        assert compiles == [], f"{len(compiles)} compilation(s) after the warm-up"


def test_a_dry_run_too_long_to_finish_plans_every_reachable_shape(model):
    """A queue that would take more dry-run steps than allowed falls back to every shape the
    requests' lengths can reach (a superset of what they will use)."""
    engine = make_engine(model)
    add_mix(engine, seed=5, count=9, limit=BUDGET.max_model_len)  # 9 requests for 4 slots
    exact = set(planned_shapes(engine))
    capped = set(planned_shapes(engine, max_steps=3))
    reach = max(len(r.prompt_token_ids) + r.params.max_tokens for r in engine.requests.values())
    assert exact <= capped and set(step_shapes(engine, reach)) <= capped


def test_a_warm_up_of_the_planned_shapes_covers_prompt_logprobs(model):
    """A request that asks for prompt logprobs runs its prompt chunks as one-row scored steps; the
    dry run plans them (each chunk's token bucket, k, and whether it samples), so after the
    warm-up of the planned shapes (what `LLM.generate` runs) it and a plain request beside it,
    whose prefill runs in the step of the scored request's last chunk, compile nothing."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer,
                       EngineConfig(budget=CacheBudget(num_slots=2, max_model_len=512, page_size=64),
                                    prefill_chunk=128))
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("scored", [0] + list(range(100, 299)), SamplingParams(prompt_logprobs=2, logprobs=1, **greedy))
    engine.add_request("plain", [0] + list(range(500, 539)), SamplingParams(**greedy))
    planned = planned_shapes(engine)
    assert [str(s) for s in planned if s.kind == "scored"] == [
        "scored 1 rows x 128 tokens x 8 pages, 2 prompt logprobs, no sample",
        "scored 1 rows x 128 tokens x 8 pages, with logprobs, 2 prompt logprobs"]
    with counting_compiles() as compiles:
        report = warm_up(engine, shapes=planned)
        assert set(report.shapes) == set(planned) and compiles
        compiles.clear()
        out = {}
        while engine.has_unfinished():
            out.update((o.request_id, o) for o in engine.step())
        assert len(out["scored"].prompt_logprobs) == 200 and len(out["plain"].outputs[0].token_ids) == 3
        assert compiles == [], f"{len(compiles)} compilation(s) after the warm-up"
