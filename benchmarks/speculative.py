"""DSpark speculative decoding vs plain decoding on `tiny-v4.1`: output tokens/s and accepted
drafts per verify step, greedy (or sampled), at several batch sizes.

    python benchmarks/speculative.py [--batch-sizes 1,8] [--input-len 128] [--output-len 64] [-k 5] [--temperature T]

Three runs per batch size, each after an untimed run of the same requests (compilation):
plain decoding (synchronous, as a speculative engine reads its steps), speculative decoding
with the checkpoint's drafter (random weights accept almost nothing: this is the cost of a
verify step that gains one token), and speculative decoding with oracle drafts (the plain
continuation of the untimed run put in place of the drafter's: nearly every draft is accepted,
the upper bound of k+1 tokens per step). Figures are ratios against plain decoding measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.speculative import SpeculativeConfig


def run(engine: LLMEngine, prompts, sampling, oracle: dict | None = None, tag: str = "") -> tuple[dict, float, int]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, sampling)
    outputs, steps = {}, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        if oracle is not None:
            for rid, request in engine.requests.items():
                if request.output_ids:  # decoding: the engine checks these instead of the drafter's
                    n = len(request.output_ids)
                    request.host_drafts = list(oracle[rid[len(tag):]][n:n + engine.speculative.num_speculative_tokens])
        for o in engine.step():
            outputs[o.request_id[len(tag):]] = o.outputs[0].token_ids
        steps += 1
    return outputs, time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (with the oracle-drafts run)")
    args = parser.parse_args()
    config = load_config("tiny-v4.1")
    params, tokenizer = init_params(config, seed=0), load_tokenizer()
    sampling = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                              max_tokens=args.output_len, ignore_eos=True)
    print(f"tiny-v4.1 on {jax.devices()[0].platform}: input {args.input_len}, output {args.output_len} tokens, "
          f"temperature {args.temperature}, k = {args.k}")
    print(f"{'batch':>5} {'run':>16} {'out tok/s':>10} {'steps':>6} {'accepted/step':>14} {'vs plain':>9}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rng = np.random.default_rng(batch)
        prompts = [[0] + rng.integers(3, 120_000, args.input_len - 1).tolist() for _ in range(batch)]
        budget = CacheBudget(num_slots=batch, max_model_len=args.input_len + args.output_len + 128)
        spec = SpeculativeConfig(num_speculative_tokens=args.k)
        engines = {
            "plain": LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, async_scheduling=False,
                                                                       drafter_context=True)),
            "drafter": LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, speculative=spec)),
        }
        if args.temperature == 0:  # a sampled request's continuation is one draw, not an oracle
            engines["oracle drafts"] = engines["drafter"]
        reference, base = None, None
        for name, engine in engines.items():
            oracle = reference if name == "oracle drafts" else None
            warm, _, _ = run(engine, prompts, sampling, oracle, tag="warm-")  # compile
            if oracle is not None:  # the verify steps' own continuation: plain decoding's may differ
                oracle = warm       # at a near-tie (fake-quant rounding), which its drafts never recover
            counts = engine.spec_counts
            before = (counts.num_draft_tokens, counts.num_accepted_tokens) if counts else (0, 0)
            outputs, seconds, steps = run(engine, prompts, sampling, oracle)
            if name == "plain":
                reference = outputs
            tok_s = batch * args.output_len / seconds
            base = base or tok_s
            verified = counts.num_draft_tokens - before[0] if counts else 0
            accepted = counts.num_accepted_tokens - before[1] if counts else 0
            per_step = f"{accepted / max(1, steps - 1) / batch:.2f}" if verified else "-"
            print(f"{batch:>5} {name:>16} {tok_s:>10.1f} {steps:>6} {per_step:>14} {tok_s / base:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
