"""Compact prefill through the engine at its defaults (keep 140): a prompt prefilled in several
chunks must predict what the same prompt prefilled in one chunk predicts, for a chunk shorter
than the kept tail (128: the tail spans two chunks) and the default chunk (512: longer than the
tail, as every chunk of 256 or more), for prompt lengths on each side of every boundary (chunk,
chunk + keep, 2 x chunk + keep).
The first wave had no such test and `generate()` hung on any prompt of 652 tokens or more.

Also: the engine never spins. A step that cannot advance any request is an error naming them,
and requests that are all mid-prefill and wait for each other's pages are unblocked by
preemption instead."""

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, EngineStalledError, LLMEngine
from tests.serve.test_engine import run

KEEP = EngineConfig().keep_tokens  # the default
MAX_TOKENS = 3
ONE_CHUNK = 2048  # longer than every prompt below
NEAR_TIE = 1e-3  # two logprobs closer than this may legitimately swap order between programs
# one page per slot: the page-count buckets would only multiply the compiled shapes here; one
# cache layout for the module, so its engines share their step programs
BUDGET = CacheBudget(num_slots=4, max_model_len=ONE_CHUNK, page_size=ONE_CHUNK)


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=5), load_tokenizer()


def boundary_lengths(chunk: int) -> list[int]:
    lengths = set()
    for edge in (chunk, chunk + KEEP, 2 * chunk + KEEP):
        lengths.update((edge - 1, edge, edge + 1))
    return sorted(lengths)


def generate(model, prompts: list[list[int]], prefill_chunk: int) -> dict[str, object]:
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, prefill_chunk=prefill_chunk))
    assert engine.engine_config.prefill_mode == "compact"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, detokenize=False)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    return {request_id: out.outputs[0] for request_id, out in run(engine).items()}


def assert_same_predictions(ours, reference, what: str) -> None:
    """Greedy tokens and their logprobs agree; a differing token is accepted only as a near-tie
    in the reference (then the continuations legitimately part and comparing stops)."""
    for i, (a, b) in enumerate(zip(ours.token_ids, reference.token_ids)):
        if a != b:
            alternatives = reference.logprobs[i]
            assert a in alternatives and abs(alternatives[a].logprob - alternatives[b].logprob) < NEAR_TIE, (
                f"{what}: token {i} is {a}, the one-chunk prefill gives {b} ({alternatives})")
            return
        for token, lp in reference.logprobs[i].items():
            if token in ours.logprobs[i]:
                assert abs(ours.logprobs[i][token].logprob - lp.logprob) < 1e-4, (what, i, token)
    assert len(ours.token_ids) == len(reference.token_ids) == MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [128, 512])
def test_compact_prefill_in_chunks_equals_one_chunk(model, chunk):
    lengths = boundary_lengths(chunk)
    rng = np.random.default_rng(chunk)
    prompts = [[0] + rng.integers(3, 128000, n - 1).tolist() for n in lengths]
    chunked = generate(model, prompts, chunk)
    whole = generate(model, prompts, ONE_CHUNK)
    for i, n in enumerate(lengths):
        assert_same_predictions(chunked[str(i)], whole[str(i)], f"prompt of {n} tokens, chunk {chunk}")


def test_a_step_that_cannot_advance_is_an_error_naming_the_requests(model):
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET))
    engine.add_request("stuck", [0] + list(range(5, 300)), SamplingParams(max_tokens=2))
    engine.step()
    request = engine.requests["stuck"]
    assert (request.computed, request.length) == (296, 297)
    request.computed = 304  # what the first wave's compact-prefill bug did
    with pytest.raises(EngineStalledError, match=r"request 'stuck' has 304 tokens computed of 297"):
        engine.step()
    request.computed = 297  # nothing left to feed, nothing to sample: no step can advance it
    with pytest.raises(EngineStalledError, match=r"no request can advance: 'stuck' \(running, 297/297"):
        engine.step()


def test_prefills_waiting_for_each_others_pages_preempt_instead_of_spinning(model):
    """Two 300-token prompts prefilled side by side, 6 pages of 64: after the first chunk of
    each, the older takes the last two pages, then neither can take its next chunk. The newest
    is preempted and recomputed later."""
    config, params, tokenizer = model
    budget = CacheBudget(num_slots=2, max_model_len=384, page_size=64, num_pages=6)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, prefill_chunk=128,
                                                               max_num_batched_tokens=256, prefill_mode="full"))
    rng = np.random.default_rng(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    for name in ("a", "b"):
        engine.add_request(name, [0] + rng.integers(3, 128000, 299).tolist(), greedy)
    outputs = run(engine)
    assert sorted(outputs) == ["a", "b"]
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs.values())
    assert engine.scheduler.num_preemptions >= 1
    assert engine.cache.free_slots == 2 and engine.cache.pages.free == 6
