"""Structured output on `tiny-v4.1` (random weights): grammar compile time, the host's mask time
per step, and output tokens/s constrained vs unconstrained in one run.

    python benchmarks/structured_output.py [--batch-sizes 8,32] [--input-len 128] [--output-len 64]

* Compile: `LLGuidanceBackend.compile` + a matcher for each spec below (JSON Schemas with
  nesting, enums, patterns, anyOf, bounded arrays, optional fields; a regex; a Lark grammar; a
  choice), uncached, `--repeats` times each: p50 / p99 in ms.
* Steps: every row constrained by a regex that runs to `--output-len` tokens (`[a-z ]{300,600}`,
  so the grammar never ends first), against the same requests unconstrained, greedy; each
  configuration runs once untimed (compilation) first. The mask time is the host time spent
  filling the step's bitmasks (`LLMEngine._step_sampling`, llguidance's thread pool) and advancing
  the matchers; its share is of the wall time of the steps.
* Jump-forward: every row constrained by a JSON Schema of eight required keys with short values
  (`FORCED`: much of the text is forced), greedy, with `jump_forward` off and on: output tokens/s
  and engine steps per request (the grammar ends every output).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams, StructuredOutputsParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.structured import LLGuidanceBackend, RequestConstraint

SPECS = {
    "json nested": dict(json={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city"]}}, "required": ["name", "address"]}),
    "json enum+pattern": dict(json={"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["color", "code"]}),
    "json anyOf": dict(json={"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"]}]}),
    "json array+optional": dict(json={"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8},
        "note": {"type": "string"}}, "required": ["tags"]}),
    "json_object": dict(json_object=True),
    "regex": dict(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "lark": dict(grammar='start: "SELECT " column ("," column)* " FROM " /[a-z]+/ ";"\ncolumn: "id" | "name"'),
    "choice": dict(choice=["positive", "negative", "neutral"]),
}
LONG = r"[a-z ]{300,600}"
FORCED = {"type": "object", "additionalProperties": False,
          "required": ["identifier", "category", "description", "quantity", "available", "warehouse", "priority",
                       "reference"],
          "properties": {"identifier": {"type": "integer", "minimum": 0, "maximum": 999},
                         "category": {"enum": ["hardware", "software", "service"]},
                         "description": {"type": "string", "maxLength": 6},
                         "quantity": {"type": "integer", "minimum": 0, "maximum": 99},
                         "available": {"type": "boolean"},
                         "warehouse": {"type": "string", "pattern": "^[A-Z]{3}$"},
                         "priority": {"enum": ["low", "medium", "high"]},
                         "reference": {"type": "string", "maxLength": 4}}}


def compile_times(tokenizer, vocab_size: int, eos: int, repeats: int) -> np.ndarray:
    backend = LLGuidanceBackend(tokenizer, vocab_size, eos)
    times = []
    for _ in range(repeats):
        for spec in SPECS.values():
            backend._compiled.clear()  # uncached, every time
            start = time.perf_counter()
            backend.matcher(backend.compile(StructuredOutputsParams(**spec)))
            times.append(time.perf_counter() - start)
    return np.array(times) * 1e3


class MaskTimer:
    """Host seconds in the engine's mask building and matcher advancing."""

    def __init__(self, engine: LLMEngine):
        self.seconds = 0.0
        step_sampling = engine._step_sampling
        accept = RequestConstraint.accept

        def timed_step_sampling(rows):
            start = time.perf_counter()
            try:
                return step_sampling(rows)
            finally:
                self.seconds += time.perf_counter() - start

        def timed_accept(constraint, token):
            start = time.perf_counter()
            try:
                return accept(constraint, token)
            finally:
                self.seconds += time.perf_counter() - start

        engine._step_sampling = timed_step_sampling
        RequestConstraint.accept = timed_accept


def run(engine: LLMEngine, prompts, output_len: int, constrained: bool,
        spec: StructuredOutputsParams | None = None) -> tuple[float, int, int]:
    spec = spec or (StructuredOutputsParams(regex=LONG) if constrained else None)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                                           structured_outputs=spec))
    steps, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
        steps += 1
    return time.perf_counter() - start, steps, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    config = load_config("tiny-v4.1")
    params, tokenizer = init_params(config, seed=0), load_tokenizer()

    ms = compile_times(tokenizer, config.vocab_size, config.eos_token_id, args.repeats)
    print(f"grammar compile + matcher, {len(SPECS)} specs x {args.repeats}: p50 {np.percentile(ms, 50):.2f} ms, "
          f"p99 {np.percentile(ms, 99):.2f} ms, max {ms.max():.2f} ms")

    rng = np.random.default_rng(0)
    print("| batch | unconstrained tok/s | constrained tok/s | ratio | mask ms/step | mask share of step |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        budget = CacheBudget(num_slots=batch, max_model_len=args.input_len + args.output_len + 64, page_size=64)
        engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget))
        timer = MaskTimer(engine)
        prompts = [rng.integers(100, 100_000, args.input_len).tolist() for _ in range(batch)]
        for constrained in (False, True):  # compile both programs
            run(engine, prompts, 4, constrained)
        free_s, _, free_tokens = run(engine, prompts, args.output_len, False)
        timer.seconds = 0.0
        cons_s, steps, cons_tokens = run(engine, prompts, args.output_len, True)
        mask_s = timer.seconds
        print(f"| {batch} | {free_tokens / free_s:.1f} | {cons_tokens / cons_s:.1f} | "
              f"{(cons_tokens / cons_s) / (free_tokens / free_s):.2f}x | {1e3 * mask_s / steps:.2f} | "
              f"{mask_s / cons_s:.1%} |")

    print("\n| batch | jump-forward | output tok/s | steps | tokens forced | ratio |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        budget = CacheBudget(num_slots=batch, max_model_len=args.input_len + 256, page_size=64)
        engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget))
        prompts = [rng.integers(100, 100_000, args.input_len).tolist() for _ in range(batch)]
        base = None
        for jump in (False, True):
            spec = StructuredOutputsParams(json=FORCED, disable_any_whitespace=True, jump_forward=jump)
            run(engine, prompts, 192, True, spec)  # compile
            forced = engine.stats["forced_tokens"]
            seconds, steps, tokens = run(engine, prompts, 192, True, spec)
            rate = tokens / seconds
            base = base or rate
            print(f"| {batch} | {'on' if jump else 'off'} | {rate:.1f} | {steps} | "
                  f"{engine.stats['forced_tokens'] - forced} of {tokens} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
