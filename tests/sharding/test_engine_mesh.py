"""The engine on a device mesh (attention data parallel + expert parallel) generates exactly the
tokens of the one-device engine, greedy and seeded, and spreads sequences over the dp ranks.

Exactly, up to each request's first close call (`undisputed`): where the forward chooses by a
hair (tests/choice_margins.py) or a token is chosen by a hair (`test_sampler.ref_token_margin`),
the mesh's other reduction order may choose otherwise, and the request's later tokens with it.

Every step pulls its logits to the host, so the CPU backend never queues collective programs
(they deadlock when too many are in flight; `../shared/spec/environment.md`)."""

import jax
import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.sampler import Sampler
from deepinfer.serve.engine.types import MAX_LOGPROBS
from deepinfer.sharding import make_mesh
from deepinfer.sharding.eplb import device_load, imbalance
from tests.argmax_check import assert_argmax_agrees
from tests.choice_margins import near_tie_finder
from tests.serve.test_sampler import ref_token_margin
from tests.continuation import FORWARD_LEN, continuation_logits

N_REQUESTS = 4
NEAR_TIE = 1e-5  # a choice of the forward decided by less than this (relative) may go either way
TOKEN_TIE = 1e-4  # a token chosen by less than this (of the logit scale / temperature) may go either way


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=3), load_tokenizer()


def requests():
    """Half greedy, half seeded sampling; prompts of one prefill chunk, one longer than the window."""
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate([20, 127, 60, 90][:N_REQUESTS]):
        ids = [0] + rng.integers(3, 128000, n).tolist()
        sampling = (SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
                    SamplingParams(max_tokens=5, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True))
        out.append((str(i), ids, sampling))
    return out


def generate(model, mesh=None, num_slots=8, **engine_options):
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer,
                       EngineConfig(budget=CacheBudget(num_slots=num_slots, max_model_len=256, page_size=64),
                                    prefill_chunk=128, prefill_mode="full", **engine_options), mesh=mesh)
    for rid, ids, sampling in requests():
        engine.add_request(rid, ids, sampling)
    engine.step()  # admits every request: one per rank (or two on dp=2)
    ranks = sorted(engine.cache.rank_of(r.slot) for r in engine.scheduler.running)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    return outputs, ranks, engine


@pytest.fixture(scope="module")
def single(model):
    outputs, _, engine = generate(model)
    return outputs, engine.runner.expert_load


def _undisputed(model, find, ids: list[int], sampling: SamplingParams, tokens: list[int],
                length: int = FORWARD_LEN) -> int:
    """How many of `tokens` (the one-device engine's output for `ids`) are decided by no close
    call: before the first position where the forward over prompt + output makes a choice by less
    than NEAR_TIE, and before the first token whose choice (the argmax, or the sampler's top-k cut
    and perturbed block and token scores, `ref_token_margin`) is closer than TOKEN_TIE. Each token
    before it must be what the numpy sampler draws from the forward's logits (a check of the
    one-device engine too)."""
    config, params, _ = model
    first = max(0, find(list(ids) + list(tokens[:-1])) - len(ids) + 1)  # output i: position len(ids) - 1 + i
    logits = continuation_logits(config, params, ids, tokens, length)
    tie = TOKEN_TIE * np.abs(logits).max() / max(sampling.temperature, 1e-5 if sampling.temperature else 1.0)
    for i in range(first):
        token, margin = ref_token_margin(logits[i], sampling, sampling.seed or 0, len(ids) + i, ids, tokens[:i])
        if margin < tie:
            return i
        assert token == tokens[i], f"token {i}: the one-device engine drew {tokens[i]}, the numpy sampler {token}"
    return first


@pytest.fixture(scope="module")
def undisputed(model, single):
    """Per request, how many of the one-device engine's tokens a mesh must reproduce exactly."""
    find = near_tie_finder(*model[:2], NEAR_TIE)
    counts = {rid: _undisputed(model, find, ids, sampling, single[0][rid]) for rid, ids, sampling in requests()}
    print(f"\ntokens compared per request: {counts}")
    assert sum(counts.values()) >= len(counts), counts  # (the prompts are fixed: most tokens are compared)
    return counts


def assert_same_tokens(ours: dict, reference: dict, undisputed: dict) -> None:
    assert sorted(ours) == sorted(reference)
    for rid, n in undisputed.items():
        assert ours[rid][:n] == reference[rid][:n], f"request {rid}: {ours[rid]} vs {reference[rid]}"


@pytest.mark.parametrize("spec", ["dp=2,cp=2,tp=2", "dp=4,cp=2", "dp=8"])
def test_data_parallel_engine_equals_one_device(model, single, undisputed, spec):
    mesh = make_mesh(spec)
    outputs, ranks, engine = generate(model, mesh)
    assert_same_tokens(outputs, single[0], undisputed)
    dp = mesh.shape["dp"]
    # new sequences go to the rank with the most free cache: spread evenly
    assert np.bincount(ranks, minlength=dp).max() - np.bincount(ranks, minlength=dp).min() <= 1
    # the expert counts the engine gathers for EPLB do not depend on the mesh (where no router
    # choice and no token is a close call: then every routed token is the same)
    if all(n == len(single[0][rid]) for rid, n in undisputed.items()):
        np.testing.assert_array_equal(engine.runner.expert_load, single[1])


def test_eplb_installs_layouts_between_steps_without_changing_outputs(model, single, undisputed):
    """Every 2 steps the engine plans a layout of 16 physical experts (8 logical, 8 devices) from
    the load it counted and installs it; the tokens stay those of the one-device engine."""
    mesh = make_mesh("dp=2,cp=2,tp=2")
    outputs, _, engine = generate(model, mesh, eplb_interval=2, eplb_slots=16)
    assert_same_tokens(outputs, single[0], undisputed)
    history = engine.balancer.history
    assert len(history) >= 2
    assert all(h["imbalance_after"] <= h["imbalance_before"] + 1e-9 for h in history)
    # the physical layout really changed: some expert has more than one replica
    count = np.asarray(engine.runner.params["layers"][0]["ffn"]["placement"]["count"])
    assert count.sum() == 16 and count.max() > 1
    # per-device load of the whole run: one expert per device vs the EPLB layout planned from it
    load = engine.runner.expert_load
    logical = imbalance(device_load(load, np.tile(np.arange(8), (load.shape[0], 1)), np.ones_like(load), 8))
    planned = imbalance(device_load(load, *engine.balancer.plan(load)[::2], 8))
    print(f"\nEPLB on the engine's counted load (tiny-v4.1-short, {load.sum()} routed pairs): max/mean device load "
          f"{logical.max():.3f} -> {planned.max():.3f} (worst layer), {logical.mean():.3f} -> {planned.mean():.3f} (mean)")
    assert planned.max() < logical.max()


@pytest.mark.parametrize("cp", [4])
def test_context_parallel_prefill_then_decode_equal_the_full_forward(model, cp):
    """Chunked prefill with each chunk's queries split zigzag over `cp` ranks (chunks of 128 and a
    ragged 45-token tail; prompt 301 > window 128 and > the candidate pool), then one-token
    decodes: every position's logits equal the one-device full forward. cp=4 only: cp=2 takes the
    same path here (the buckets are multiples of 2 x cp for both) and runs in test_cp_padding.py
    (cp=2 with a padded odd-length chunk, then decodes) and test_context_parallel.py."""
    import jax

    from deepinfer.model.kv_cache import FLOAT, CacheLayout
    from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, token_bucket

    config, params, _ = model
    ids = np.asarray(prompt_ids(303))
    layout = CacheLayout(num_slots=2, page_size=64, num_pages=16, max_pages_per_slot=8, storage=FLOAT)
    runner = ModelRunner(params, config, layout, mesh=make_mesh(f"cp={cp}", devices=jax.devices()[:cp]))
    table = np.full((2, 8), -1, np.int32)
    table[1, :5] = [3, 9, 1, 12, 6]
    out, start = [], 0
    for n in (128, 128, 45):
        work = [ChunkWork(1, ids[start:start + n], start, ids[:start])]
        out.append(runner.run(work, table, rows=1, tokens=token_bucket(n), all_logits=True)[0, :n])
        start += n
    while start < len(ids):
        out.append(runner.run([ChunkWork(1, ids[start:start + 1], start, ids[:start])], table, rows=2, tokens=1))
        start += 1
    ours, full = np.concatenate(out), np.asarray(forward(params, config, ids))
    upto = near_tie_finder(config, params, NEAR_TIE)(ids)  # (none in this prompt: all compared)
    rel = np.abs(ours[:upto] - full[:upto]).max() / np.abs(full).max()
    print(f"\ncp={cp}: chunked CP prefill + decode vs full forward: max rel diff {rel:.2e} (positions < {upto})")
    assert rel <= 1e-5
    assert_argmax_agrees(ours[:upto], full[:upto], 1e-5 * np.abs(full).max())


def prompt_ids(n, seed=5):
    ids = np.random.default_rng(seed).integers(3, 128000, n)
    ids[0] = 0
    return ids.tolist()


def test_prefix_cache_hits_on_a_mesh_equal_one_device(model):
    """A second prompt that extends the first hits its pages on its dp rank (3 pages, replayed
    from 256) and generates what the one-device engine with the same cache generates.

    Flip-aware: the first (cold) request up to its first close call (`_undisputed`; the prompts
    are ones whose forward makes no choice by less than NEAR_TIE: 10 of the seeds 1-11 give one
    at a position between 95 and 378). The second is computed from a bounded replay, which is not
    the cold forward (measured: its first token differs from the cold run's, whose top-2 logits
    are 0.056 apart), so it is compared with the one-device engine's output up to the first
    token whose top-2 log-probabilities are closer than TOKEN_TIE; the choices inside the replay
    have no reference to tell their margins."""
    from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig

    config, params, tokenizer = model
    rng = np.random.default_rng(3)
    first = [0] + rng.integers(3, 128000, 400).tolist()
    second = first + rng.integers(3, 128000, 60).tolist()
    find = near_tie_finder(config, params, NEAR_TIE)
    assert find(second) == len(second)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)

    def turns(mesh):
        engine = LLMEngine(params, config, tokenizer, EngineConfig(
            budget=CacheBudget(num_slots=4, max_model_len=1024, page_size=128), prefill_chunk=128,
            prefill_mode="full", prefix_cache=PrefixCacheConfig()), mesh=mesh)
        outputs = {}
        for rid, ids in (("first", first), ("second", second)):
            before = engine.stats["prompt_tokens"]
            engine.add_request(rid, ids, greedy)
            while engine.has_unfinished():
                for out in engine.step():
                    outputs[rid] = (list(out.outputs[0].token_ids), out.num_cached_tokens,
                                    engine.stats["prompt_tokens"] - before, out.outputs[0].logprobs)
        return outputs

    single = turns(None)
    assert single["second"][1:3] == (384, len(second) - 256)
    ours = turns(make_mesh("dp=2,cp=2,tp=2"))
    assert {rid: out[1:3] for rid, out in ours.items()} == {rid: out[1:3] for rid, out in single.items()}
    tokens, logprobs = single["second"][0], single["second"][3]
    gaps = [np.subtract(*sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]) for entry in logprobs]
    compared = {"first": _undisputed(model, find, first, greedy, single["first"][0], length=512),
                "second": next((i for i, gap in enumerate(gaps) if gap < TOKEN_TIE), len(tokens))}
    print(f"tokens compared: {compared}")
    for rid, n in compared.items():
        assert ours[rid][0][:n] == single[rid][0][:n], (rid, ours[rid][0], single[rid][0])


def test_a_mesh_compiles_the_model_once_per_step_shape_whatever_the_sampler_is_asked(model):
    """Log-probabilities select another sampler program on a mesh, never another copy of the
    model (as on one device): requests with and without logprobs, prefilled and decoding apart
    and together, run one model program per step shape and their tokens are those they get
    without logprobs."""
    config, params, tokenizer = model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 128000, n).tolist() for n in (30, 50)]

    def run(logprobs: list[int | None]):
        engine = LLMEngine(params, config, tokenizer,
                           EngineConfig(budget=CacheBudget(num_slots=2, max_model_len=256, page_size=64),
                                        prefill_chunk=128), mesh=make_mesh("dp=2", devices=jax.devices()[:2]))
        for i, (ids, n) in enumerate(zip(prompts, logprobs)):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True,
                                                           logprobs=n))
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0]
        return engine.runner.mesh_step, outputs

    step, mixed = run([2, None])
    _, plain = run([None, None])
    assert {r: o.token_ids for r, o in mixed.items()} == {r: o.token_ids for r, o in plain.items()}
    assert len(mixed["0"].logprobs) == 4 and mixed["1"].logprobs is None
    # one prefill step of both prompts, decode steps of both, then of the second alone: two step
    # shapes (2 rows x 128 tokens, 2 rows x 1), each one model program (the sampler reads no model
    # input: the prefill and the decode steps of 2 rows share it), and two samplers, with
    # logprobs (the first two steps) and without (the last); one model program per (shape,
    # sampler) would be three
    assert step.program_counts() == {"logits": 2, "sample": 2}, step.program_counts()
    # (a step where some row wants logprobs computes the top MAX_LOGPROBS for all its rows)
    assert {key[1] for key in step._steps if key[0] == "sample"} == {Sampler(MAX_LOGPROBS), Sampler(None)}


def test_structured_output_on_a_mesh_splits_decode_steps_as_on_one_device(model):
    """Asynchronous scheduling on a mesh: a decode step whose constrained row's last token is in
    flight runs its model half first and its sampler after the host built the masks (`run_split`,
    shard-mapped); the tokens are those of the synchronous mesh engine (the same programs), the
    constrained output is valid, and the model still compiles once per step shape."""
    from deepinfer.serve.api.types import StructuredOutputsParams

    config, params, tokenizer = model
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 128000, n).tolist() for n in (30, 50)]
    choices = ["alpha", "beta", "gamma"]

    def run(async_scheduling: bool):
        engine = LLMEngine(params, config, tokenizer,
                           EngineConfig(budget=CacheBudget(num_slots=2, max_model_len=256, page_size=64),
                                        prefill_chunk=128, async_scheduling=async_scheduling),
                           mesh=make_mesh("dp=2", devices=jax.devices()[:2]))
        engine.add_request("constrained", prompts[0], SamplingParams(
            max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=choices)))
        engine.add_request("free", prompts[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0]
        return engine, outputs

    engine, split = run(True)
    _, sync = run(False)
    assert {r: o.token_ids for r, o in split.items()} == {r: o.token_ids for r, o in sync.items()}
    assert split["constrained"].text in choices and len(split["free"].token_ids) == 8
    assert {"decode/model", "decode/sampler+masks"} <= {key[0] for key in engine.runner.compile_seconds}
    assert engine.runner.mesh_step.program_counts()["logits"] == 2  # prefill and decode, masks or not
