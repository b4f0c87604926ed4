"""Engine outputs recorded from the first-wave engine (before the engine-step redesign), and the
flip-aware comparison against them.

The redesign (one jitted step that samples on the device, decode that gathers only the selected
entries, ...) changes reduction orders, never the model: greedy tokens and their logprobs must stay
what the old engine produced. Run this module to (re)record the fixture:

    python -m tests.serve.engine_baseline [KIND ...]

With KINDs (names of `SAMPLING`), only those are re-recorded and the others are kept as they are:
the seeded kinds were re-recorded when the sampler's noise changed from full-vocabulary threefry
to the counter-based hash (`serve/engine/sampler.py`); the greedy kind is still the first-wave
engine's.

Numerics: fake-quant off (float32), so two correct programs agree to ~1e-6 and a token may differ
only where the recorded top-2 logprobs are a near-tie. The engine itself runs at its defaults
(compact prefill, 512-token chunks, default cache budget), with prompts of several chunks mixed
with short ones in one batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).parent / "fixtures" / "engine_baseline.json"
PROMPT_LENGTHS = (7, 60, 300, 700, 1300, 2100)
MAX_TOKENS = 12
LOGPROBS = 5
NEAR_TIE = 1e-3  # two logprobs closer than this may swap order between correct programs
LOGPROB_TOLERANCE = 1e-4

# (name, SamplingParams keyword arguments) run as one batch
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, seed=1234),
    "seeded_top_p": dict(temperature=0.8, top_p=0.9, seed=99),
    "seeded_top_k_penalties": dict(temperature=1.0, top_k=20, seed=7, repetition_penalty=1.2,
                                   presence_penalty=0.5, frequency_penalty=0.3),
}


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(2026)
    return [rng.integers(100, 100_000, n).tolist() for n in PROMPT_LENGTHS]


def model():
    from deepinfer.model import init_params, load_config
    from deepinfer.model.tokenizer import load_tokenizer

    config = load_config("tiny-v4.1", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=5), load_tokenizer()


def generate(model_tuple, kind: str) -> dict[str, dict]:
    """One batch: every prompt with the `kind` sampling parameters, through `LLMEngine.step`."""
    from deepinfer.serve.api.types import SamplingParams
    from deepinfer.serve.engine.engine import EngineConfig, LLMEngine

    config, params, tokenizer = model_tuple
    engine = LLMEngine(params, config, tokenizer, EngineConfig())
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS, detokenize=False,
                        **SAMPLING[kind])
    for i, ids in enumerate(prompts()):
        engine.add_request(f"{kind}-{i}", ids, sp)
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
        assert steps < 500, "the engine did not finish the baseline batch"
    return {rid: {"token_ids": list(out.outputs[0].token_ids),
                  "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.outputs[0].logprobs]}
            for rid, out in sorted(outputs.items())}


def assert_matches(ours: dict, recorded: dict, what: str) -> None:
    """Same tokens and logprobs (within LOGPROB_TOLERANCE); a different token only where the
    recorded distribution has a near-tie between the two, after which the sequences part."""
    for i, (a, b) in enumerate(zip(ours["token_ids"], recorded["token_ids"])):
        alternatives = recorded["logprobs"][i]
        if a != b:
            assert str(a) in alternatives and abs(alternatives[str(a)] - alternatives[str(b)]) < NEAR_TIE, (
                f"{what}: token {i} is {a}, the recorded engine gave {b} (recorded logprobs {alternatives})")
            return
        got = ours["logprobs"][i]
        assert abs(got[str(a)] - alternatives[str(a)]) < LOGPROB_TOLERANCE, (
            f"{what}: token {i} ({a}) has logprob {got[str(a)]}, recorded {alternatives[str(a)]}")
    assert len(ours["token_ids"]) == len(recorded["token_ids"]), f"{what}: different lengths"


def record(kinds: list[str] | None = None) -> None:
    """Record every kind, or only `kinds` into the existing fixture."""
    unknown = sorted(set(kinds or ()) - set(SAMPLING))
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; choose from {sorted(SAMPLING)}")
    m = model()
    if kinds:
        data = json.loads(FIXTURE.read_text())
        if data["prompt_lengths"] != list(PROMPT_LENGTHS) or data["max_tokens"] != MAX_TOKENS:
            raise SystemExit(f"{FIXTURE} was recorded with other prompts: record every kind")
    else:
        data = {"prompt_lengths": list(PROMPT_LENGTHS), "max_tokens": MAX_TOKENS, "outputs": {}}
        kinds = list(SAMPLING)
    for kind in kinds:
        data["outputs"][kind] = generate(m, kind)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"wrote {', '.join(kinds)} into {FIXTURE}")


if __name__ == "__main__":
    import sys

    record(sys.argv[1:])
