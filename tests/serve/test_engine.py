"""The offline engine: continuous batching, abort, preemption with recompute, admission."""

import dataclasses

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.drafter import draft_after
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import AdmissionError, CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from tests.continuation import continuation_logits

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=3), load_tokenizer()


def make_engine(model, drafter_context=False, **budget):
    config, params, tokenizer = model
    budget = CacheBudget(**{"num_slots": 4, "max_model_len": 512, "page_size": 64, **budget})
    return LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, prefill_chunk=128, prefill_mode="full",
                                                             drafter_context=drafter_context))


def prompt(n, seed):
    ids = np.random.default_rng(seed).integers(3, 128000, n).tolist()
    return [0] + ids


def run(engine):
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
        assert steps < 500
    return outputs


def is_greedy_continuation(model, ids, tokens):
    """One causal forward over prompt + output: each output token must be the argmax after its
    prefix (by causality, the same as a step-by-step greedy loop; `tests/continuation.py`)."""
    config, params, _ = model
    return continuation_logits(config, params, ids, tokens).argmax(-1).tolist() == list(tokens)


def test_requests_join_and_leave_between_steps(model):
    engine = make_engine(model)
    engine.add_request("a", prompt(20, 1), SamplingParams(max_tokens=3, **GREEDY))
    engine.add_request("b", prompt(150, 2), SamplingParams(max_tokens=8, **GREEDY))
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] = out
    engine.add_request("c", prompt(40, 3), SamplingParams(max_tokens=2, **GREEDY))  # joins mid-flight
    outputs.update(run(engine))
    assert set(outputs) == {"a", "b", "c"}
    for rid, n in (("a", 3), ("b", 8), ("c", 2)):
        out = outputs[rid].outputs[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert is_greedy_continuation(model, outputs[rid].prompt_token_ids, out.token_ids)
    assert engine.cache.pages.free == engine.cache.layout.num_pages  # everything released
    assert engine.cache.free_slots == engine.cache.layout.num_slots


def test_abort_frees_the_slot_and_its_pages(model):
    engine = make_engine(model)
    engine.add_request("long", prompt(200, 4), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.cache.pages.free < engine.cache.layout.num_pages
    out = engine.abort("long")
    assert out.outputs[0].finish_reason == "abort" and out.finished
    assert engine.cache.pages.free == engine.cache.layout.num_pages
    assert engine.cache.free_slots == engine.cache.layout.num_slots
    assert not engine.has_unfinished()


def test_abort_after_a_step_that_raised_frees_the_slot(model, monkeypatch):
    """A request that a step finished just before it raised is still in the scheduler; the
    caller's clean-up abort must give its slot and pages back."""
    engine = make_engine(model)
    # a stop the host only sees in the token (not a count): the request is still scheduled when
    # the step that reads its token ends it (a step later under asynchronous scheduling)
    forced = SamplingParams(max_tokens=8, logit_bias={42: 100.0}, stop_token_ids=[42], **GREEDY)
    engine.add_request("done", prompt(20, 5), forced)

    def fail(plan, finished):
        if finished:
            raise RuntimeError("step failed after sampling")

    monkeypatch.setattr(engine, "_finish_stuck", fail)
    with pytest.raises(RuntimeError, match="after sampling"):
        for _ in range(3):
            engine.step()
    assert engine.requests["done"].finished
    assert engine.requests["done"] in engine.scheduler.running
    assert engine.abort("done") is None
    assert engine.cache.pages.free == engine.cache.layout.num_pages
    assert engine.cache.free_slots == engine.cache.layout.num_slots
    assert not engine.has_unfinished()


def test_preemption_recomputes_and_keeps_outputs_exact(model):
    """A pool too small for both sequences forces a preemption; the preempted request is
    recomputed later and still produces the greedy tokens of an unconstrained run."""
    engine = make_engine(model, num_pages=5)
    engine.add_request("x", prompt(130, 5), SamplingParams(max_tokens=100, **GREEDY))
    engine.add_request("y", prompt(130, 6), SamplingParams(max_tokens=100, **GREEDY))
    outputs = run(engine)
    assert engine.scheduler.num_preemptions >= 1
    for rid in ("x", "y"):
        out = outputs[rid]
        assert len(out.outputs[0].token_ids) == 100
        assert is_greedy_continuation(model, out.prompt_token_ids, out.outputs[0].token_ids), rid
    assert engine.cache.pages.free == engine.cache.layout.num_pages


def test_a_prompt_that_cannot_fit_is_rejected_and_others_continue(model):
    engine = make_engine(model)  # the module's cache layout: its step programs are compiled already
    with pytest.raises(AdmissionError, match=r"prompt of 601 tokens does not fit the context \(512 tokens\)"):
        engine.add_request("huge", prompt(600, 7), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [0, 10**7], SamplingParams(max_tokens=2))
    engine.add_request("ok", prompt(10, 8), SamplingParams(max_tokens=2, **GREEDY))
    assert run(engine)["ok"].outputs[0].finish_reason == "length"


def test_min_tokens_and_stop_token_ids(model):
    engine = make_engine(model)
    first = run_single(engine, prompt(30, 9), SamplingParams(max_tokens=6, **GREEDY))
    tokens = first.outputs[0].token_ids
    # stop on the third generated token: finish_reason "stop", stop_reason the token id
    out = run_single(engine, prompt(30, 9), SamplingParams(max_tokens=6, stop_token_ids=[tokens[2]], **GREEDY))
    assert out.outputs[0].token_ids == tokens[:3]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == tokens[2]
    # min_tokens suppresses the stop token until 4 tokens exist
    out = run_single(engine, prompt(30, 9),
                     SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=[tokens[0]], **GREEDY))
    assert len(out.outputs[0].token_ids) >= 4 and tokens[0] not in out.outputs[0].token_ids[:4]


def run_single(engine, ids, params):
    engine.add_request(f"r{len(engine.requests)}-{id(params)}", ids, params)
    outputs = run(engine)
    (out,) = outputs.values()
    return out


def test_drafts_of_running_requests_equal_the_whole_sequence_drafter(model):
    """Mid-generation, with two requests batched (one past the window, one short, one joined
    later), the engine's drafter rings give the drafts of the whole sequence so far. The rings
    are kept only when asked for (`drafter_context`; off by default: nothing drafts yet)."""
    config, params, _ = model
    plain = make_engine(model)
    assert plain.cache.layout.draft_rings == 0
    with pytest.raises(ValueError, match="drafter_context is off"):
        plain.draft([])
    engine = make_engine(model, drafter_context=True)
    assert engine.cache.layout.draft_rings == config.num_nextn_predict_layers
    engine.add_request("long", prompt(150, 4), SamplingParams(max_tokens=20, **GREEDY))
    engine.add_request("short", prompt(30, 5), SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(4):
        engine.step()
    engine.add_request("late", prompt(60, 6), SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(3):
        engine.step()
    drafts = engine.draft(["long", "short", "late"])
    for rid, got in drafts.items():
        ids = engine.requests[rid].all_ids
        ref = draft_after(params, config, np.asarray(ids[:-1])[None], np.asarray(ids[-1:]))
        assert got["tokens"].tolist() == np.asarray(ref["tokens"])[0].tolist(), rid
        rel = np.abs(got["logits"] - np.asarray(ref["logits"])[0]).max() / np.abs(np.asarray(ref["logits"])).max()
        assert rel <= 1e-4, (rid, rel)
    with pytest.raises(ValueError, match="'nope'"):
        engine.draft(["nope"])
    engine.add_request("waiting", prompt(10, 7), SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(ValueError, match="'waiting'"):
        engine.draft(["waiting"])


def test_sampling_state_is_written_at_admission_and_cleared_when_leaving(model):
    engine = make_engine(model)
    params = SamplingParams(max_tokens=50, temperature=0.8, seed=5, frequency_penalty=0.5, ignore_eos=True)
    engine.add_request("p", prompt(20, 11), params)
    engine.add_request("unseeded", prompt(20, 11), dataclasses.replace(params, seed=None))
    for _ in range(3):
        engine.step()
    request = engine.requests["p"]
    # the device counts the tokens it sampled, the one the host has not read yet too (asynchronous)
    state, slot, n = engine.runner.sampling, request.slot, len(request.output_ids) + request.pending
    assert float(state.temperature[slot]) == pytest.approx(0.8) and int(state.seed[slot]) == 5
    assert int(state.num_output[slot]) == n == 3 and int(np.asarray(state.output_counts[slot]).sum()) == n
    other = engine.requests["unseeded"]
    assert other.seed != 5 and int(state.seed[other.slot]) == other.seed  # drawn by the engine
    engine.abort("p")
    state = engine.runner.sampling
    assert float(state.temperature[slot]) == 0.0 and int(np.asarray(state.output_counts[slot]).sum()) == 0
    assert float(state.temperature[other.slot]) == pytest.approx(0.8)  # the other slot keeps its state


def test_a_preempted_sampled_request_resumes_its_sampling_state(model):
    """Seeded sampling with penalties and min_tokens: after preemption the slot's state is
    rebuilt from the request's output so far (counts, tokens generated), so the tokens are
    those of a run without preemption."""
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=9, presence_penalty=0.8, frequency_penalty=0.4,
                            repetition_penalty=1.3, min_tokens=70, ignore_eos=False)
    outputs = {}
    for pages in (5, None):  # None: the module's layout, whose step programs are compiled already
        engine = make_engine(model, num_pages=pages)
        engine.add_request("x", prompt(130, 5), dataclasses.replace(params, seed=1))
        engine.add_request("y", prompt(130, 6), params)
        outputs[pages] = {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}
        assert engine.scheduler.num_preemptions >= (1 if pages else 0)
    assert outputs[5] == outputs[None]
    assert all(len(set(tokens)) > 30 for tokens in outputs[5].values())  # sampled, penalised
