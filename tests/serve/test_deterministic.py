"""Batch-invariant inference (`EngineConfig(deterministic=True)`), in the style of SGLang's
`test_deterministic` modes: a request's token ids and log-probabilities are the same bits alone,
inside batches of other sizes and compositions, in shuffled arrival orders, and with its prompt cut
into prefill chunks of 128 or 512 tokens; greedy, seeded sampling, and sampling without a seed
(whose seed then comes from the prompt, not from the arrival). The same runs with the mode off
must give more than one output somewhere: the test can fail.

Fake-quant on and the packed FP8/FP4 cache (the engine's defaults), so the smallest rounding
difference moves later logits visibly."""

import gc

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.types import SamplingParams
from deepinfer.serve.engine.speculative import SpeculativeConfig

BUDGET = CacheBudget(num_slots=8, max_model_len=1024, page_size=256)
MAX_TOKENS = 6


@pytest.fixture(autouse=True, scope="module")
def _fresh_programs():
    """The batch-invariant step programs are large (a loop per product): the module starts and
    ends with JAX's caches and the unheld program families dropped, so that a worker that ran other
    modules stays clear of `vm.max_map_count` (see test_structured_output)."""
    import jax

    from deepinfer.serve.engine.programs import forget_unused

    forget_unused()
    jax.clear_caches()
    yield
    forget_unused()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short")
    return config, init_params(config, seed=0), load_tokenizer()


def _prompts():
    rng = np.random.default_rng(1)
    target = rng.integers(100, 100_000, 700).tolist()  # two 512-token chunks (compact prefill)
    others = [rng.integers(100, 100_000, n).tolist() for n in (30, 5, 300)]
    return target, others


TARGETS = {  # the requests whose outputs are compared, all on the 700-token prompt
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
    "unseeded": SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
}


def _run(model, others: list, order: list[int], deterministic: bool, chunk: int = 512) -> dict:
    """The targets' (token ids, logprobs) after one engine run of the targets and `others`,
    added in `order` (indices into targets + others)."""
    config, params, tokenizer = model
    target, _ = _prompts()
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, prefill_chunk=chunk,
                                                               deterministic=deterministic))
    requests = [(name, target, sp) for name, sp in TARGETS.items()]
    requests += [(f"other-{i}", p, SamplingParams(temperature=0.7, seed=i, max_tokens=4, ignore_eos=True))
                 for i, p in enumerate(others)]
    for i in order:
        engine.add_request(*requests[i])
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished and o.request_id in TARGETS:
                c = o.outputs[0]
                out[o.request_id] = (tuple(c.token_ids), tuple(next(iter(d.values())).logprob for d in c.logprobs))
    return out


def _runs(model, deterministic: bool, chunking: bool = True) -> list[dict]:
    """single (alone), mixed (with short and long prompts, shuffled arrival), chunking (128)."""
    _, others = _prompts()
    rng = np.random.default_rng(3)
    mixed = list(range(3 + len(others)))
    rng.shuffle(mixed)
    runs = [_run(model, [], [0, 1, 2], deterministic), _run(model, others, mixed, deterministic)]
    if chunking:
        runs.append(_run(model, others[:2], [3, 0, 4, 1, 2], deterministic, chunk=128))
    return runs


def _unique(runs: list[dict]) -> dict[str, int]:
    return {name: len({run[name] for run in runs}) for name in TARGETS}


def test_outputs_do_not_depend_on_the_batch_or_the_chunking(model):
    on = _unique(_runs(model, True))
    off = _unique(_runs(model, False, chunking=False))
    print(f"unique outputs per request: deterministic {on} (3 runs), default {off} (2 runs)")
    assert on == {name: 1 for name in TARGETS}, on
    assert max(off.values()) > 1, off  # the runs differ enough to catch a variant step


def test_deterministic_mode_refuses_what_it_cannot_keep_invariant(model):
    config, params, tokenizer = model
    with pytest.raises(ValueError, match="deterministic: not available with speculative decoding"):
        LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, deterministic=True,
                                                          speculative=SpeculativeConfig()))
