"""Batch-invariant inference (`EngineConfig(deterministic=True)`), in the style of SGLang's
`test_deterministic` modes: a request's token ids and log-probabilities are the same bits alone,
inside batches of other sizes and compositions, in shuffled arrival orders, and with its prompt cut
into prefill chunks of 128 or 512 tokens; greedy, seeded sampling, and sampling without a seed
(whose seed then comes from the prompt, not from the arrival). The same runs with the mode off
must give more than one output somewhere: the test can fail. Prefix-cache hits (exact replay) give
the cold runs' bits, and DSpark (fixed-k with oracle drafts, confidence-scheduled) gives plain
decoding's.

Fake-quant on and the packed FP8/FP4 cache (the engine's defaults), so the smallest rounding
difference moves later logits visibly."""

import gc

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig
from deepinfer.serve.engine.types import SamplingParams
from deepinfer.serve.engine.speculative import SpeculativeConfig
from tests.serve.oracle_drafts import OracleDrafts

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


def run_requests(engine: LLMEngine, requests: list, order: list[int], names, inject=None) -> dict:
    """Add `requests` ((id, prompt, params)) to `engine` in `order` (indices), run them to their
    end (calling `inject(engine)` before each step) and return the (token ids, logprobs) of
    those whose id is in `names`."""
    for i in order:
        engine.add_request(*requests[i])
    out = {}
    while engine.has_unfinished():
        if inject is not None:
            inject(engine)
        for o in engine.step():
            if o.finished and o.request_id in names:
                c = o.outputs[0]
                out[o.request_id] = (tuple(c.token_ids), tuple(next(iter(d.values())).logprob for d in c.logprobs))
    return out


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
    return run_requests(engine, requests, order, TARGETS)


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


def test_one_prompt_fifty_times_among_others_gives_one_output(model):
    """SGLang's "single" mode: one seeded, top-p request with logprobs sent 50 times into one
    engine among other prompts (5 to 120 tokens), a few new requests after each step, so its
    copies are prefilled with 0 to 3 others and decode beside ever other neighbours: one
    unique output."""
    config, params, tokenizer = model
    rng = np.random.default_rng(8)
    prompt = rng.integers(100, 100_000, 100).tolist()
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True, logprobs=1)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, deterministic=True))
    queue = [("copy", prompt, sp)] * 50 + [
        ("other", rng.integers(100, 100_000, int(n)).tolist(),
         SamplingParams(temperature=0.7, seed=int(n), max_tokens=int(m), ignore_eos=True))
        for n, m in zip(rng.integers(5, 120, 25), rng.integers(1, 6, 25))]
    order = rng.permutation(len(queue))
    outputs, added = [], 0
    while added < len(order) or engine.has_unfinished():
        for _ in range(min(int(rng.integers(0, 4)), len(order) - added)):
            name, ids, sampling = queue[order[added]]
            engine.add_request(f"{name}-{added}", ids, sampling)
            added += 1
        for o in engine.step():
            if o.finished and o.request_id.startswith("copy"):
                c = o.outputs[0]
                outputs.append((tuple(c.token_ids), tuple(next(iter(d.values())).logprob for d in c.logprobs)))
    assert len(outputs) == 50
    assert len(set(outputs)) == 1, len(set(outputs))


def test_prefix_cache_hits_give_the_bits_of_cold_runs(model):
    """SGLang's "prefix" mode: prompts sharing prefixes of different lengths give the same bits
    when they hit the prefix cache (exact replay: the hit's pages, then the window halo
    recomputed from another chunk boundary) as cold, all in one batch without a cache."""
    config, params, tokenizer = model
    shared = np.random.default_rng(5).integers(100, 100_000, 1000).tolist()
    tail = [np.random.default_rng(6 + i).integers(100, 100_000, n).tolist() for i, n in enumerate((10, 30, 8))]
    prompts = {"whole": shared + tail[0], "part": shared[:800] + tail[1], "longer": shared + tail[2]}
    params_of = {"whole": TARGETS["greedy"], "part": TARGETS["seeded"], "longer": TARGETS["unseeded"]}

    def run(engine, names):
        for name in names:
            engine.add_request(name, prompts[name], params_of[name])
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    out[o.request_id] = (tuple(c.token_ids), tuple(next(iter(d.values())).logprob for d in c.logprobs),
                                         o.num_cached_tokens)
        return out

    # of the shared 800 and 1,000 tokens, the 768 of whole pages are cached and exact replay
    # recomputes the 636-token window halo before them from another chunk boundary (the layout
    # of the speculative test's engines, whose programs it shares)
    options = dict(budget=BUDGET, deterministic=True, drafter_context=True)
    cold = run(LLMEngine(params, config, tokenizer, EngineConfig(**options)), list(prompts))
    engine = LLMEngine(params, config, tokenizer, EngineConfig(prefix_cache=PrefixCacheConfig(replay="exact"), **options))
    warm = run(engine, ["whole"])
    warm.update(run(engine, ["part", "longer"]))
    assert [warm[n][2] for n in prompts] == [0, 768, 768], warm  # the later two hit the first's pages
    assert {n: v[:2] for n, v in warm.items()} == {n: v[:2] for n, v in cold.items()}


SPEC_TOKENS = 12
SPEC_K = 3


def _spec_requests():
    """Greedy, seeded-sampled and penalised requests (the verify positions' penalties count the
    drafts before them), with logprobs, beside short others."""
    target, others = _prompts()
    common = dict(max_tokens=SPEC_TOKENS, ignore_eos=True, logprobs=1)
    return [("greedy", others[2], SamplingParams(temperature=0.0, **common)),
            ("seeded", others[0], SamplingParams(temperature=1.0, top_p=0.9, seed=7, **common)),
            ("unseeded", others[2], SamplingParams(temperature=0.8, top_k=50, **common)),
            ("penalized", others[2], SamplingParams(temperature=0.0, frequency_penalty=2.0,
                                                    logit_bias={1000: 20.0, 2000: 20.0}, **common)),
            ("other", others[1], SamplingParams(temperature=0.7, seed=1, max_tokens=4, ignore_eos=True))]


def _spec_run(model, speculative, inject=None) -> tuple[LLMEngine, dict]:
    """(engine, {request: (token ids, logprobs)}) of one deterministic run of `_spec_requests`."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, deterministic=True, speculative=speculative,
                                                               drafter_context=True))
    for rid, prompt, sp in _spec_requests():
        engine.add_request(rid, prompt, sp)
    out = {}
    while engine.has_unfinished():
        if inject is not None:
            inject(engine)
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (tuple(c.token_ids), tuple(next(iter(d.values())).logprob for d in c.logprobs or ()))
    return engine, out


def test_speculative_decoding_gives_the_bits_of_plain_decoding(model):
    """DSpark in deterministic mode: a draft is accepted iff it is the token the plain sampler
    draws at its position, on the batch-invariant verify step, so every request (greedy, sampled
    with and without a seed, penalised) gains plain decoding's tokens and logprobs bit for bit.
    Fixed-k with oracle drafts (the plain run's continuation with one wrong token at a random
    place, or none: the random drafter of these weights accepts nothing), which exercises every
    verify position, and confidence-scheduled widths with the drafter's own drafts."""
    _, plain = _spec_run(model, None)
    oracle = OracleDrafts({rid: list(tokens) for rid, (tokens, _) in plain.items()}, SPEC_K)
    engine, fixed = _spec_run(model, SpeculativeConfig(num_speculative_tokens=SPEC_K), oracle)
    assert fixed == plain
    right = oracle.right({rid: list(tokens) for rid, (tokens, _) in plain.items()})
    assert engine.spec_counts.num_accepted_tokens == right
    assert right >= 2 * SPEC_TOKENS, right  # most verify positions of most steps were accepted drafts

    # a verify step costs a decode step at every width here: the widths follow the confidences
    scheduled = SpeculativeConfig(num_speculative_tokens=SPEC_K, enable_adaptive_verification=True,
                                  verify_step_seconds=(1.0,) * (SPEC_K + 1))
    engine, adaptive = _spec_run(model, scheduled)
    assert adaptive == plain
    assert engine.spec_counts.num_drafts > 0
