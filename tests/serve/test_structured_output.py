"""Structured output (`serve/structured`, `sampler.apply_bitmask`): every constrained output is
complete and valid, whatever the (random) model prefers; constrained requests leave their
unconstrained neighbours' outputs as they were; asynchronous scheduling and DSpark give the same
constrained outputs as the synchronous plain engine; bad specs are refused alone.

The constraints are bounded (string lengths, array sizes, integer ranges, compact JSON), so a
grammar must finish within `MAX_TOKENS` whatever tokens a random model picks: the tests do not
depend on which tokens the model happens to prefer. Comparisons between engines are flip-aware:
a greedy token may differ only where the reference's top two (masked) log-probabilities are a
near-tie. Prompts mix a short one with several-chunk ones (512-token chunks, compact prefill)."""

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
    config = load_config("tiny-v4.1", fake_quant=False, dtype="float32")
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


def _run(model, requests, **engine_options):
    config, params, tokenizer = model
    # every engine keeps the drafter's context, as the speculative one does: one cache layout, so
    # they share their compiled step programs
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=BUDGET, drafter_context=True,
                                                               **engine_options))
    for rid, prompt, sp, _ in requests:
        engine.add_request(rid, prompt, sp)
    outputs = {}
    while engine.has_unfinished():
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


def test_dspark_on_and_off_give_the_same_constrained_outputs(model):
    """Constrained rows verify no drafts (per-position masks are not built): they sample their one
    token under their mask in the verify step, beside a greedy request that speculates."""
    requests = [r for r in _constrained() if r[2].temperature == 0][:3]
    free = [("free", _prompts()[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), None)]
    engine, spec = _run(model, requests + free, speculative=SpeculativeConfig(num_speculative_tokens=5))
    assert engine.spec_counts.num_draft_tokens > 0  # the unconstrained request did speculate
    _, plain = _run(model, requests)
    for rid, *_ in requests:
        _agree(spec[rid], plain[rid])


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
    validate against the tools' schemas. (The embedded tiny-v4.1 cannot run a tools chat: the
    V4.1 template needs <｜System｜>, which the bundled V4 tokenizer lacks; as in test_text.py the
    tokenizer here is the V4 one plus that token.)"""
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
