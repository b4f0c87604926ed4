"""Deterministic mode on a device mesh (attention data parallel, expert parallel over every device,
cp replicas): a request's token ids and log-probabilities are the same bits alone and among other
prompts, with its prompt cut into other prefill chunks, whichever dp rank it lands on and whatever
the other ranks send its experts' devices. The same runs with the mode off give more than one
output: the test can fail.

Fake-quant on and the packed FP8/FP4 cache (the engine's defaults), as in
tests/serve/test_deterministic.py, whose single-device modes (mixed batches, prefix cache, DSpark)
this does not repeat. DSpark on the mesh in this mode gains plain decoding's bits."""

import jax
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.speculative import SpeculativeConfig
from deepinfer.serve.engine.types import SamplingParams
from deepinfer.sharding import make_mesh
from tests.serve.oracle_drafts import OracleDrafts
from tests.serve.test_deterministic import run_requests

BUDGET = CacheBudget(num_slots=4, max_model_len=512, page_size=256)  # two slots per dp rank
TARGETS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=5, ignore_eos=True, logprobs=1),
}


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short")
    return config, init_params(config, seed=0), load_tokenizer()


def _run(model, mesh, deterministic: bool, others: list[list[int]], order: list[int], chunk: int,
         speculative=None, inject=None) -> tuple[LLMEngine, dict]:
    """The engine and the targets' (token ids, logprobs) after one run of the targets (on one
    400-token prompt) and `others`, added in `order`, with prefill chunks of `chunk` tokens."""
    config, params, tokenizer = model
    rng = np.random.default_rng(1)
    target = rng.integers(100, 100_000, 400).tolist()
    options = EngineConfig(budget=BUDGET, prefill_chunk=chunk, deterministic=deterministic, speculative=speculative)
    engine = LLMEngine(params, config, tokenizer, options, mesh=mesh)
    requests = [(name, target, sp) for name, sp in TARGETS.items()]
    requests += [(f"other-{i}", p, SamplingParams(temperature=0.7, seed=i, max_tokens=3, ignore_eos=True))
                 for i, p in enumerate(others)]
    return engine, run_requests(engine, requests, order, TARGETS, inject)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("dp=2,cp=2", devices=jax.devices()[:4])


@pytest.fixture(scope="module")
def alone(model, mesh) -> dict:
    """Each mode's run of the targets alone: one per rank, chunks of 256."""
    return {deterministic: _run(model, mesh, deterministic, [], [0, 1], 256)[1] for deterministic in (True, False)}


def test_outputs_on_a_mesh_do_not_depend_on_the_batch(model, mesh, alone):
    rng = np.random.default_rng(2)
    others = [rng.integers(100, 100_000, n).tolist() for n in (200, 20)]
    unique = {}
    for deterministic in (True, False):
        # alone, and among the others in shuffled order (two rows on each rank) with chunks of 128
        runs = [alone[deterministic], _run(model, mesh, deterministic, others, [2, 1, 3, 0], 128)[1]]
        unique[deterministic] = {name: len({run[name] for run in runs}) for name in TARGETS}
    print(f"unique outputs per request on dp=2,cp=2: deterministic {unique[True]}, default {unique[False]}")
    assert unique[True] == {name: 1 for name in TARGETS}, unique
    assert max(unique[False].values()) > 1, unique


def test_speculative_decoding_on_a_mesh_gives_the_bits_of_plain_decoding(model, mesh, alone):
    """Fixed-k DSpark with oracle drafts (the plain run's continuation, one wrong token at a
    random place or none) in deterministic mode on the mesh: each rank's verify steps accept the
    right prefix and gain plain decoding's tokens and logprobs bit for bit."""
    plain = alone[True]
    oracle = OracleDrafts({name: list(tokens) for name, (tokens, _) in plain.items()}, 3)
    engine, speculative = _run(model, mesh, True, [], [0, 1], 256, SpeculativeConfig(num_speculative_tokens=3), oracle)
    assert speculative == plain
    right = oracle.right({name: list(tokens) for name, (tokens, _) in plain.items()})
    assert engine.spec_counts.num_accepted_tokens == right
    assert right > 0
