"""Prompt logprobs (`SamplingParams.prompt_logprobs`, `serve/engine/prompt_logprobs.py`): every prompt
token's raw log-probability and rank, and the top alternatives, equal the full forward's over a
prompt of three prefill chunks, also when the prompt's pages are in the prefix cache (a scored
request reads none), in compact prefill (it computes every token with the decoder) and on a mesh."""

import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig
from deepinfer.serve.engine.types import MAX_LOGPROBS, SamplingParams
from tests.choice_margins import near_tie_finder

PROMPT = np.random.default_rng(9).integers(100, 100_000, 300).tolist()  # chunks of 128, 128 and 44
# a step equals the full forward to 2e-5 of the logit scale before the first near-tie of a choice
# (tests/serve/test_steps.py, whose values these are); a log-probability adds its log-sum-exp
NEAR_TIE, TOLERANCE = 1e-5, 2e-5


@pytest.fixture(scope="module")
def model():
    # fake-quant off (float cache), as in test_steps.py: with it on, an FP8/FP4 rounding boundary
    # that the step and the forward straddle differently moves later logits visibly
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=0), load_tokenizer()


def _run(engine: LLMEngine, requests: list) -> dict:
    for request in requests:
        engine.add_request(*request)
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, o) for o in engine.step())
    return out


def _check_against(entries: list, prompt: list[int], ref: np.ndarray, k: int, upto: int, atol: float) -> None:
    """`entries` (an output's prompt_logprobs) against the forward's log-softmax `ref [T, V]`
    (row p predicts token p + 1) at the positions whose row is before `upto`: the prompt token's
    logprob and rank, the k alternatives' logprobs and ranks, all flip-aware (a rank or an
    alternative may differ only within a tie of 2 * atol in the reference)."""
    ATOL = atol
    assert len(entries) == len(prompt) and entries[0] is None
    assert all(e is not None for e in entries[1:])
    for position in range(1, min(len(prompt), upto + 1)):
        row, entry, token = ref[position - 1], entries[position], prompt[position]
        best = np.sort(row)[::-1]
        assert token in entry and len(entry) in (k, k + 1), (position, entry)
        chosen = entry[token]
        assert abs(chosen.logprob - row[token]) < ATOL, (position, chosen.logprob, row[token])
        ties = np.abs(row - row[token]) < 2 * ATOL
        assert abs(chosen.rank - (np.sum(row >= row[token]))) <= np.sum(ties), (position, chosen.rank)
        ranked = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _, _ in ranked] == list(range(1, k + 1)), (position, entry)
        for rank, t, lp in ranked:
            assert abs(lp.logprob - row[t]) < ATOL and abs(row[t] - best[rank - 1]) < 2 * ATOL, (position, rank, t)
        assert isinstance(chosen.decoded_token, str)


def test_prompt_logprobs_equal_the_full_forward(model):
    """A 300-token prompt (three chunks) asked with 3 alternatives, after an identical prompt filled
    the prefix cache (compact prefill, the defaults otherwise): it reads no cached page and its
    prompt logprobs equal the forward's; with 0 alternatives each position holds the prompt token
    alone; its first generated token is the forward's argmax (where no near-tie can flip it);
    the request that did not ask has none."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(
        budget=CacheBudget(num_slots=2, max_model_len=512, page_size=64), prefill_chunk=128,
        prefix_cache=PrefixCacheConfig()))
    greedy = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = _run(engine, [("plain", PROMPT, SamplingParams(**greedy))])
    assert first["plain"].prompt_logprobs is None
    out = _run(engine, [("scored", PROMPT, SamplingParams(prompt_logprobs=3, **greedy)),
                        ("bare", PROMPT[:40], SamplingParams(prompt_logprobs=0, **greedy))])
    assert out["scored"].num_cached_tokens == 0
    assert engine.scheduler.prefix_stats["hits"] == 0  # (the scored request did not look the prompt up)

    logits = np.asarray(forward(params, config, np.asarray([PROMPT])), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    ref = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    upto = near_tie_finder(config, params, NEAR_TIE)(PROMPT)
    atol = 2 * TOLERANCE * np.abs(logits).max()
    assert upto > 200  # (this prompt's first near-tie: most positions are compared)
    _check_against(out["scored"].prompt_logprobs, PROMPT, ref, 3, upto, atol)
    bare = out["bare"].prompt_logprobs
    assert len(bare) == 40 and all(len(e) == 1 and PROMPT[p] in e for p, e in enumerate(bare) if p)
    assert all(abs(bare[p][PROMPT[p]].logprob - ref[p - 1, PROMPT[p]]) < atol for p in range(1, min(40, upto + 1)))

    top2 = np.sort(logits[-1])[-2:]
    if upto == len(PROMPT) and top2[1] - top2[0] > 2 * atol:
        assert out["scored"].outputs[0].token_ids[0] == int(logits[-1].argmax())


def test_prompt_logprobs_on_a_mesh_equal_the_full_forward(model):
    """On a mesh (dp=2, cp=2, tp=2: the scored chunks split over cp, the sampler shard-mapped) the
    same 300-token prompt's logprobs equal the forward's, next to a request that asks for none on
    the other rank; the scored request's first token is the forward's argmax (where no near-tie
    can flip it)."""
    from deepinfer.sharding import make_mesh

    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(
        budget=CacheBudget(num_slots=4, max_model_len=512, page_size=64), prefill_chunk=128),
        mesh=make_mesh("dp=2,cp=2,tp=2"))
    greedy = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = _run(engine, [("scored", PROMPT, SamplingParams(prompt_logprobs=2, **greedy)),
                        ("plain", PROMPT[:70], SamplingParams(**greedy))])
    assert sorted(engine.cache.rank_of(s) for s in (0, 2)) == [0, 1]  # (two ranks of two slots)
    assert out["plain"].prompt_logprobs is None and len(out["plain"].outputs[0].token_ids) == 2

    logits = np.asarray(forward(params, config, np.asarray([PROMPT])), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    ref = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    upto = near_tie_finder(config, params, NEAR_TIE)(PROMPT)
    atol = 2 * TOLERANCE * np.abs(logits).max()
    _check_against(out["scored"].prompt_logprobs, PROMPT, ref, 2, upto, atol)
    top2 = np.sort(logits[-1])[-2:]
    if upto == len(PROMPT) and top2[1] - top2[0] > 2 * atol:
        assert out["scored"].outputs[0].token_ids[0] == int(logits[-1].argmax())


def test_too_many_prompt_logprobs_is_a_clear_error(model):
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=CacheBudget(num_slots=2, max_model_len=512,
                                                                                  page_size=64)))
    with pytest.raises(ValueError, match=f"^prompt_logprobs: at most {MAX_LOGPROBS} alternatives"):
        engine.add_request("x", PROMPT[:10], SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1))
    assert not engine.has_unfinished()
