"""DSpark speculative decoding (`serve/engine/speculative.py`): verified greedy output equals plain
decoding, whatever the drafts; accepted drafts are counted exactly; the cache is left clean.

Numerics: fake-quant off (float32), so the verify step (6 tokens per row) and a decode step (1)
agree to ~1e-6 and a greedy token may differ only where the plain run's top-2 log-probabilities
are a near-tie; the comparison stops at such a position (`_agree`). Prompts span several
512-token prefill chunks at the engine's default chunking (compact prefill), mixed in one batch with
short ones, with sampled requests, a request that asks for logprobs and one whose penalties and
min_tokens ban make each verified position's distribution depend on the drafts before it."""

import dataclasses
import logging
import re

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.embedded import trained_weights
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.speculative import SpeculativeConfig
from deepinfer.serve.engine.verify_schedule import load_calibration
from tests.serve.test_sampler import EOS, ref_process
from tests.continuation import continuation_logits
from tests.serve.oracle_drafts import OracleDrafts

PROMPTS = (9, 300, 700)
MAX_TOKENS = 20
K = 5
NEAR_TIE = 1e-3
BUDGET = CacheBudget(num_slots=8, max_model_len=1024, page_size=256)


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=5), load_tokenizer()


def _prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(100, 100_000, n).tolist() for n in PROMPTS]


# tokens 1000 and 2000 are biased to the top and lose 2 per time they were generated: the plain
# run alternates between them for ~16 tokens, each choice decided by the counts of the tokens
# before it, so a verify position that did not count the drafts before it (in the same block)
# would choose otherwise (measured: from token 6 on, with the plain run's drafts offered)
PENALTIES = dict(logit_bias={1000: 20.0, 2000: 20.0}, frequency_penalty=2.0)
MIN_TOKENS = 8
LOGPROBS = 2


def _requests():
    """(id, prompt, params): greedy and sampled requests, all speculating."""
    prompts = _prompts()
    out = [(f"greedy-{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
           for i, p in enumerate(prompts)]
    out.append(("logprobs", prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       logprobs=LOGPROBS)))
    # verify position j sees the drafts before it as outputs: penalised, and EOS banned until
    # MIN_TOKENS tokens (`sampler.process_logits(earlier=)`)
    out.append(("penalized", prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS,
                                                        **PENALTIES)))
    out.append(("sampled", prompts[2], SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True)))
    # sampled, but top-k 1 leaves one token: its drafts, acceptance and draws take the sampled
    # path and must give the greedy request's tokens exactly
    out.append(("top1", prompts[0], SamplingParams(temperature=0.8, top_k=1, seed=11, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True)))
    return out


REFERENCE = {"top1": "greedy-0"}  # the plain run's request whose tokens a request must reproduce


def _run(model, speculative, inject=None, requests=None):
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, speculative=speculative))
    for rid, prompt, sp in requests or _requests():
        engine.add_request(rid, prompt, sp)
    outputs = {}
    while engine.has_unfinished():
        if inject is not None:
            inject(engine)
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0]
    assert engine.cache.pages.free == engine.cache.layout.num_pages
    assert engine.cache.free_slots == engine.cache.layout.num_slots
    return engine, outputs


@pytest.fixture(scope="module")
def plain(model):
    """The reference: plain decoding, with the top-2 logprobs of every greedy token."""
    config, params, tokenizer = model
    # the drafter's context kept as the speculative engines keep it: one cache layout, so the
    # engines share their prefill programs
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, drafter_context=True))
    for rid, prompt, sp in _requests():
        if sp.temperature == 0:  # the top log-probabilities that tell a near-tie
            sp = dataclasses.replace(sp, logprobs=LOGPROBS + 1)
        engine.add_request(rid, prompt, sp)
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0]
    return outputs


def _agree(got: list[int], ref) -> int:
    """Equal tokens up to the end, or up to a position where the reference's top two are a
    near-tie (either token is then correct and the continuations differ); the tokens compared."""
    for i, token in enumerate(ref.token_ids):
        if got[i] != token:
            top = sorted((lp.logprob for lp in ref.logprobs[i].values()), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, f"token {i}: {got[i]} != {token} (top-2 gap {top[0] - top[1]:.2e})"
            return i
    assert len(got) == len(ref.token_ids)
    return len(got)


def _greedy_after_processing(model, prompt: list[int], params: SamplingParams, tokens: list[int]) -> None:
    """Each of `tokens` is the argmax of the logits after its prefix as the sampler processes them
    (bias, min_tokens ban, penalties counting the tokens before it: `test_sampler.ref_process`),
    within the verify step's rounding: the model's logits from one causal forward over the prompt
    and the tokens (`tests/continuation.py`)."""
    config, params_tree, _ = model
    assert EOS == config.eos_token_id
    logits = continuation_logits(config, params_tree, prompt, tokens)
    for i, (row, token) in enumerate(zip(logits, tokens)):
        x = ref_process(row, params, prompt, list(tokens[:i]))
        assert x[token] >= x.max() - 1e-4 * np.abs(x).max(), (
            f"token {i}: {token} scores {x[token]:.6f}, {int(x.argmax())} scores {x.max():.6f} after processing")


def _check(model, plain, rid: str, got: list[int]) -> None:
    """A greedy request's output: the plain run's (`_agree`), or for the penalised request the
    processed argmax at every position (`_greedy_after_processing`)."""
    if rid == "penalized":
        prompt, params = next((p, sp) for r, p, sp in _requests() if r == rid)
        _greedy_after_processing(model, prompt, params, got)
    else:
        _agree(got, plain[REFERENCE.get(rid, rid)])


def _logprobs_agree(got, ref) -> None:
    """Each token's raw log-probability, rank and top alternatives as the plain run's while the
    tokens agree (the verify step computes them from its own logits: ~1e-6 apart). The plain run
    asked for one alternative more, which tells a near-tie for the last place."""
    for i in range(_agree(got.token_ids, ref)):
        ours, theirs = got.logprobs[i], ref.logprobs[i]
        token = got.token_ids[i]
        assert ours[token].rank == theirs[token].rank, (i, ours, theirs)
        ranked = sorted(theirs, key=lambda t: -theirs[t].logprob)
        last, next_ = (theirs[t].logprob for t in ranked[LOGPROBS - 1:LOGPROBS + 1])
        assert set(ours) == set(ranked[:LOGPROBS]) or last - next_ < NEAR_TIE, (i, ours, theirs)
        for t in set(ours) & set(theirs):
            assert abs(ours[t].logprob - theirs[t].logprob) < 1e-4, (i, t, ours[t], theirs[t])


def test_greedy_speculation_equals_plain_decoding(model, plain):
    engine, outputs = _run(model, SpeculativeConfig(num_speculative_tokens=K))
    assert engine.spec_counts.num_draft_tokens > 0
    for rid, _, sp in _requests():
        if sp.temperature == 0 or rid in REFERENCE:
            _check(model, plain, rid, outputs[rid].token_ids)
        else:  # a sampled request speculates too: same distribution, other draws (test_acceptance.py)
            assert len(outputs[rid].token_ids) == MAX_TOKENS
    # the logprobs of every token, accepted drafts included, as plain decoding's
    assert len(outputs["logprobs"].logprobs) == MAX_TOKENS
    _logprobs_agree(outputs["logprobs"], plain["logprobs"])


def test_confidence_scheduled_verification_equals_plain_decoding(model, plain):
    """`enable_adaptive_verification`: each step verifies the width Algorithm 1 picks from the
    requests' earlier confidences and the step-cost curve, or decodes plainly where no draft pays
    (width 0). The curve is given here (a real machine's profile varies) with a cliff: one to
    four drafts per row cost far more than a plain step, five little more, so the steps switch
    between plain decoding and five drafts as the confidences move (and the plain steps probe).
    Whatever the widths, greedy output is the plain output, and the counters count what was
    verified."""
    widths = []

    def record(engine):
        if not hasattr(engine.verify_schedule, "recorded"):
            choose = engine.verify_schedule.width
            engine.verify_schedule.recorded = True
            engine.verify_schedule.width = lambda *a: widths.append(choose(*a)) or widths[-1]

    seconds = (1.0, 9.0, 9.0, 9.0, 9.0, 1.5)
    speculative = SpeculativeConfig(num_speculative_tokens=K, enable_adaptive_verification=True,
                                    verify_step_seconds=seconds)
    engine, outputs = _run(model, speculative, record)
    assert engine.verify_schedule.step_seconds.tolist() == list(seconds)
    for rid, _, sp in _requests():
        if sp.temperature == 0 or rid in REFERENCE:
            _check(model, plain, rid, outputs[rid].token_ids)
        else:
            assert len(outputs[rid].token_ids) == MAX_TOKENS
    assert set(widths) == {0, K}, widths
    counts = engine.spec_counts
    assert 0 < counts.num_draft_tokens <= K * counts.num_drafts


def test_oracle_drafts_are_accepted_exactly_as_far_as_they_are_right(model, plain):
    """Host drafts (`Request.host_drafts`) replaced by the reference continuation with one wrong
    token at a random place (or none): every verify step accepts exactly the right prefix and
    the output and its logprobs are unchanged. Greedy requests only: their acceptance is exact."""
    # requests whose acceptance is exact (a sampled request's is random)
    exact = [r for r in _requests() if r[2].temperature == 0 or r[0] in REFERENCE]
    oracle = OracleDrafts({rid: list(plain[REFERENCE.get(rid, rid)].token_ids) for rid, _, _ in exact}, K)
    engine, outputs = _run(model, SpeculativeConfig(num_speculative_tokens=K), oracle, exact)
    for rid, _, sp in exact:
        _check(model, plain, rid, outputs[rid].token_ids)
    expected = oracle.right({rid: list(c.token_ids) for rid, c in outputs.items()})
    assert engine.spec_counts.num_accepted_tokens == expected
    # most tokens came from accepted drafts: far fewer steps than tokens
    assert expected >= len(exact) * MAX_TOKENS // 3, expected
    # the logprobs of accepted drafts and of the token after them, as plain decoding's
    _logprobs_agree(outputs["logprobs"], plain["logprobs"])


def test_speculative_config_is_checked(model):
    config, params, tokenizer = model
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    for bad in ("1.0", [1.0, 0.0, 1.0, 1.0, 1.0], [1.0, float("nan")] * 3, [True] * 5):
        with pytest.raises(ValueError, match="confidence_temperatures must be a list of positive numbers"):
            SpeculativeConfig(confidence_temperatures=bad)
    with pytest.raises(ValueError, match=r"confidence_temperatures: one per draft position verified, at least "
                                         r"num_speculative_tokens \(5\), got 4"):
        SpeculativeConfig(confidence_temperatures=[1.0] * 4)
    assert SpeculativeConfig(num_speculative_tokens=2, confidence_temperatures=[1, 2.5]).confidence_temperatures \
        == (1.0, 2.5)
    for bad in ((1.0, 2.0), [1.0] * 5 + [0.0], [1.0] * 5 + [float("inf")], "1.0"):
        with pytest.raises(ValueError, match=r"verify_step_seconds: a plain decode step's cost, then one per width "
                                             r"1 \.\. 5 \(6 positive numbers\)"):
            SpeculativeConfig(enable_adaptive_verification=True, verify_step_seconds=bad)
    assert SpeculativeConfig(num_speculative_tokens=1, verify_step_seconds=[1, 2]).verify_step_seconds == (1.0, 2.0)
    with pytest.raises(ValueError, match="confidence_temperatures: 6 given, one per position of the DSpark drafter's "
                                         "block of 5 at most"):
        LLMEngine(params, config, tokenizer, EngineConfig(
            budget=BUDGET, speculative=SpeculativeConfig(confidence_temperatures=[1.0] * 6)))
    with pytest.raises(ValueError, match="exceeds the DSpark drafter's block"):
        LLMEngine(params, config, tokenizer, EngineConfig(
            budget=BUDGET, speculative=SpeculativeConfig(num_speculative_tokens=config.dspark_block_size + 1)))
    no_drafter = {k: v for k, v in params.items() if k != "mtp"}
    with pytest.raises(ValueError, match="DSpark drafter"):
        LLMEngine(no_drafter, config, tokenizer, EngineConfig(budget=BUDGET, speculative=SpeculativeConfig()))


def test_llm_speculative_config(tmp_path, caplog):
    """`LLM(speculative_config=...)` (vLLM's dict) turns it on: the embedded model's drafter
    verifies drafts, the warm-up compiles the verify shapes (nothing compiles mid-stream) and
    the output is as long as asked; a bad key or value is refused by name."""
    from deepinfer import LLM

    small = dict(cache_dir=tmp_path / "tiny", max_num_seqs=2, max_model_len=256, page_size=64, prefill_chunk=128,
                 compilation_cache=None, log_stats_interval=None)
    with pytest.raises(ValueError, match="speculative_config: enable_adaptive_verification must be true or false"):
        LLM(speculative_config={"method": "dspark", "enable_adaptive_verification": "yes"}, **small)
    with pytest.raises(ValueError, match="speculative_config.draft_model: unknown key"):
        LLM(speculative_config={"method": "dspark", "draft_model": "x"}, **small)
    with pytest.raises(ValueError, match="speculative_config: confidence_temperatures must be a list"):
        LLM(speculative_config={"method": "dspark", "confidence_temperatures": [1.0, -1.0]}, **small)
    llm = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 3}, **small)
    # the embedded trained checkpoint carries its drafter's STS temperatures, and LLM takes them
    sts = tuple(trained_weights()["sts"]["temperatures"])
    assert load_calibration(llm.model_dir) == sts
    assert llm.engine.speculative == SpeculativeConfig(num_speculative_tokens=3, confidence_temperatures=sts)
    llm.log_stats_interval = 0  # log after every step: each verify step's spec-decode line
    with caplog.at_level(logging.INFO, logger="deepinfer.llm"):
        out = llm.generate([[0, 101, 102, 103]], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 9
    counts = llm.engine.spec_counts
    assert counts.num_draft_tokens > 0
    # vLLM's spec-decode log line per interval; over all of them, the counters
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding metrics: ")]
    assert len(lines) == counts.num_drafts  # (one request: one verify row per step)
    fields = [dict(re.findall(r"(Accepted|Drafted): (\d+) tokens", line)) for line in lines]
    assert sum(int(f["Accepted"]) for f in fields) == counts.num_accepted_tokens
    assert sum(int(f["Drafted"]) for f in fields) == counts.num_draft_tokens
    assert re.search(r"Mean acceptance length: \d\.\d\d, .* Per-position acceptance rate: [\d.]+, [\d.]+, [\d.]+, "
                     r"Avg Draft acceptance rate: \d+\.\d%$", lines[0]), lines[0]
    # vLLM's spec-decode counters, in get_metrics and in the Prometheus exposition of run-batch
    m = llm.get_metrics()
    assert m["vllm:spec_decode_num_draft_tokens"] == llm.engine.spec_counts.num_draft_tokens
    assert m["vllm:spec_decode_num_accepted_tokens"] == llm.engine.spec_counts.num_accepted_tokens
    per_pos = [m["vllm:spec_decode_num_accepted_tokens_per_pos"][str(j)] for j in range(3)]
    assert sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # accepting draft j needs every draft before it
    assert 0 < m["vllm:spec_decode_num_drafts"] <= m["vllm:spec_decode_num_draft_tokens"]
    from prometheus_client import generate_latest

    from deepinfer.serve.api.batch import metrics_registry

    text = generate_latest(metrics_registry(llm)).decode()
    assert f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{llm.model_name}"}} ' \
           f'{float(m["vllm:spec_decode_num_drafts"])}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name=' in text
    assert 'position="2"' in text
    compiled = set(llm.engine.runner.compile_seconds)
    assert any(key[0] == "verify" for key in compiled) and not any(key[0] == "decode" for key in compiled)
    llm.generate([[0, 104, 105]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert set(llm.engine.runner.compile_seconds) == compiled  # the second call compiled nothing
    # temperatures given win over the checkpoint's
    mine = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                                   "confidence_temperatures": [1, 1.5, 2]}, **small)
    assert mine.engine.speculative.confidence_temperatures == (1.0, 1.5, 2.0)


def test_llm_adaptive_verification_compiles_every_width_at_warm_up(tmp_path):
    """With confidence-scheduled verification the engine profiles its step costs at start and
    the warm-up compiles a plain decode step and a verify step of every width for each page
    bucket: whatever width the steps choose, nothing compiles mid-stream."""
    from deepinfer import LLM

    llm = LLM("tiny-v4.1-short", cache_dir=tmp_path / "tiny", max_num_seqs=1, max_model_len=128, page_size=64,
              prefill_chunk=128, compilation_cache=None, log_stats_interval=None,
              speculative_config={"method": "dspark", "num_speculative_tokens": 2,
                                  "enable_adaptive_verification": True})
    seconds = llm.engine.verify_schedule.step_seconds
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert llm.engine.verify_schedule.temperatures is None  # (a random checkpoint: no calibration)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate([[0, 101, 102, 103]], params, use_tqdm=False)
    compiled = set(llm.engine.runner.compile_seconds)
    assert {key[2] for key in compiled if key[0] == "verify"} == {2, 3}  # tokens: the anchor and 1 or 2 drafts
    assert any(key[0] == "decode" for key in compiled)
    llm.engine.verify_schedule.step_seconds = np.array([1.0, 9.0, 1.2])  # the steps now verify two drafts or none
    llm.generate([[0, 104, 105]], params, use_tqdm=False)
    llm.engine.verify_schedule.step_seconds = np.array([1.0, 1.1, 9.0])  # one or none
    llm.generate([[0, 106, 107]], params, use_tqdm=False)
    assert set(llm.engine.runner.compile_seconds) == compiled
