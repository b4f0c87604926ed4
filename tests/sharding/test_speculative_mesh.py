"""DSpark speculative decoding on a device mesh (dp ranks, experts over every device, cp replicas):
each rank drafts, verifies and rolls back its own rows (`serve.engine.mesh_speculative`). Greedy
outputs and log-probabilities are plain decoding's on one device (flip-aware), with the drafter's
own drafts and with oracle drafts, whose acceptance is exact: every verify step accepts the right
prefix and rolls back the rest. A constrained request's drafts come to the host from its rank, for
the masks of its verify positions."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.speculative import SpeculativeConfig
from deepinfer.serve.engine.types import SamplingParams, StructuredOutputsParams
from deepinfer.sharding import make_mesh
from tests.serve.oracle_drafts import OracleDrafts
from tests.serve.test_speculative import LOGPROBS, _agree, _logprobs_agree

BUDGET = CacheBudget(num_slots=4, max_model_len=1024, page_size=256)  # two slots per dp rank
K = 3
MAX_TOKENS = 12
REGEX = r"[0-9]{3}-[a-z]{2,4}"


@pytest.fixture(scope="module")
def model():
    """test_speculative's weights."""
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=5), load_tokenizer()


def _requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 100_000, n).tolist() for n in (9, 700, 300)]
    out = [(f"greedy-{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
           for i, p in enumerate(prompts)]
    out.append(("logprobs", prompts[2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       logprobs=LOGPROBS)))
    out.append(("regex", prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    structured_outputs=StructuredOutputsParams(regex=REGEX))))
    return out


def _run(model, mesh, speculative=None, inject=None, requests=None, logprobs=None) -> tuple[LLMEngine, dict]:
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, speculative=speculative,
                                                               drafter_context=True), mesh=mesh)
    for rid, prompt, sp in requests or _requests():
        engine.add_request(rid, prompt, sp if logprobs is None else dataclasses.replace(sp, logprobs=logprobs))
    outputs = {}
    while engine.has_unfinished():
        if inject is not None:
            inject(engine)
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0]
    assert engine.cache.pages.free == engine.cache.layout.num_pages
    return engine, outputs


@pytest.fixture(scope="module")
def plain(model):
    """Plain decoding on one device, with one logprob more than asked (it tells a near-tie)."""
    return _run(model, None, logprobs=LOGPROBS + 1)[1]


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("dp=2,cp=2", devices=jax.devices()[:4])


def test_speculation_on_a_mesh_equals_plain_decoding_on_one_device(model, plain, mesh):
    engine, outputs = _run(model, mesh, SpeculativeConfig(num_speculative_tokens=K))
    assert engine.spec_counts.num_draft_tokens > 0
    assert {"verify/propose", "verify/check+masks"} <= {key[0] for key in engine.runner.compile_seconds}
    for rid, _, _ in _requests():
        _agree(outputs[rid].token_ids, plain[rid])
    assert re.fullmatch(REGEX, outputs["regex"].text) and outputs["regex"].finish_reason == "stop"
    _logprobs_agree(outputs["logprobs"], plain["logprobs"])


def test_oracle_drafts_on_a_mesh_are_accepted_exactly_as_far_as_they_are_right(model, plain, mesh):
    """(Unconstrained requests: a grammar's end is no draft `OracleDrafts` can count;
    tests/serve/test_structured_output.py has constrained oracle drafts on one device.)"""
    requests = [r for r in _requests() if r[2].structured_outputs is None]
    oracle = OracleDrafts({rid: list(plain[rid].token_ids) for rid, _, _ in requests}, K)
    engine, outputs = _run(model, mesh, SpeculativeConfig(num_speculative_tokens=K), oracle, requests)
    for rid, _, _ in requests:
        _agree(outputs[rid].token_ids, plain[rid])
    expected = oracle.right({rid: list(c.token_ids) for rid, c in outputs.items()})
    assert engine.spec_counts.num_accepted_tokens == expected
    assert expected >= len(requests) * MAX_TOKENS // 3, expected  # most tokens from accepted drafts
    _logprobs_agree(outputs["logprobs"], plain["logprobs"])
