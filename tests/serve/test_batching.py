"""Batches that scale: several prompts' chunks prefilled in one step under the token budget
(`max_num_batched_tokens`, the default path), within the budget on every step, and with the same
greedy outputs as a one-chunk-per-step engine."""

import random

import numpy as np
import pytest

from deepinfer.model import load_config
from deepinfer.model.kv_cache import CacheLayout
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget, CacheManager
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.request import Request
from deepinfer.serve.engine.runner import row_bucket, token_bucket
from deepinfer.serve.engine.scheduler import Scheduler
from tests.serve import engine_baseline as baseline

# 8 prompts (one per slot), three longer than a 128-token chunk: 902 tokens
BURST_LENGTHS = [5, 40, 90, 128, 129, 200, 60, 250]


def check_plan(plan, scheduler):
    """Every step within the budget, per dp rank: decodes + chunk tokens, and the prefill step's
    padded rows x tokens; chunks other than a prompt's last are multiples of 128."""
    cache, budget = scheduler.cache, scheduler.max_num_batched_tokens
    for rank in range(cache.layout.dp):
        chunks = [n for r, n in plan.prefill if cache.rank_of(r.slot) == rank]
        decodes = sum(cache.rank_of(r.slot) == rank for r in plan.decode)
        assert decodes + sum(chunks) <= budget
        if chunks:
            assert row_bucket(len(chunks), cache.layout.slots_per_rank) * token_bucket(max(chunks)) <= budget
            assert len(chunks) == 1 or max(chunks) <= 128  # several rows: 128-token chunks
    for request, n in plan.prefill:
        assert n == request.to_feed or n % 128 == 0, (n, request.to_feed)


def test_scheduler_stays_within_the_budget_and_admits_bursts_in_few_steps():
    """Host-only: random bursts on random layouts and budgets; the simulated steps advance
    requests as the engine does (a chunk is computed, a finished prefill decodes `out` tokens)."""
    rng = random.Random(0)
    config = load_config("tiny-v4.1-short")
    for case in range(150):
        slots, dp = rng.choice([(4, 1), (8, 1), (32, 1), (8, 2)])
        page_size, max_len = 128, rng.choice([1024, 2048])
        layout = CacheLayout(slots, page_size, slots * max_len // page_size, max_len // page_size, dp=dp)
        per_rank = slots // dp
        budget = rng.choice([128 + per_rank - 1, 300, 1000, 2048, 4096])
        scheduler = Scheduler(CacheManager(config, layout), prefill_chunk=rng.choice([128, 512]),
                              max_num_batched_tokens=budget)
        wanted = {}
        for i in range(rng.randint(1, 40)):
            length = rng.choice([rng.randint(1, 130), rng.randint(1, max_len - 20)])
            request = Request(f"r{i}", None, list(range(length)), SamplingParams(), None, None, i)
            wanted[request.request_id] = rng.randint(1, 8)
            scheduler.add(request)
        for step in range(2000):
            if not scheduler.has_work:
                break
            plan = scheduler.schedule()
            check_plan(plan, scheduler)
            assert plan.prefill or plan.decode, f"case {case}: a step with nothing to run"
            for request, n in plan.prefill + [(r, 1) for r in plan.decode]:
                request.computed += n
                if request.to_feed == 0:
                    request.output_ids.append(7)
                    if len(request.output_ids) >= wanted[request.request_id]:
                        scheduler.finish(request)
        assert not scheduler.has_work, f"case {case}: requests left after 2000 steps"
        assert scheduler.cache.pages.free == layout.num_pages


def test_a_tiny_budget_is_rejected_with_its_name():
    layout = CacheLayout(8, 128, 64, 8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\).*at least 135"):
        Scheduler(CacheManager(load_config("tiny-v4.1-short"), layout), max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 128"):
        EngineConfig(max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model():
    return baseline.model()  # fake-quant off, float32: two correct programs agree to ~1e-6


def burst(model, engine_config: EngineConfig):
    """Greedy requests of mixed lengths added at once; returns (outputs, steps until every
    prompt was prefilled, the plans)."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, engine_config)
    plans, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        check_plan(plans[-1], engine.scheduler)
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    rng = np.random.default_rng(13)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=2, detokenize=False)
    for i, n in enumerate(BURST_LENGTHS):
        engine.add_request(f"r{i}", rng.integers(100, 100_000, n).tolist(), sp)
    outputs, prefilled = {}, None
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        if prefilled is None and all(r.computed >= len(r.prompt_token_ids) for r in engine.requests.values()):
            prefilled = len(plans)
        assert len(plans) < 200
    return {rid: {"token_ids": list(out.outputs[0].token_ids),
                  "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.outputs[0].logprobs]}
            for rid, out in outputs.items()}, prefilled, plans


@pytest.mark.slow
def test_a_burst_is_admitted_in_few_steps_with_the_outputs_of_one_chunk_per_step(model):
    """One page bucket (few shapes to compile), and both engines share their step programs (one
    configuration): the decode shape compiles once."""
    budget = CacheBudget(num_slots=8, max_model_len=256, page_size=256)
    ours, steps, plans = burst(model, EngineConfig(budget=budget))  # the default token budget
    # every prompt's first chunk in step 1 (8 rows); step 2: the rest of the 200 and 250-token
    # prompts beside the decodes (the 129th token of the 129-token prompt is one of them)
    assert steps == 2, f"8 prompts took {steps} steps to prefill"
    assert [len(p.prefill) for p in plans[:2]] == [8, 2] and len(plans[1].decode) == 6
    # the reference: one chunk of at most 128 tokens per step (the smallest budget 8 slots allow)
    reference, ref_steps, ref_plans = burst(model, EngineConfig(budget=budget, max_num_batched_tokens=135))
    assert max(len(p.prefill) for p in ref_plans) == 1 and ref_steps == 10  # 10 chunks
    assert sorted(ours) == sorted(reference)
    for request_id in ours:
        baseline.assert_matches(ours[request_id], reference[request_id], request_id)
