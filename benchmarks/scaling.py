"""Prefill and decode tokens/s of the engine on a mesh of 8 virtual CPU devices, for attention
data parallel (dp), expert parallel (every mesh: experts split over all devices) and context
parallel (cp: prefill chunks split zigzag over the cp ranks), relative to one device.

    python benchmarks/scaling.py [--meshes dp=8,dp=4,cp=2,...] [--requests 8] [--input-len 512]
                                 [--output-len 16] [--devices 8]

The meshes are separated by ';' when given on the command line, e.g.
`--meshes "dp=8;dp=2,cp=2,tp=2;cp=8"`. Each configuration runs its workload once to compile
every step shape, then again to measure. Prefill time is the time until every request has its
first token (all prompts fed); decode is the rest. 8 virtual CPU devices share this machine's
cores, so these figures show the overhead of the collectives and how even the split is, not
a speed-up: the table says so too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="dp=8;dp=4,cp=2;dp=2,cp=2,tp=2;cp=8",
                   help="';'-separated mesh specs (default: %(default)s)")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens (default 16)")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (default 8)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import numpy as np

    from deepinfer.model import init_params, load_config
    from deepinfer.model.tokenizer import load_tokenizer
    from deepinfer.serve.api.types import SamplingParams
    from deepinfer.serve.engine.cache import CacheBudget
    from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
    from deepinfer.sharding import make_mesh

    config = load_config("tiny-v4.1", dtype="float32")
    params = init_params(config, seed=0)
    tokenizer = load_tokenizer()
    rng = np.random.default_rng(0)

    def workload(tag):
        return [(f"{tag}-{i}", [0] + rng.integers(3, 128000, args.input_len - 1).tolist())
                for i in range(args.requests)]

    def run_once(engine, tag):
        sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        for rid, ids in workload(tag):
            engine.add_request(rid, ids, sampling)
        start = time.perf_counter()
        first_tokens_at = None
        while engine.has_unfinished():
            engine.step()
            if first_tokens_at is None and all(r.output_ids for r in engine.requests.values()):
                first_tokens_at = time.perf_counter()
        end = time.perf_counter()
        first_tokens_at = first_tokens_at or end
        return first_tokens_at - start, end - first_tokens_at

    def measure(spec):
        mesh = None if spec is None else make_mesh(spec)
        budget = CacheBudget(num_slots=args.requests, max_model_len=args.input_len + args.output_len + 64,
                             page_size=128)
        engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, prefill_chunk=512,
                                                                    prefill_mode="full"), mesh=mesh)
        t0 = time.perf_counter()
        run_once(engine, "warmup")
        warmup = time.perf_counter() - t0
        prefill_s, decode_s = run_once(engine, "bench")
        prefill = args.requests * args.input_len / prefill_s
        decode = args.requests * (args.output_len - 1) / decode_s if decode_s > 0 else float("nan")
        return dict(spec=spec or "1 device", mesh=dict(mesh.shape) if mesh else {"dp": 1, "cp": 1, "tp": 1},
                    prefill=prefill, decode=decode, warmup=warmup)

    specs = [None] + [s.strip() for s in args.meshes.split(";") if s.strip()]
    rows = []
    for spec in specs:
        row = measure(spec)
        rows.append(row)
        print(f"measured {row['spec']}: prefill {row['prefill']:.0f} tok/s, decode {row['decode']:.1f} tok/s "
              f"(compile + warm-up {row['warmup']:.1f} s)", file=sys.stderr)
    base = rows[0]
    import jax

    print(f"tiny-v4.1 on {jax.device_count()} virtual CPU devices sharing {os.cpu_count()} cores; {args.requests} "
          f"requests x {args.input_len} prompt + {args.output_len} output tokens, full prefill, chunks of 512")
    print("NOTE: the virtual devices share the same cores, so a ratio below 1 is the cost of the collectives "
          "and of uneven splits, not a lack of speed-up.")
    header = f"{'mesh':<18} {'dp':>3} {'cp':>3} {'tp':>3} {'experts/dev':>11} {'prefill tok/s':>14} " \
             f"{'x 1 dev':>8} {'decode tok/s':>13} {'x 1 dev':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        m = row["mesh"]
        devices = m["dp"] * m["cp"] * m["tp"]
        print(f"{row['spec']:<18} {m['dp']:>3} {m['cp']:>3} {m['tp']:>3} "
              f"{config.n_routed_experts // devices:>11} {row['prefill']:>14.0f} {row['prefill'] / base['prefill']:>8.2f} "
              f"{row['decode']:>13.1f} {row['decode'] / base['decode']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
