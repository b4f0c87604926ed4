"""Fuzzing `LLM.generate` the way a new user probes it: a few hundred seeded calls, each a valid
prompt next to one broken prompt or one broken sampling parameter. Every broken call must fail
before any work with a `ValueError` naming the prompt index and the field, and leave nothing in
the engine; the valid prompt then still completes. Before the fix an out-of-vocabulary
`logit_bias` id surfaced inside a batched step and failed every prompt of the call."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer.serve.api.types import SamplingParams

SMALL = dict(max_num_seqs=4, max_model_len=512, page_size=64, prefill_chunk=128, prefill_mode="full")
VOCAB = 129280
CASES = 300


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from deepinfer import LLM

    return LLM("tiny-v4.1-short", cache_dir=tmp_path_factory.mktemp("fuzz") / "tiny-v4.1-short-seed0", **SMALL)


def _junk(rng: np.random.Generator):
    """A value of a wrong type or out of every range."""
    choices = [math.nan, math.inf, -math.inf, -1, -10**30, 10**30, "1", "", None, True, [], {}, [1, 2], {"a": 1},
               1.5, b"\xff", object()]
    return choices[rng.integers(len(choices))]


def _is_invalid(fields: dict) -> bool:
    try:
        SamplingParams.from_dict(fields).check_vocabulary(VOCAB)
    except ValueError:
        return True
    return False


def _bad_sampling(rng: np.random.Generator) -> tuple[dict, str]:
    """(sampling fields, the field the error must name)."""
    kind = rng.integers(5)
    if kind == 0:
        token = int(rng.integers(VOCAB, 2 * VOCAB))
        return {"logit_bias": {token: float(rng.normal())}}, "logit_bias"
    if kind == 1:
        token = int(rng.integers(VOCAB, 10**9))
        return {"stop_token_ids": [1, token], "min_tokens": int(rng.integers(0, 3))}, "stop_token_ids"
    names = ["temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "max_tokens", "min_tokens", "logprobs", "stop", "stop_token_ids", "ignore_eos",
             "detokenize"]
    for _ in range(100):  # some junk is valid for some fields (a huge seed, None for a default)
        if kind == 2:
            name, fields = "logit_bias", {"logit_bias": {int(rng.integers(VOCAB)): _junk(rng)}}
        else:
            name = names[rng.integers(len(names))]
            fields = {name: _junk(rng)}
        if _is_invalid(fields):
            return fields, name
    raise AssertionError("no junk value found that is invalid")


def _bad_prompt(rng: np.random.Generator) -> tuple[object, str]:
    kind = rng.integers(6)
    if kind == 0:
        return [0, int(rng.integers(VOCAB, 10**12))], "vocabulary"
    if kind == 1:
        return [0, -int(rng.integers(1, 100))], "vocabulary"
    if kind == 2:
        return [0, _junk(rng) if rng.random() < 0.5 else 1.5], "integer|token|prompt"
    if kind == 3:
        return {"prompt_token_ids": [0] * int(rng.integers(600, 2000))}, "context"
    if kind == 4:
        junk = _junk(rng)
        return {"prompt": junk if not isinstance(junk, str) else b"text"}, "prompt"
    return [], "empty"


def test_broken_calls_name_the_prompt_and_field_and_lose_nothing(llm):
    rng = np.random.default_rng(2026)
    good_prompt = [0, 791, 6102, 315]
    good = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    steps = llm.engine.stats["steps"]
    for case in range(CASES):
        bad_index = int(rng.integers(2))
        if rng.random() < 0.6:
            fields, field = _bad_sampling(rng)
            prompts, params = [good_prompt, good_prompt], [good, good]
            params[bad_index] = fields
        else:
            bad, field = _bad_prompt(rng)
            prompts, params = [good_prompt, good_prompt], good
            prompts[bad_index] = bad
        with pytest.raises(ValueError) as error:
            llm.generate(prompts, params, use_tqdm=False)
        message = str(error.value)
        assert message.startswith(f"prompt {bad_index}:") or message.startswith("sampling_params"), (case, message)
        assert any(word in message for word in field.split("|")), (case, field, message)
    assert llm.engine.stats["steps"] == steps, "a broken call ran work"
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    out = llm.generate([good_prompt, good_prompt], good, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
    assert llm.engine.cache.pages.free == llm.engine.cache.layout.num_pages


def test_out_of_vocabulary_ids_are_refused_when_the_request_is_made(llm):
    with pytest.raises(ValueError, match=r"^prompt 1: logit_bias: token id 129280 is outside the vocabulary"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(logit_bias={129280: 1.0})], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt 0: stop_token_ids: token id 999999 is outside"):
        llm.generate(["a"], SamplingParams(stop_token_ids=[999999], min_tokens=2), use_tqdm=False)
    SamplingParams(logit_bias={VOCAB - 1: 1.0}).check_vocabulary(VOCAB)  # the last id is fine
