"""Structured output (`serve/structured`, `sampler.apply_bitmask`): every constrained output is
complete and valid, whatever the (random) model prefers; constrained requests leave their
unconstrained neighbours' outputs as they were; asynchronous scheduling and DSpark (whose verify
steps mask every position from the drafts before it) give the same constrained outputs as the
synchronous plain engine; bad specs are refused alone.

The constraints are bounded (string lengths, array sizes, integer ranges, compact JSON), so a
grammar must finish within `MAX_TOKENS` whatever tokens a random model picks: the tests do not
depend on which tokens the model happens to prefer. Comparisons between engines are flip-aware:
a greedy token may differ only where the reference's top two (masked) log-probabilities are a
near-tie. Prompts mix a short one with several-chunk ones (512-token chunks, compact prefill)."""

import dataclasses
import gc
import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams, StructuredOutputsParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.speculative import SpeculativeConfig

MAX_TOKENS = 96
NEAR_TIE = 1e-3
BUDGET = CacheBudget(num_slots=8, max_model_len=2048, page_size=256)
PROMPT_LENGTHS = (9, 700, 1300)

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                      "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "enum_pattern": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["color", "code"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "integer", "minimum": -50, "maximum": 50},
                         {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                          "additionalProperties": False}]},
    "array_optional": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "note": {"type": "string", "maxLength": 5}},
        "required": ["tags"], "additionalProperties": False},
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["positive", "negative", "neutral"]
THINK = (128821, 128822)  # <think>, </think>
LARK = """
start: "SELECT " column " FROM " table ";"
column: "id" | "name" | "email"
table: /[a-z]{1,8}/
"""


@pytest.fixture(autouse=True, scope="module")
def _fresh_programs():
    """This module compiles many step programs (masked, split, logprobs and verify variants of
    several prefill shapes: ~40 of one family, ~34,000 memory maps). A worker that ran other modules first could then
    reach `vm.max_map_count` (XLA aborted in a compilation here once, in a full run): start from
    JAX's caches and the unheld program families dropped, and print how many maps the module used."""
    import jax

    from deepinfer.serve.engine.programs import forget_unused, memory_maps

    forget_unused()
    jax.clear_caches()
    before = memory_maps()[0]
    yield
    used = memory_maps()[0]
    forget_unused()  # (the next module starts without this one's ~34,000 maps: measured 552 -> 34,775 alone)
    jax.clear_caches()
    gc.collect()
    print(f"test_structured_output: {before} -> {used} memory maps, {memory_maps()[0]} after")


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=5), load_tokenizer()


def _prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(100, 100_000, n).tolist() for n in PROMPT_LENGTHS]


def _constrained(logprobs=2):
    """(id, prompt, params, check) for every kind of constraint, greedy and sampled."""
    prompts = _prompts()
    out = []

    def add(rid, i, spec, check, **kw):
        kw = {"temperature": 0.0, "logprobs": logprobs, **kw}
        out.append((rid, prompts[i % len(prompts)],
                    SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec, **kw), check))

    for i, (name, schema) in enumerate(SCHEMAS.items()):
        def valid(text, schema=schema):
            jsonschema.validate(json.loads(text), schema)
        add(f"json-{name}", i, StructuredOutputsParams(json=schema, disable_any_whitespace=True), valid)
    add("json-sampled", 1, StructuredOutputsParams(json=SCHEMAS["nested"], disable_any_whitespace=True),
        lambda t: jsonschema.validate(json.loads(t), SCHEMAS["nested"]), temperature=1.0, seed=4, logprobs=None)
    add("regex", 2, StructuredOutputsParams(regex=REGEX), lambda t: _assert(re.fullmatch(REGEX, t), t))
    add("choice", 0, StructuredOutputsParams(choice=CHOICES), lambda t: _assert(t in CHOICES, t),
        temperature=1.0, seed=2, logprobs=None)
    add("lark", 1, StructuredOutputsParams(grammar=LARK),
        lambda t: _assert(re.fullmatch(r"SELECT (id|name|email) FROM [a-z]{1,8};", t), t))
    # a prompt that ends inside an open <think> block (DeepSeek's thinking mode): the model reasons
    # freely and the grammar applies after its </think> (which a bias makes it write at once)
    open_think, close_think = THINK
    add("reasoning", 0, StructuredOutputsParams(choice=CHOICES),
        lambda t: _assert(t.startswith("</think>") and t[len("</think>"):] in CHOICES, t),
        logit_bias={close_think: 50.0})
    out[-1] = (out[-1][0], out[-1][1] + [open_think], *out[-1][2:])
    return out


def _assert(ok, text):
    assert ok, f"output {text!r} breaks its constraint"


def _unconstrained():
    return [(f"free-{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2), None)
            for i, p in enumerate(_prompts())]


def _run(model, requests, inject=None, **engine_options):
    config, params, tokenizer = model
    # every engine keeps the drafter's context, as the speculative one does: one cache layout, so
    # they share their compiled step programs
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, drafter_context=True,
                                                               **engine_options))
    for rid, prompt, sp, _ in requests:
        engine.add_request(rid, prompt, sp)
    outputs = {}
    while engine.has_unfinished():
        if inject is not None:  # (a test's hook between steps)
            inject(engine)
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0]
    assert engine.cache.pages.free == engine.cache.layout.num_pages
    return engine, outputs


def _agree(got, ref) -> None:
    """Equal tokens, or equal up to a position where the reference's top two are a near-tie."""
    for i, token in enumerate(ref.token_ids):
        if i >= len(got.token_ids) or got.token_ids[i] != token:
            top = sorted((lp.logprob for lp in ref.logprobs[i].values()), reverse=True)
            assert len(top) > 1 and top[0] - top[1] < NEAR_TIE, \
                f"token {i}: {got.token_ids[i:i + 1]} != {token} (top-2 gap {top[0] - top[1]:.2e})"
            return
    assert len(got.token_ids) == len(ref.token_ids)


@pytest.fixture(scope="module")
def mixed(model):
    """Constrained and unconstrained requests in one batch (asynchronous scheduling, default)."""
    return _run(model, _constrained() + _unconstrained())


def test_every_constrained_output_is_complete_and_valid(mixed):
    engine, outputs = mixed
    for rid, _, sp, check in _constrained():
        out = outputs[rid]
        assert out.finish_reason == "stop", f"{rid}: {out.finish_reason} after {len(out.token_ids)} tokens: {out.text!r}"
        check(out.text)  # (ended by EOS, or when the grammar accepted nothing more)
    # asynchronous scheduling split the decode steps whose masks needed the tokens in flight
    kinds = {key[0] for key in engine.runner.compile_seconds}
    assert {"decode/model", "decode/sampler+masks"} <= kinds, kinds


def test_unconstrained_neighbours_are_unchanged(model, mixed):
    _, alone = _run(model, _unconstrained())
    _, outputs = mixed
    for rid, *_ in _unconstrained():
        _agree(outputs[rid], alone[rid])


def test_synchronous_and_asynchronous_scheduling_agree(model, mixed):
    _, outputs = mixed
    _, sync = _run(model, _constrained(), async_scheduling=False)
    for rid, _, sp, check in _constrained():
        if sp.temperature == 0:
            _agree(outputs[rid], sync[rid])
        else:  # (sampled: a near-tie of the noisy maxima cannot be told from the logprobs)
            check(sync[rid].text)


def test_dspark_verifies_constrained_drafts_under_a_mask_per_position(model, mixed):
    """Constrained requests speculate: in each verify step the drafts come to
    the host and each grammar masks every verify position from the drafts before it. With the
    (random) drafter's own drafts, greedy outputs equal plain decoding and sampled ones are
    valid; the step kinds show the split."""
    _, plain = mixed
    requests = _constrained(logprobs=None)
    engine, spec = _run(model, requests, speculative=SpeculativeConfig(num_speculative_tokens=5))
    assert engine.spec_counts.num_draft_tokens > 0
    assert {"verify/propose", "verify/check+masks"} <= {key[0] for key in engine.runner.compile_seconds}
    for rid, _, sp, check in requests:
        assert spec[rid].finish_reason == "stop", rid
        check(spec[rid].text)
        if sp.temperature == 0:
            _agree(spec[rid], plain[rid])


def test_dspark_oracle_drafts_are_accepted_exactly_as_far_as_they_are_right(model, mixed):
    """Drafts proposed on the host (the plain run's continuation, one token changed at a random
    place or none): every verify step of a constrained greedy request accepts exactly the right
    prefix, so each position's mask let through what the grammar allows after the drafts before
    it (the reasoning request's drafts open with `</think>`: the grammar starts inside the
    window), the correction and bonus tokens are drawn under their own masks, and the output
    equals plain decoding."""
    _, plain = mixed
    requests = [r for r in _constrained(logprobs=None) if r[2].temperature == 0]
    rng = np.random.default_rng(3)
    injected = []  # (request, output length, drafts offered)

    def inject(engine):
        for rid, request in engine.requests.items():
            ref, n = plain[rid].token_ids, len(request.output_ids)
            if not n or n >= len(ref) - 1:  # (prefilling: it verifies nothing this step)
                continue
            drafts = list(ref[n:n + 5])
            wrong = rng.integers(0, 7)  # 5, 6: all right
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % 1000
            request.host_drafts = drafts
            injected.append((rid, n, drafts))

    engine, outputs = _run(model, requests, inject, speculative=SpeculativeConfig(num_speculative_tokens=5))
    expected = 0
    for rid, n, drafts in injected:
        got = outputs[rid].token_ids[n:n + len(drafts)]
        expected += next((j for j, (d, t) in enumerate(zip(drafts, got)) if d != t), len(drafts))
    assert engine.spec_counts.num_accepted_tokens == expected
    for rid, _, sp, check in requests:
        check(outputs[rid].text)
        _agree(outputs[rid], plain[rid])
    # most tokens came from accepted drafts
    assert expected >= sum(len(outputs[rid].token_ids) for rid, *_ in requests) // 3, expected


def _jumping():
    """Greedy constrained requests with jump-forward on short prompts (below the compact
    prefill's replay, so the engine's logits are the full forward's: `_replay` checks them)."""
    rng = np.random.default_rng(5)
    out = []
    for rid, _, sp, check in _constrained(logprobs=None):
        if sp.temperature == 0 and rid != "reasoning":
            spec = dataclasses.replace(sp.structured_outputs, jump_forward=True)
            prompt = rng.integers(100, 100_000, int(rng.integers(5, 100))).tolist()
            out.append((rid, prompt, dataclasses.replace(sp, structured_outputs=spec), check))
    return out


def _replay(model, requests, outputs, strict: bool) -> int:
    """Walk each output through a fresh matcher beside one full forward over prompt + output:
    wherever the grammar forces tokens after a sampled one (and at the start) and they keep the
    tokenization canonical with the token before them, the output goes on with exactly
    llguidance's forced tokens (`strict`; else they may also have been sampled,
    as in a DSpark verify step), and every other token is the greedy choice under the grammar's
    mask of the forward's logits after its prefix, up to a near-tie. Returns the tokens forced."""
    from deepinfer.model.forward import forward
    from deepinfer.serve.structured import LLGuidanceBackend

    config, params, tokenizer = model
    backend = LLGuidanceBackend(tokenizer, config.vocab_size, config.eos_token_id)
    padded = np.full((len(requests), 256), config.pad_token_id, np.int32)
    for b, (rid, prompt, *_) in enumerate(requests):
        seq = prompt + outputs[rid].token_ids
        padded[b, :len(seq)] = seq
    logits = np.asarray(forward(params, config, padded))
    forced_total = 0
    for b, (rid, prompt, sp, _) in enumerate(requests):
        out, matcher = outputs[rid].token_ids, backend.matcher(backend.compile(sp.structured_outputs))
        i, may_force = 0, True
        while i < len(out):
            forced = matcher.compute_ff_tokens() if may_force and not matcher.is_stopped() else []
            if i and forced and not backend.canonical([out[i - 1], *forced]):
                forced = []  # (the engine does not jump where the boundary would not be canonical)
            if forced and (strict or out[i:i + len(forced)] == forced[:len(out) - i]):
                assert out[i:i + len(forced)] == forced[:len(out) - i], f"{rid}: token {i}: not the forced {forced}"
                assert matcher.consume_tokens(forced[:len(out) - i])
                i, may_force, forced_total = i + len(forced), False, forced_total + len(forced)
                continue
            mask = np.full((1, (config.vocab_size + 31) // 32), -1, np.int32)
            if not matcher.is_stopped():
                backend.fill([(matcher, 0)], mask)
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:config.vocab_size].astype(bool)
            row = np.where(allowed, logits[b, len(prompt) + i - 1], -np.inf)
            gap = row.max() - row[out[i]]
            assert gap < NEAR_TIE, f"{rid}: token {i} ({out[i]}) is not the masked argmax (gap {gap:.2e})"
            assert matcher.is_stopped() or matcher.consume_token(out[i])
            i, may_force = i + 1, True
    return forced_total


def test_jump_forward_appends_the_forced_tokens_and_samples_the_rest_from_the_model(model):
    """`jump_forward`: the tokens the grammar forces (at the start and after each sampled token)
    are appended without sampling and computed as one chunk; every other token is the model's
    masked greedy choice after the whole sequence before it (`_replay`). Asynchronous
    scheduling (the default: the forced tokens are found while the next decode step's model half
    runs, whose sample is then dropped) and DSpark (forcing after each verify step's tokens) give
    valid outputs, fewer steps than tokens."""
    requests = _jumping()
    engine, outputs = _run(model, requests)
    for rid, _, sp, check in requests:
        assert outputs[rid].finish_reason == "stop", rid
        check(outputs[rid].text)
    forced = _replay(model, requests, outputs, strict=True)
    assert forced == engine.stats["forced_tokens"] > 0
    assert engine.stats["generation_tokens"] == sum(len(o.token_ids) for o in outputs.values())
    engine, spec = _run(model, requests, speculative=SpeculativeConfig(num_speculative_tokens=5))
    assert engine.stats["forced_tokens"] > 0
    for rid, _, sp, check in requests:
        check(spec[rid].text)
    _replay(model, requests, spec, strict=False)


def test_jump_forward_finishes_a_forced_output_at_once_and_keeps_token_boundaries_canonical(model):
    """A grammar that forces everything (one choice): the request is complete when it is
    added, its output comes with the next step, and nothing is computed for it. Where the
    forced tokens would merge with the model's last token, no jump."""
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, drafter_context=True))
    engine.add_request("only", [5, 6, 7], SamplingParams(max_tokens=20, structured_outputs={
        "choice": ["positive"], "jump_forward": True}))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["only"] and outputs[0].outputs[0].text == "positive"
    assert outputs[0].outputs[0].finish_reason == "stop" and engine.stats["prompt_tokens"] == 0
    assert not engine.has_unfinished()
    # the model's "hel" then the forced "lo", " world" would not be how "hello world" is
    # tokenized: no jump there; the model samples on and the jump comes once the boundary is clean
    hel, before = tokenizer.token_to_id("hel"), engine.stats["forced_tokens"]
    engine.add_request("boundary", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, logit_bias={hel: 100.0},
                                                             structured_outputs={"choice": ["hello world", "xyz"],
                                                                                 "jump_forward": True}))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step())
    out = outputs["boundary"]
    assert out.text == "hello world" and out.token_ids[0] == hel, out
    assert engine.stats["forced_tokens"] - before <= len(out.token_ids) - 2  # "hel" and the next token sampled
    with pytest.raises(ValueError, match="structured_outputs.jump_forward: forced tokens are not sampled"):
        SamplingParams(logprobs=1, structured_outputs={"regex": "a+", "jump_forward": True})


def test_draft_masks_are_the_grammars_after_each_draft_and_leave_it_where_it_was(model):
    """`RequestConstraint.draft_masks` and `LLGuidanceBackend.fill_drafts`: position j's mask is
    the mask of a matcher that consumed drafts 1..j; reading stops at a draft the grammar refuses
    (its own position still masked); a request inside its reasoning is free up to `</think>`;
    the matcher is not advanced."""
    from deepinfer.serve.structured import LLGuidanceBackend, RequestConstraint, ThinkTokens

    config, _, tokenizer = model
    backend = LLGuidanceBackend(tokenizer, config.vocab_size, config.eos_token_id)
    grammar = backend.compile(StructuredOutputsParams(regex=REGEX))
    words = (config.vocab_size + 31) // 32
    valid = tokenizer.encode("123-ab").ids

    def expected(drafts):
        fresh, rows = backend.matcher(grammar), []
        for d in [None, *drafts]:
            if d is not None and not fresh.consume_token(d):
                break
            rows.append(np.full((1, words), -1, np.int32))
            backend.fill([(fresh, 0)], rows[-1])
        return np.concatenate(rows)

    think = ThinkTokens.of(tokenizer)
    for drafts, prompt in [(valid, [5]), (valid[:1] + [7], [5]), ([9, think.close, *valid], [5, think.open]),
                           ([9, 11], [5, think.open]), ([], [5]), ([9, think.close], [5, think.open])]:
        constraint = RequestConstraint.for_prompt(backend.matcher(grammar), prompt, think)
        where = constraint.draft_masks(drafts)
        masks = np.full((len(drafts) + 1, words), -1, np.int32)
        if where is not None:
            first, read = where
            backend.fill_drafts([(constraint.matcher, first, read)], masks)
            ref = expected(read)
            assert (masks[:first] == -1).all() and (masks[first:first + len(ref)] == ref).all()
        else:
            assert think.close not in drafts
        bit = lambda row, t: (int(row[t // 32]) >> (t % 32)) & 1
        if drafts == valid[:1] + [7]:
            assert len(ref) == 2 and not bit(masks[1], 7)  # refused at its own position
        # the matcher is where it was: it still accepts the valid text from its start
        if constraint.active:
            assert constraint.matcher.validate_tokens(valid) == len(valid)


def test_a_grammar_that_cannot_finish_ends_with_length_and_a_valid_prefix(model):
    config, _, tokenizer = model
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 40}
    long = ("endless", _prompts()[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                     structured_outputs={"json": schema}), None)
    neighbour = _constrained(logprobs=None)[5]  # the regex request
    _, outputs = _run(model, [long, neighbour])
    assert outputs["endless"].finish_reason == "length" and len(outputs["endless"].token_ids) == 12
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=config.vocab_size,
                                                          eos_token=config.eos_token_id),
                                   llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)
    assert matcher.consume_tokens(list(outputs["endless"].token_ids)) and not matcher.is_accepting()
    assert outputs["regex"].finish_reason == "stop" and re.fullmatch(REGEX, outputs["regex"].text)


@pytest.mark.parametrize("spec, field, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json", "strin"),
    ({"json": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "structured_outputs.json", "dependentRequired"),
    ({"json": "{not json"}, "structured_outputs.json", ""),
    ({"regex": "[a-z"}, "structured_outputs.regex", "unclosed"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar", "undefined_rule"),
])
def test_a_bad_spec_is_refused_naming_its_field_and_nothing_else_is_lost(model, spec, field, message):
    config, params, tokenizer = model
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, drafter_context=True))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=2, structured_outputs={"choice": ["a", "b"]}))
    with pytest.raises(ValueError, match=re.escape(field) + ".*" + re.escape(message)):
        engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=2, structured_outputs=spec))
    assert list(engine.requests) == ["good"]


def test_the_grammar_waits_for_the_end_of_reasoning():
    from deepinfer.serve.structured import RequestConstraint, ThinkTokens

    think = ThinkTokens.of(load_tokenizer())
    assert (think.open, think.close) == THINK

    class Matcher:
        def __init__(self):
            self.seen = []

        def consume_token(self, token):
            self.seen.append(token)
            return True

        def is_stopped(self):
            return False

    inside = RequestConstraint.for_prompt(Matcher(), [0, 5, think.open], think)
    assert not inside.active
    assert inside.accept(7) and inside.accept(think.close) and inside.active and inside.matcher.seen == []
    assert inside.accept(9) and inside.matcher.seen == [9]
    closed = RequestConstraint.for_prompt(Matcher(), [0, think.open, 5, think.close], think)  # thinking off
    assert closed.active


def test_structured_outputs_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown key 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams.from_dict({"structured_outputs": {"regex": "a+"}}).structured_outputs.regex == "a+"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert StructuredOutputsParams.from_response_format(fmt).json == {"type": "object"}
    assert StructuredOutputsParams.from_response_format({"type": "json_object"}).json_object
    assert StructuredOutputsParams.from_response_format({"type": "text"}) is None


def test_bitmask_unpacking_matches_llguidance():
    import jax.numpy as jnp
    from llguidance.numpy import apply_token_bitmask_inplace

    from deepinfer.serve.engine.sampler import apply_bitmask

    rng = np.random.default_rng(0)
    V = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = rng.standard_normal((3, V)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, (3, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    mask[1] = -1  # an unconstrained row
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, mask)
    np.testing.assert_array_equal(np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask))), expected)


@pytest.mark.parametrize("model_type", ["deepseek_v41", "deepseek_v4"])
def test_tool_call_grammar_walks_parse_into_valid_tool_calls(model_type):
    """Random walks through the tool-call grammar (each step a random token its mask allows) are
    DeepSeek tool-call blocks that deepseek-recipe parses into OpenAI tool calls whose arguments
    validate against the tools' schemas. (The tokenizer is the V4 one plus <｜System｜>, as a V4.1
    checkpoint's own has it; with the bundled one the engine spells it as a reserved placeholder,
    `serve.text.chat.STAND_IN_SYSTEM_TOKEN`.)"""
    import tokenizers
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from deepinfer.serve.text.chat import ChatOutputParser, prepare_chat
    from deepinfer.serve.structured.tool_calls import chat_constraint

    tok = tokenizers.Tokenizer.from_str(load_tokenizer().to_str())
    tok.add_tokens([tokenizers.AddedToken("<｜System｜>", special=False, normalized=False)])
    vocab = tok.get_vocab_size()
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                             "unit": {"enum": ["C", "F"]}},
            "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "add", "description": "Add numbers.", "parameters": {
            "type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9},
                                                        "minItems": 1, "maxItems": 3}},
            "required": ["values"]}}},
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    prompt = prepare_chat([{"role": "user", "content": "Weather in Paris, and 2 + 3?"}], model_type=model_type,
                          tokenizer=tok, thinking=False, tools=tools, tool_choice="required")
    assert prompt.output_constraint[0] == "tool_call_required"
    spec = chat_constraint(prompt.output_constraint, model_type=model_type, tokenizer=tok)
    llt = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=1)
    grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    rng = np.random.default_rng(0)
    mask = allocate_token_bitmask(1, vocab)
    calls = 0
    for walk in range(12):
        matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
        ids = []
        while not matcher.is_stopped() and len(ids) < 300:
            fill_next_token_bitmask(matcher, mask)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab])
            token = int(rng.choice(allowed))
            assert matcher.consume_token(token)
            ids.append(token)
        assert matcher.is_stopped(), f"walk {walk} did not finish: {tok.decode(ids, skip_special_tokens=False)!r}"
        parser = ChatOutputParser(tok, prompt)
        try:
            parser.push([t for t in ids if t != 1])
            parser.finish("stop")
            result = parser.result()
        finally:
            parser.close()
        assert result.tool_calls, tok.decode(ids, skip_special_tokens=False)
        for call in result.tool_calls:
            function = call["function"] if isinstance(call, dict) else call.function
            name = function["name"] if isinstance(function, dict) else function.name
            arguments = function["arguments"] if isinstance(function, dict) else function.arguments
            jsonschema.validate(json.loads(arguments), schemas[name])
            calls += 1
    assert calls >= 12
