"""Cost of batch-invariant inference on `tiny-v4.1` (random weights, fake-quant on): output
tokens/s with `EngineConfig(deterministic=True)` against the default engine, at several batch
sizes, in one run.

    python benchmarks/deterministic.py [--batch-sizes 1,8,32] [--input-len 256] [--output-len 32]
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/deterministic.py --mesh dp=2,cp=2

Each configuration runs once untimed first (compilation), then once timed: greedy requests of
`--input-len` random tokens generating `--output-len` tokens each, all added at once.
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
from deepinfer.sharding import make_mesh


def run(params, config, tokenizer, prompts, output_len: int, deterministic: bool, slots: int, mesh=None) -> float:
    """Output tokens/s of one engine run over `prompts` (on `mesh`: `slots` rounded up to whole dp ranks)."""
    if mesh is not None:
        slots = -(-slots // mesh.shape["dp"]) * mesh.shape["dp"]
    budget = CacheBudget(num_slots=slots, max_model_len=max(len(p) for p in prompts) + output_len + 8, page_size=256)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, deterministic=deterministic), mesh=mesh)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--mesh", default=None, help="a device mesh, e.g. dp=2,cp=2 (every device JAX sees); default: one device")
    args = ap.parse_args()
    mesh = None if args.mesh is None else make_mesh(args.mesh)
    config = load_config("tiny-v4.1")
    params, tokenizer = init_params(config, seed=0), load_tokenizer()
    rng = np.random.default_rng(0)
    where = "one device" if mesh is None else f"mesh {dict(mesh.shape)}"
    print(f"tiny-v4.1 on {where}, input {args.input_len}, output {args.output_len}, greedy; output tokens/s")
    print(f"{'batch':>5} {'default':>9} {'deterministic':>14} {'ratio':>6}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [rng.integers(100, 100_000, args.input_len).tolist() for _ in range(batch)]
        rates = {}
        for det in (False, True):
            run(params, config, tokenizer, prompts, args.output_len, det, batch, mesh)  # compile
            rates[det] = run(params, config, tokenizer, prompts, args.output_len, det, batch, mesh)
        print(f"{batch:>5} {rates[False]:>9.1f} {rates[True]:>14.1f} {rates[True] / rates[False]:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
