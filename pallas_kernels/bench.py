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

from deepinfer.pallas_kernels.indexer import index_scores_pallas
from deepinfer.ops.quant_weight import FP4, FP8, QuantWeight
from deepinfer.pallas_kernels.matmul import fp8_block_matmul_pallas, moe_experts_mxfp4_pallas
from deepinfer.pallas_kernels.mhc import mhc_mixes_pallas
from deepinfer.pallas_kernels.reference.indexer import index_scores as indexer_reference
from deepinfer.pallas_kernels.reference import matmul as matmul_reference
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
    # Equal entries count 0, so matching -inf (masked index scores) is no difference.
    return max(float(jnp.max(jnp.where(x == y, 0.0, jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))))
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


def indexer_inputs(B, T, H, d, R, dtype=jnp.bfloat16, seed=0):
    """Index queries/weights/keys with the last of the T queries seeing all R entries (ratio 1)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, d)), dtype)
    w = jnp.asarray(rng.standard_normal((B, T, H)) * H ** -0.5, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, R, d)), dtype)
    positions = jnp.asarray(np.broadcast_to(np.arange(R - T, R), (B, T)), jnp.int32)
    return q, w, keys, positions


def indexer_cost(q, keys, positions) -> tuple[float, float]:
    """FLOPs of the visible (query, entry) pairs; bytes of q, weights, keys once and the scores."""
    B, T, H, d = q.shape
    R = keys.shape[1]
    pairs = float(jnp.sum(jnp.clip(positions + 1, 0, R)))
    item = q.dtype.itemsize
    return 2.0 * H * d * pairs, q.size * item + B * T * H * 4 + keys.size * item + B * T * R * 4


def fp8_inputs(M, N, K, block, dtype=jnp.bfloat16, seed=0):
    """x `[M, K]` and an FP8 weight of random e4m3 bytes (no NaN) with O(1)-ish UE8M0 scales,
    made on the device (no host RNG for the large weights)."""
    kx, kq, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K), dtype)
    q = jax.random.randint(kq, (N, K), 0, 255, jnp.int32)
    q = jnp.where((q & 0x7F) == 0x7F, q - 1, q).astype(jnp.uint8)
    s = jax.random.randint(ks, (-(-N // block[0]), -(-K // block[1])), 113, 122, jnp.int32).astype(jnp.uint8)
    return x, QuantWeight(jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn),
                          jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), kind=FP8, block=tuple(block))


def moe_inputs(N, k, E, D, F, dtype=jnp.bfloat16, seed=0):
    """Tokens, distinct random expert ids per token, and MXFP4 expert stacks (random bytes)."""
    keys = jax.random.split(jax.random.key(seed), 9)
    x = jax.random.normal(keys[0], (N, D), dtype)
    ids = jnp.argsort(jax.random.uniform(keys[1], (N, E)), axis=1)[:, :k].astype(jnp.int32)
    weights = jax.random.uniform(keys[2], (N, k), jnp.float32)

    def fp4(kq, ks, out, inner):
        q = jax.random.randint(kq, (E, out, inner // 2), -128, 128, jnp.int32).astype(jnp.int8)
        s = jax.random.randint(ks, (E, out, inner // 32), 122, 126, jnp.int32).astype(jnp.uint8)
        return QuantWeight(q, jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu), kind=FP4, block=(1, 32))

    return x, weights, ids, fp4(keys[3], keys[4], F, D), fp4(keys[5], keys[6], F, D), fp4(keys[7], keys[8], D, F)


def matmul_cases(quick: bool, interpret: bool, sweep: bool) -> list[tuple[Case, Case]]:
    """fp8_block_matmul and moe_experts_mxfp4 against their dequantize-everything references.
    FLOPs: useful multiply-adds (the MoE counts the routed pairs only); bytes: activations and
    output once, the FP8 weight once, the MXFP4 experts that any token selected once."""
    pairs = []
    if quick:
        fp8_shapes = {"M=8 N=256 K=256 blk=32": (8, 256, 256, (32, 32))}
        moe_shapes = {"N=8 k=2 E=8 D=128 F=64": (8, 2, 8, 128, 64)}
    else:  # V4.1 shapes: 32 x 32 FP8 blocks; an 8-way EP shard holds 48 of the 384 experts
        fp8_shapes = {"decode M=64 wq_b N=32768 K=1280 blk=32": (64, 32768, 1280, (32, 32)),
                      "prefill M=4096 wq_a N=1280 K=5120 blk=32": (4096, 1280, 5120, (32, 32)),
                      "decode M=64 N=K=7168 blk=128": (64, 7168, 7168, (128, 128))}
        moe_shapes = {"decode N=64 k=6 E=48 D=5120 F=2304": (64, 6, 48, 5120, 2304),
                      "prefill N=2048 k=6 E=48 D=5120 F=2304": (2048, 6, 48, 5120, 2304)}
    fp8_configs = [dict()]
    moe_configs = [dict()]
    if sweep and not interpret:
        fp8_configs += [dict(num_warps=8), dict(block_m=128, num_warps=8), dict(block_k=64, num_stages=4)]
        moe_configs += [dict(block_n=128, num_warps=8), dict(block_m=64)]
    for name, (M, N, K, block) in fp8_shapes.items():
        x, w = fp8_inputs(M, N, K, block)
        flops = 2.0 * M * N * K
        bytes_ = M * K * 2 + N * K + w.scale.size + M * N * 2
        ref = jax.jit(matmul_reference.fp8_block_matmul)
        ref_case = Case("fp8_block_matmul", name, lambda ref=ref, x=x, w=w: ref(x, w), flops, bytes_)
        for cfg in fp8_configs:
            fn = jax.jit(functools.partial(fp8_block_matmul_pallas, block=block, interpret=interpret, **cfg))
            tag = ",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"
            pairs.append((Case("fp8_block_matmul", f"{name} [{tag}]",
                               lambda fn=fn, x=x, w=w: fn(x, w.q, w.scale), flops, bytes_), ref_case))
    for name, (N, k, E, D, F) in moe_shapes.items():
        x, weights, ids, w1, w3, w2 = moe_inputs(N, k, E, D, F)
        hit = int(jnp.sum(jnp.zeros((E,), jnp.int32).at[ids.reshape(-1)].add(1) > 0))
        flops = 2.0 * N * k * 3 * D * F
        bytes_ = hit * 3 * F * D * (0.5 + 1 / 32) + N * D * 2 + N * D * 4
        ref = jax.jit(functools.partial(matmul_reference.moe_experts_mxfp4, swiglu_limit=10.0))
        args = (x, weights, ids, w1, w3, w2)
        ref_case = Case("moe_experts_mxfp4", name, lambda ref=ref, args=args: ref(*args), flops, bytes_)
        arrays = (x, weights, ids, w1.q, w1.scale, w3.q, w3.scale, w2.q, w2.scale)
        for cfg in moe_configs:
            fn = jax.jit(functools.partial(moe_experts_mxfp4_pallas, swiglu_limit=10.0, interpret=interpret, **cfg))
            tag = ",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"
            pairs.append((Case("moe_experts_mxfp4", f"{name} [{tag}]",
                               lambda fn=fn, arrays=arrays: fn(*arrays), flops, bytes_), ref_case))
    return pairs


def compress_store_cases(quick: bool, interpret: bool, sweep: bool) -> list[tuple[Case, Case]]:
    """compress_store (ratio-2 and ratio-1 sources, packed FP4 pools) against its reference, with
    the pools and pending state donated and threaded through the timed calls as the engine step
    does (otherwise both sides would copy the whole pool per call). FLOPs: the key projection;
    bytes: the chunk's kv (and gate) read, the latents written and read back, the records
    written."""
    from deepinfer.ops.norm_rope import rope_inv_freq
    from deepinfer.pallas_kernels.compress_store import compress_store_pallas
    from deepinfer.pallas_kernels.reference.compress_store import compress_store as store_reference

    if quick:
        D, Dk, rd, P, page = 128, 64, 32, 16, 32
        shapes = {"B=2 T=8 ratio=2": (2, 8, 2), "B=2 T=8 ratio=1": (2, 8, 1)}
    else:  # the release widths; 2048 pages of 256 tokens
        D, Dk, rd, P, page = 512, 128, 64, 2048, 256
        shapes = {"decode B=64 T=1 ratio=2": (64, 1, 2), "decode B=64 T=1 ratio=1": (64, 1, 1),
                  "prefill B=1 T=4096 ratio=2": (1, 4096, 2), "prefill B=1 T=4096 ratio=1": (1, 4096, 1)}
    configs = [dict()]
    if sweep and not interpret:
        configs += [dict(block_t=4, num_warps=4), dict(block_t=16, num_warps=8)]
    pairs = []
    for name, (B, T, ratio) in shapes.items():
        rng = np.random.default_rng(B * T + ratio)
        per_page = page // ratio
        kv = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32 if ratio == 2 else jnp.bfloat16)
        gate = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32) if ratio == 2 else None
        start = rng.integers(0, page, B) if T == 1 else np.zeros(B, np.int64)
        positions = jnp.asarray(start[:, None] + np.arange(T)[None], jnp.int32)
        n_pages = -(-(int(positions.max()) + 1) // page)
        table = jnp.asarray(rng.permutation(P)[:B * n_pages].reshape(B, n_pages), jnp.int32)
        fixed = (kv, gate, positions, positions >= 0, table)
        slots, last = jnp.arange(B, dtype=jnp.int32), jnp.full((B,), T - 1, jnp.int32)
        params = dict(ratio=ratio, norm=jnp.ones((D,), jnp.bfloat16),
                      wk=jnp.asarray(rng.standard_normal((Dk, D)) / np.sqrt(D), jnp.bfloat16),
                      k_norm=jnp.ones((Dk,), jnp.bfloat16), inv_freq=rope_inv_freq(rd, 10000.0, None), eps=1e-6,
                      dtype=jnp.bfloat16, storage="packed", fake_quant=True)
        n_entries = B * T // ratio
        flops = 2.0 * B * T * D * Dk
        bytes_ = (kv.size * kv.dtype.itemsize * (2 if ratio == 2 else 1) + 2 * B * T * D * 2
                  + n_entries * (D // 2 + D // 16 + Dk // 2 + Dk // 32))

        def state():
            rows = (P, per_page)
            return [(jnp.zeros((*rows, D // 2), jnp.uint8), jnp.zeros((*rows, D // 16), jnp.float8_e4m3fn)),
                    (jnp.zeros((*rows, Dk // 2), jnp.uint8), jnp.ones((*rows, Dk // 32), jnp.float8_e8m0fnu)),
                    jnp.zeros((B, 2, D), jnp.float32) if ratio == 2 else None]

        def threaded(impl, fixed=fixed, slots=slots, last=last):
            fn = jax.jit(lambda entries, keys, pending: impl(*fixed, entries, keys, pending, slots, last),
                         donate_argnums=(0, 1, 2))
            held = state()

            def run():
                held[:] = fn(*held)
                return tuple(held)
            return run

        ref_case = Case("compress_store", name, threaded(functools.partial(store_reference, **params)), flops, bytes_)
        for cfg in configs:
            run = threaded(functools.partial(compress_store_pallas, **params, interpret=interpret, **cfg))
            tag = ",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"
            pairs.append((Case("compress_store", f"{name} [{tag}]", run, flops, bytes_), ref_case))
    return pairs


def build_cases(quick: bool, interpret: bool, sweep: bool) -> list[tuple[Case, Case]]:
    """(kernel case, reference case) pairs."""
    pairs = []
    if quick:
        att_shapes = {"decode B=2 H=4 D=128 K=16": (2, 1, 4, 128, 130, 64, 16)}
        mhc_shapes = {"N=64 hc=4 D=128": (64, 4, 128)}
        idx_shapes = {"B=2 T=4 H=16 d=64 R=200": (2, 4, 16, 64, 200)}
    else:
        att_shapes = {
            "decode B=64 H=64 D=512 S=129 R=8192 K=512": (64, 1, 64, 512, 129, 8192, 512),
            "prefill B=1 T=2048 H=64 D=512 R=1024 K=512": (1, 2048, 64, 512, 2048, 1024, 512),
        }
        mhc_shapes = {"decode N=64 hc=4 D=5120": (64, 4, 5120), "prefill N=8192 hc=4 D=5120": (8192, 4, 5120)}
        idx_shapes = {"decode B=64 H=32 d=128 R=16384": (64, 1, 32, 128, 16384),
                      "prefill causal B=1 T=4096 H=32 d=128 R=4096": (1, 4096, 32, 128, 4096)}
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
    idx_configs = [dict()]
    if sweep and not interpret:
        idx_configs += [dict(block_t=1, num_warps=4), dict(block_t=4, num_warps=8), dict(block_r=128, num_warps=8),
                        dict(tiles=32)]
    for name, shape in idx_shapes.items():
        args = indexer_inputs(*shape)
        flops, bytes_ = indexer_cost(args[0], args[2], args[3])
        ref = jax.jit(functools.partial(indexer_reference, ratio=1))
        ref_case = Case("index_scores", name, lambda ref=ref, args=args: ref(*args), flops, bytes_)
        for cfg in idx_configs:
            fn = jax.jit(functools.partial(index_scores_pallas, ratio=1, interpret=interpret, **cfg))
            tag = ",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"
            pairs.append((Case("index_scores", f"{name} [{tag}]", lambda fn=fn, args=args: fn(*args),
                               flops, bytes_), ref_case))
    pairs += matmul_cases(quick, interpret, sweep)
    pairs += compress_store_cases(quick, interpret, sweep)
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
