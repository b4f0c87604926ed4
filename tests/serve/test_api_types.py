"""SamplingParams / RequestOutput types: vLLM names and defaults, validation, from_dict."""

import dataclasses

import pytest

from deepinfer.serve.api import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams

# vLLM's SamplingParams defaults after its __post_init__ (stop/stop_token_ids become lists).
VLLM_DEFAULTS = {
    "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "stop": [], "stop_token_ids": [], "ignore_eos": False, "max_tokens": 16, "min_tokens": 0,
    "include_stop_str_in_output": False, "logprobs": None, "prompt_logprobs": None,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "detokenize": True,
    "logit_bias": None, "structured_outputs": None,
}
# ours, not vLLM's: the prefix cache's TTL class (None: the engine's default)
EXTENSIONS = {"cache_ttl_class": None}


def test_defaults_match_vllm():
    p = SamplingParams()
    assert set(SamplingParams.field_names()) == set(VLLM_DEFAULTS) | set(EXTENSIONS)
    for name, value in {**VLLM_DEFAULTS, **EXTENSIONS}.items():
        assert getattr(p, name) == value, name
    # declared defaults (before normalization) are vLLM's too
    declared = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert declared["stop"] is None and declared["stop_token_ids"] is None
    assert declared["max_tokens"] == 16


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, logit_bias={3: -1})
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6] and p.top_k == 0
    assert p.logit_bias == {3: -1.0} and isinstance(p.logit_bias[3], float)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0), ("n", -1), ("n", 1.5),
        ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
        ("top_p", 0.0), ("top_p", 1.01),
        ("top_k", -2), ("top_k", 2.5),
        ("min_p", -0.1), ("min_p", 1.5),
        ("seed", 1.0),
        ("presence_penalty", 2.5), ("frequency_penalty", -3),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1),
        ("stop", 5), ("stop", ["ok", ""]), ("stop", ["ok", 3]),
        ("stop_token_ids", [1, -1]), ("stop_token_ids", "1"),
        ("ignore_eos", 1),
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("include_stop_str_in_output", "yes"),
        ("logprobs", -1), ("logprobs", True), ("prompt_logprobs", -2),
        ("skip_special_tokens", None), ("detokenize", 0),
        ("spaces_between_special_tokens", "no"),
        ("logit_bias", {"5": 1.0}), ("logit_bias", {5: float("inf")}), ("logit_bias", [1, 2]),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens:.*max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


def test_n_must_be_a_positive_int():
    assert SamplingParams(n=4).n == 4  # (parallel sampling: tests/serve/test_parallel_sampling.py)
    with pytest.raises(ValueError, match="^n: must be at least 1, got 0"):
        SamplingParams(n=0)


def test_from_dict_vllm_names_and_roundtrip():
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 40, "stop": ["a", "b"], "max_tokens": 100,
                                  "logprobs": 3, "seed": 7})
    assert (p.temperature, p.top_k, p.stop, p.max_tokens, p.logprobs, p.seed) == (0.5, 40, ["a", "b"], 100, 3, 7)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_from_dict_unknown_key():
    with pytest.raises(ValueError, match=r"^temprature: unknown sampling parameter.*'temperature'"):
        SamplingParams.from_dict({"temprature": 0.3})
    with pytest.raises(ValueError, match=r"^best_of: unknown"):
        SamplingParams.from_dict({"best_of": 2})


def test_from_dict_openai_names():
    p = SamplingParams.from_dict({
        "max_completion_tokens": 64, "logprobs": True, "top_logprobs": 5, "seed": 3, "stop": "\n\n",
        "logit_bias": {"128821": -100, "42": 2.5}, "temperature": None, "top_p": None,
    })
    assert p.max_tokens == 64 and p.logprobs == 5 and p.seed == 3 and p.stop == ["\n\n"]
    assert p.logit_bias == {128821: -100.0, 42: 2.5}
    assert p.temperature == 1.0 and p.top_p == 1.0  # null -> default
    assert SamplingParams.from_dict({"logprobs": True}).logprobs == 0
    assert SamplingParams.from_dict({"logprobs": False}).logprobs is None
    assert SamplingParams.from_dict({"max_tokens": 8, "max_completion_tokens": 8}).max_tokens == 8


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": 2, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_from_dict_invalid(body, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams.from_dict(body)


def test_output_types_have_vllm_fields():
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert names(Logprob) == ["logprob", "rank", "decoded_token"]
    assert names(CompletionOutput)[:7] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason"]
    assert names(CompletionOutput)[7:] == ["reasoning_content", "tool_calls"]  # extensions
    assert names(RequestOutput) == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
        "num_cached_tokens"]

    out = CompletionOutput(index=0, text="hi", token_ids=[6366, 1])
    assert out.reasoning_content is None and out.tool_calls is None and not out.finished()
    out.finish_reason, out.stop_reason = "stop", None
    assert out.finished()
    lp = Logprob(-0.25)
    assert lp.rank is None and lp.decoded_token is None

    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0)
    assert (m.time_in_queue, m.time_to_first_token, m.e2e_latency) == (0.5, 1.0, 3.0)
    assert RequestMetrics(arrival_time=1.0).e2e_latency is None
    ro = RequestOutput("r1", "hi", [0, 6366], None, [out], True, m, 0)
    assert ro.outputs[0].text == "hi" and ro.num_cached_tokens == 0
