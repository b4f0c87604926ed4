"""Micro-benchmark of each Pallas kernel against its jnp reference, on the current device.

    python -m deepinfer.pallas_kernels.bench [--quick] [--iters 20] [--sweep]

One table: kernel, case, implementation (block config), median time, achieved TFLOP/s and GB/s,
the larger of the two as a fraction of the device's peak, speedup over the reference and the
max |kernel - reference|. Compile time is excluded (each function runs once before timing).
FLOPs count useful work only (admitted window keys and valid slots for attention); bytes count
each input read once and each output written once (the selected rows once per query, since
every query gathers its own). Meant for a CUDA GPU (benchmarks/device_check.sh); on a CPU it
runs the tiny `--quick` shapes in Pallas interpret mode, which only checks that it works.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.pallas_kernels.mhc import mhc_mixes_pallas
from deepinfer.pallas_kernels.reference.mhc import mhc_mixes as mhc_reference
from deepinfer.pallas_kernels.reference.sparse_attention import sparse_attention as attention_reference
from deepinfer.pallas_kernels.sparse_attention import sparse_attention_pallas

# (dense bf16 tensor-core TFLOP/s, fp32 non-tensor TFLOP/s, HBM TB/s), SXM parts, public spec sheets.
PEAKS = {
    "H200": (989.0, 67.0, 4.8),
    "H100": (989.0, 67.0, 3.35),
    "B200": (2250.0, 75.0, 8.0),
    "A100": (312.0, 19.5, 2.0),
}


def device_peaks() -> tuple[str, tuple[float, float, float] | None]:
    dev = jax.devices()[0]
    kind = dev.device_kind
    for key, peaks in PEAKS.items():
        if key in kind:
            return kind, peaks
    return kind, None


@dataclass
class Case:
    kernel: str
    name: str
    run: Callable  # () -> output pytree
    flops: float
    bytes: float
    fp32_math: bool = False  # compute peak: fp32 FMA instead of bf16 tensor cores


def _time(fn: Callable, iters: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def attention_inputs(B, T, H, D, S, R, K, window=128, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    kv = jnp.asarray(rng.standard_normal((B, S, D)), dtype)
    ckv = jnp.asarray(rng.standard_normal((B, R, D)), dtype)
    key_pos = np.arange(S)
    q_pos = S - T + np.arange(T)
    mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - window)
    mask = jnp.asarray(np.broadcast_to(mask, (B, T, S)))
    topk = rng.integers(0, R, (B, T, K)) if R else np.full((B, T, K), -1)
    topk = jnp.asarray(np.where(rng.random((B, T, K)) < 0.05, -1, topk), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, kv, mask, ckv, topk, sink


def attention_cost(q, kv, mask, ckv, topk) -> tuple[float, float]:
    B, T, H, D = q.shape
    keys = float(jnp.sum(mask)) + float(jnp.sum(topk >= 0))  # over all queries
    flops = 4.0 * H * D * keys
    item = q.dtype.itemsize
    bytes_ = (2 * q.size * item + kv.size * item + mask.size + topk.size * 4
              + float(jnp.sum(topk >= 0)) * D * item)
    return flops, bytes_


def mhc_inputs(N, hc, D, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    m = 2 * hc + hc * hc
    streams = jnp.asarray(rng.standard_normal((N, hc, D)), dtype)
    fn = jnp.asarray(rng.standard_normal((m, hc * D)) * 0.02, jnp.float32)
    base = jnp.asarray(rng.standard_normal(m), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32)
    return streams, fn, base, scale


def build_cases(quick: bool, interpret: bool, sweep: bool) -> list[tuple[Case, Case]]:
    """(kernel case, reference case) pairs."""
    pairs = []
    if quick:
        att_shapes = {"decode B=2 H=4 D=128 K=16": (2, 1, 4, 128, 130, 64, 16)}
        mhc_shapes = {"N=64 hc=4 D=128": (64, 4, 128)}
    else:
        att_shapes = {
            "decode B=64 H=64 D=512 S=129 R=8192 K=512": (64, 1, 64, 512, 129, 8192, 512),
            "prefill B=1 T=2048 H=64 D=512 R=1024 K=512": (1, 2048, 64, 512, 2048, 1024, 512),
        }
        mhc_shapes = {"decode N=64 hc=4 D=5120": (64, 4, 5120), "prefill N=8192 hc=4 D=5120": (8192, 4, 5120)}
    configs = [dict(block_h=16, num_warps=4)]
    if sweep and not interpret:
        configs += [dict(block_h=32, num_warps=8), dict(block_h=64, num_warps=8), dict(block_h=16, num_warps=8)]
    for name, shape in att_shapes.items():
        args = attention_inputs(*shape)
        q, kv, mask, ckv, topk, sink = args
        flops, bytes_ = attention_cost(q, kv, mask, ckv, topk)
        scale = shape[3] ** -0.5
        ref = jax.jit(functools.partial(attention_reference, scale=scale))
        ref_case = Case("sparse_attention", name, lambda ref=ref, args=args: ref(*args), flops, bytes_)
        for cfg in configs:
            fn = jax.jit(functools.partial(sparse_attention_pallas, scale=scale, interpret=interpret, **cfg))
            tag = ",".join(f"{k}={v}" for k, v in cfg.items())
            pairs.append((Case("sparse_attention", f"{name} [{tag}]", lambda fn=fn, args=args: fn(*args),
                               flops, bytes_), ref_case))
    for name, (N, hc, D) in mhc_shapes.items():
        args = mhc_inputs(N, hc, D)
        m = 2 * hc + hc * hc
        flops = 2.0 * N * m * hc * D
        bytes_ = args[0].size * args[0].dtype.itemsize + args[1].size * 4 + N * m * 4
        kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
        ref = jax.jit(functools.partial(mhc_reference, **kw))
        fn = jax.jit(functools.partial(mhc_mixes_pallas, interpret=interpret, **kw))
        pairs.append((Case("mhc_mixes", name, lambda fn=fn, args=args: fn(*args), flops, bytes_, True),
                      Case("mhc_mixes", name, lambda ref=ref, args=args: ref(*args), flops, bytes_, True)))
    return pairs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time a few other block configs of the attention kernel")
    args = p.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    quick = args.quick or interpret
    kind, peaks = device_peaks()
    print(f"device: {kind} ({jax.default_backend()}); peaks: "
          + (f"{peaks[0]:.0f} TFLOP/s bf16, {peaks[1]:.0f} TFLOP/s fp32, {peaks[2]:.2f} TB/s" if peaks else "unknown")
          + ("; Pallas interpret mode, shapes tiny: timings say nothing" if interpret else ""))
    header = (f"{'kernel':<17} {'case':<58} {'impl':<9} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8} "
              f"{'%peak':>6} {'x ref':>6} {'max|diff|':>10}")
    print(header)
    print("-" * len(header))
    ref_times: dict[int, float] = {}
    failures = 0
    for kcase, rcase in build_cases(quick, interpret, args.sweep):
        rows = []
        try:
            if id(rcase) not in ref_times:
                ref_times[id(rcase)] = _time(rcase.run, args.iters)
                rows.append(("reference", rcase, ref_times[id(rcase)], None))
            t = _time(kcase.run, args.iters)
            diff = _max_diff(kcase.run(), rcase.run())
            rows.append(("pallas", kcase, t, diff))
        except Exception as e:  # a config that does not compile (e.g. shared memory) is a row, not a crash
            failures += 1
            msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            print(f"{kcase.kernel:<17} {kcase.name[:58]:<58} {'pallas':<9} FAILED: {type(e).__name__}: {msg}")
            continue
        for impl, case, t, diff in rows:
            tflops = case.flops / t / 1e12
            gbs = case.bytes / t / 1e9
            frac = ""
            if peaks:
                compute_peak = peaks[1] if case.fp32_math else peaks[0]
                frac = f"{100 * max(tflops / compute_peak, gbs / 1e3 / peaks[2]):5.1f}%"
            speed = f"{ref_times[id(rcase)] / t:5.2f}x"
            d = "" if diff is None else f"{diff:10.2e}"
            print(f"{case.kernel:<17} {case.name[:58]:<58} {impl:<9} {t * 1e3:9.3f} {tflops:8.2f} {gbs:8.1f} "
                  f"{frac:>6} {speed:>6} {d:>10}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
