"""Offline throughput of the engine on `tiny-v4.1` (random weights), printed in vLLM's
`bench throughput` format, plus prefill tokens/s and the decode step time at growing context.

    python benchmarks/throughput.py [--input-len 128] [--output-len 32] [--batch-sizes 1,8,32]
                                    [--contexts 1024,8192,32768] [--prefill-len 2048]
                                    [--drafter-batch 8] [--max-num-batched-tokens 2048] [--sampler-batch 8]
                                    [--decode-batches 1,8] [--no-start]

Compile and warm-up time are excluded from every measured window (each shape runs once before
it is timed) and printed separately. The sampler's share is that of the sampler alone (jitted on
device-resident logits and sampling state, as it runs inside the step) in the engine's decode
step at temperature 1. Lengths are fixed (range_ratio=0, vLLM semantics);
`ignore_eos=True`, `temperature=1.0`, `top_p=1.0`. On a CPU these figures describe the
reference (plain jnp) path, not accelerator kernels.

Start-up: the wall time of the README's first command (`deepinfer generate --prompt ...`) in a new
process, cold (an empty persistent compilation cache) and warm (the cache the cold run wrote).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from deepinfer.model import init_params, load_config
from deepinfer.model.kv_cache import CacheLayout
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner
from deepinfer.serve.engine.sampler import SampleRows, sample
from deepinfer.serve.engine.sampling_state import init_state, slot_row, write_slot


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(3, 128000, length - 1).tolist() for _ in range(n)]


def _run(engine: LLMEngine, prompts, output_len: int, tag: str) -> tuple[float, int, int]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, top_p=1.0, seed=None)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    start = time.perf_counter()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.outputs[0].token_ids) for o in outputs)


def bench_throughput(params, config, tokenizer, batch: int, input_len: int, output_len: int,
                     drafter_context: bool = False,
                     max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens) -> dict:
    budget = CacheBudget(num_slots=batch, max_model_len=input_len + output_len + 64, page_size=128)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, prefill_chunk=512,
                                                               max_num_batched_tokens=max_num_batched_tokens,
                                                               drafter_context=drafter_context))
    t0 = time.perf_counter()
    _run(engine, _prompts(batch, input_len, seed=1), output_len, "warmup")  # compiles every shape
    warmup = time.perf_counter() - t0
    elapsed, n_in, n_out = _run(engine, _prompts(batch, input_len, seed=2), output_len, "bench")
    return dict(batch=batch, elapsed=elapsed, prompt_tokens=n_in, output_tokens=n_out, warmup=warmup,
                buckets=len(engine.runner.compile_seconds))


def _decode_step(params, config, tokenizer, batch: int, steps: int, temperature: float) -> float:
    """Median decode step of `batch` requests through `LLMEngine.step` (one page bucket)."""
    budget = CacheBudget(num_slots=batch, max_model_len=128, page_size=128)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget))
    sp = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=temperature, detokenize=False)
    for i, p in enumerate(_prompts(batch, 64, seed=5)):
        engine.add_request(f"sampler-{i}", p, sp)
    times = []
    while engine.has_unfinished():
        decoding = len(engine.scheduler.running) == batch and all(r.to_feed == 1 for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # the first ones compile


def bench_sampler_share(params, config, tokenizer, batch: int, steps: int = 24) -> tuple[float, float, float]:
    """Median decode steps of `batch` requests at temperature 1 and greedy (the same program: the
    difference is the random draw inside the step), and median time of the sampler alone on
    `[batch, vocab]` logits and a state of `batch` temperature-1 slots, on the device."""
    step = _decode_step(params, config, tokenizer, batch, steps, 1.0)
    greedy = _decode_step(params, config, tokenizer, batch, steps, 0.0)
    sp = SamplingParams(temperature=1.0)

    V = config.vocab_size
    state = init_state(batch, V, 128, 33)
    for slot in range(batch):
        state = write_slot(state, np.int32(slot), slot_row(sp, seed=slot, vocab_size=V, max_logit_bias=128, max_bans=33))
    logits = jax.random.normal(jax.random.key(0), (batch, V), np.float32)
    slots = jax.numpy.arange(batch, dtype=np.int32)
    rows = SampleRows(jax.numpy.ones(batch, bool), jax.numpy.full(batch, 70, np.int32))
    run = jax.jit(sample, donate_argnums=(1,))
    state, out = run(logits, state, slots, rows)  # compile
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, out = run(logits, state, slots, rows)
        out.tokens.block_until_ready()
        times.append(time.perf_counter() - start)
    return step, greedy, statistics.median(times)


def bench_prefill(params, config, tokenizer, length: int, mode: str) -> float:
    budget = CacheBudget(num_slots=1, max_model_len=length + 64, page_size=128)
    engine = LLMEngine(params, config, tokenizer,
                       EngineConfig(budget=budget, prefill_chunk=512, prefill_mode=mode))
    _run(engine, _prompts(1, length, seed=3), 1, "warm")
    elapsed, n_in, _ = _run(engine, _prompts(1, length, seed=4), 1, "prefill")
    return n_in / elapsed


def bench_decode_step(params, config, context: int, repeats: int = 5, batch: int = 1) -> float:
    """Median decode-step time of `batch` sequences at `context` tokens each. The cache is
    synthetic (pages allocated, contents zero, the sequences' pages interleaved in the pool): a
    step's cost depends on the context's size, not on the values; the page-table bucket grows
    with the context as in the engine."""
    page = 128
    pages = -(-(context + 1) // page)
    layout = CacheLayout(num_slots=batch, page_size=page, num_pages=pages * batch, max_pages_per_slot=pages)
    runner = ModelRunner(params, config, layout)
    table = np.arange(pages * batch, dtype=np.int32).reshape(pages, batch).T.copy()
    lookback = np.zeros(max(config.engram_max_ngram_size - 1, 0), np.int32)
    work = [ChunkWork(b, np.asarray([5], np.int32), context - 1, lookback) for b in range(batch)]
    runner.run(work, table, rows=batch, tokens=1)  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.run(work, table, rows=batch, tokens=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_start(prompt: str = "The capital of France is") -> tuple[float, float]:
    """Seconds of `deepinfer generate --prompt PROMPT` in a new process with an empty compilation
    cache, then again with the cache it wrote (the embedded checkpoint is written beforehand)."""
    from deepinfer.serve.api.embedded import ensure_trained_checkpoint

    ensure_trained_checkpoint()
    times = []
    with tempfile.TemporaryDirectory() as cache:
        argv = [sys.executable, "-m", "deepinfer.serve.cli", "generate", "--prompt", prompt,
                "--compilation-cache", os.path.join(cache, "xla")]
        for _ in range(2):
            start = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
    return times[0], times[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--decode-batches", default="1,8", help="batch sizes of the decode-step-vs-context figure")
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--drafter-batch", type=int, default=8, help="batch of the drafter-context comparison (0: skip)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                    help="tokens per step: decodes plus the prefill chunks of several prompts")
    ap.add_argument("--no-start", action="store_true", help="skip the cold/warm start-up of `deepinfer generate`")
    ap.add_argument("--sampler-batch", type=int, default=8, help="batch of the sampler-share figure (0: skip)")
    args = ap.parse_args(argv)

    config = load_config("tiny-v4.1")
    params = init_params(config, seed=0)
    tokenizer = load_tokenizer()
    devices = jax.devices()
    print(f"model: {config.name} (random weights), dtype {config.dtype}, fake_quant {config.fake_quant}, "
          f"cache rows FP8/FP4 packed; kernels: reference (jnp)")
    print(f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}); mesh: single device")
    print(f"range_ratio=0 (vLLM semantics): input_len={args.input_len} output_len={args.output_len}; "
          f"prefill_chunk 512, max_num_batched_tokens {args.max_num_batched_tokens} per step\n")

    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        r = bench_throughput(params, config, tokenizer, batch, args.input_len, args.output_len,
                             max_num_batched_tokens=args.max_num_batched_tokens)
        total = r["prompt_tokens"] + r["output_tokens"]
        print(f"batch {batch}:")
        print(f"Throughput: {batch / r['elapsed']:.2f} requests/s, {total / r['elapsed']:.2f} total tokens/s, "
              f"{r['output_tokens'] / r['elapsed']:.2f} output tokens/s")
        print(f"Total num prompt tokens:  {r['prompt_tokens']}")
        print(f"Total num output tokens:  {r['output_tokens']}")
        print(f"Compile/warmup time (s): {r['warmup']:.1f} ({r['buckets']} jitted shape buckets)\n")

    if args.sampler_batch:
        step, greedy, sampler = bench_sampler_share(params, config, tokenizer, args.sampler_batch)
        print(f"Sampler (on the device, temperature 1), batch {args.sampler_batch}: {sampler * 1e3:.2f} ms alone, "
              f"{sampler / step:.1%} of a {step * 1e3:.1f} ms decode step; the step at temperature 0: "
              f"{greedy * 1e3:.1f} ms\n")

    if args.drafter_batch:
        rates = {}
        for on in (True, False):
            r = bench_throughput(params, config, tokenizer, args.drafter_batch, args.input_len, args.output_len, on,
                                 args.max_num_batched_tokens)
            rates[on] = (r["prompt_tokens"] + r["output_tokens"]) / r["elapsed"]
        print(f"DSpark drafter context (its window rings written every step), batch {args.drafter_batch}: "
              f"{rates[True]:.1f} total tokens/s with, {rates[False]:.1f} without ({rates[True] / rates[False]:.2f}x)\n")

    for mode in ("full", "compact"):
        rate = bench_prefill(params, config, tokenizer, args.prefill_len, mode)
        print(f"Prefill ({mode}, {args.prefill_len} tokens, chunks of 512): {rate:.1f} tokens/s")
    print()
    for batch in [int(b) for b in args.decode_batches.split(",")]:
        base = None
        print(f"batch {batch}: context  decode step (ms)  vs first")
        for context in [int(c) for c in args.contexts.split(",")]:
            t = bench_decode_step(params, config, context, batch=batch)
            base = base or t
            print(f"{context:16d}  {t * 1e3:16.2f}  {t / base:8.2f}x")
    if not args.no_start:
        cold, warm = bench_start()
        print(f"\nStart-up of `deepinfer generate --prompt ...` (new process, wall): {cold:.1f} s cold "
              f"(empty compilation cache), {warm:.1f} s warm (persistent cache)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
