"""The prefix cache on a synthetic agent workload (`tiny-v4.1`, random weights, fake-quant on):
many requests share one long prefix (a system prompt and tool definitions, an agent's
transcript) and add a few hundred tokens each. Cache off against cache on (bounded replay) in one
run: prefix hit rate, prompt tokens computed per request, time to first token and wall time.

    python benchmarks/prefix_cache.py [--shared 8192] [--new 200] [--requests 8] [--output-len 16]

Requests arrive one after the other, each when the previous has its first token (an agent's
turns); each configuration runs once untimed first (compilation), then once timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig


def run(model, prompts, output_len: int, cache_on: bool) -> dict:
    config, params, tokenizer = model
    budget = CacheBudget(num_slots=8, max_model_len=max(len(p) for p in prompts) + output_len + 8)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(
        budget=budget, prefix_cache=PrefixCacheConfig() if cache_on else None))
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttft, start = [], time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
        added = time.perf_counter()
        while engine.requests[str(i)].output_ids == [] and engine.requests[str(i)].pending == 0:
            engine.step()
        engine.sync()
        ttft.append(time.perf_counter() - added)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    counters = engine.counters()
    queries = counters.get("vllm:prefix_cache_queries", 0)
    return {"computed": engine.stats["prompt_tokens"] / len(prompts), "ttft": float(np.mean(ttft)),
            "ttft_warm": float(np.mean(ttft[1:])), "wall": wall,
            "hit_rate": counters.get("vllm:prefix_cache_hits", 0) / queries if queries else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=int, default=8192)
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    config = load_config("tiny-v4.1")
    model = (config, init_params(config, seed=0), load_tokenizer())
    rng = np.random.default_rng(0)
    shared = rng.integers(100, 100_000, args.shared).tolist()
    prompts = [shared + rng.integers(100, 100_000, args.new).tolist() for _ in range(args.requests)]
    print(f"tiny-v4.1, {args.requests} requests of {args.shared} shared + {args.new} new tokens, "
          f"output {args.output_len}, greedy, one after another")
    print(f"{'cache':>5} {'hit rate':>9} {'computed/request':>17} {'TTFT s':>7} {'TTFT after 1st':>15} {'wall s':>7}")
    results = {}
    for cache_on in (False, True):
        run(model, prompts[:2], args.output_len, cache_on)  # compile
        r = results[cache_on] = run(model, prompts, args.output_len, cache_on)
        print(f"{'on' if cache_on else 'off':>5} {r['hit_rate']:>9.3f} {r['computed']:>17.0f} {r['ttft']:>7.2f} "
              f"{r['ttft_warm']:>15.2f} {r['wall']:>7.1f}", flush=True)
    off, on = results[False], results[True]
    print(f"on/off: TTFT after the first request {on['ttft_warm'] / off['ttft_warm']:.3f}x, "
          f"wall {on['wall'] / off['wall']:.3f}x, prompt tokens computed {on['computed'] / off['computed']:.3f}x")


if __name__ == "__main__":
    main()
