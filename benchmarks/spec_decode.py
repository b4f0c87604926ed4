"""DSpark speculative decoding on the embedded trained model: no speculation, fixed-k and
confidence-scheduled (varlen) verification, per concurrency.

    python benchmarks/spec_decode.py [--concurrency 1,4,16,32,64] [--input-len 256] [--output-len 64]
                                     [-k 5] [--temperature T] [--runs no-spec,fixed,varlen,varlen-raw]

Prompts are windows of the Python standard library's held-out modules (those the model was not
trained on: `scripts/train_data.py`). Per concurrency c, each engine (c slots) runs c requests
once untimed (compilation; the varlen engines also profile their verify step per width at
start) and then the same requests timed. Printed per run: output tok/s, per-user tok/s (output
tokens / the request's own seconds from the batch start, averaged), tau (tokens a request gains
per verify step: accepted drafts + 1), drafts verified per request and step, and the ratio to the
first run listed (no speculation by default) in the same run. The first varlen engine of a
concurrency profiles the step-cost curve (printed) and the others of that concurrency reuse it
(`"verify_step_seconds"`), so that varlen and varlen-raw differ in their confidences only.
`varlen` reads the drafter's confidences calibrated by the checkpoint's STS temperatures (the
embedded model's own), `varlen-raw` uncalibrated.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import train_data  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.serve.api.types import SamplingParams  # noqa: E402


def heldout_prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens (BOS first) spread over the held-out stdlib modules."""
    root = train_data.stdlib_root()
    ids = []
    for rel in train_data.source_files(root):
        if train_data.is_held_out(rel):
            text = train_data.read_source(root / rel)
            if text:
                ids.extend(llm.get_tokenizer().encode(text).ids)
        if len(ids) > 40 * length * max(n, 4):
            break
    starts = np.linspace(0, len(ids) - length, n).astype(int)
    return [[0, *ids[s:s + length - 1]] for s in starts]


def timed(llm: LLM, prompts, params) -> tuple[float, float]:
    """(output tok/s, mean per-user tok/s) of one batch: each request's tokens over the seconds
    from the batch start to its finish."""
    start = time.perf_counter()
    done = {}
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (len(out.outputs[0].token_ids), time.perf_counter() - start)
    seconds = time.perf_counter() - start
    return sum(n for n, _ in done.values()) / seconds, float(np.mean([n / s for n, s in done.values()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("-k", type=int, default=5, help="num_speculative_tokens (fixed, and varlen's most)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", default="no-spec,fixed,varlen",
                        help="of no-spec, fixed, varlen (confidences calibrated by the checkpoint's STS "
                             "temperatures) and varlen-raw (uncalibrated)")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            max_tokens=args.output_len, ignore_eos=True)
    adaptive = {"method": "dspark", "num_speculative_tokens": args.k, "enable_adaptive_verification": True}
    known = {"no-spec": ("no-spec", None),
             "fixed": (f"fixed-{args.k}", {"method": "dspark", "num_speculative_tokens": args.k}),
             "varlen": ("varlen", adaptive),
             "varlen-raw": ("varlen-raw", {**adaptive, "confidence_temperatures": [1.0] * args.k})}
    unknown = [r for r in args.runs.split(",") if r not in known]
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    runs = dict(known[r] for r in args.runs.split(","))
    print(f"tiny-v4.1-trained on {jax.devices()[0].platform}: input {args.input_len}, output {args.output_len} "
          f"tokens, temperature {args.temperature}, k = {args.k}")
    print(f"{'conc':>4} {'run':>10} {'out tok/s':>10} {'user tok/s':>10} {'tau':>5} {'drafts/step':>11} "
          f"{'vs no-spec':>10}")
    prompts_all = None
    for c in [int(x) for x in args.concurrency.split(",")]:
        base = curve = None
        for name, spec in runs.items():
            if curve is not None and spec is not None and spec.get("enable_adaptive_verification"):
                spec = {**spec, "verify_step_seconds": curve}
            llm = LLM(max_num_seqs=c, max_model_len=args.input_len + args.output_len + 64, page_size=64,
                      speculative_config=spec, log_stats_interval=None)
            if prompts_all is None:
                prompts_all = heldout_prompts(llm, 64, args.input_len)
            prompts = prompts_all[:c]
            llm.generate(prompts, params, use_tqdm=False)  # compiles every shape these requests use
            counts = llm.engine.spec_counts
            before = counts.snapshot() if counts else None
            tok_s, user = timed(llm, prompts, params)
            base = base or tok_s
            tau = drafts = "-"
            if counts:
                timed_rows = counts.since(before)
                tau = f"{timed_rows.mean_acceptance_length:.2f}"
                drafts = f"{timed_rows.num_draft_tokens / max(timed_rows.num_drafts, 1):.2f}"
            if llm.engine.verify_schedule is not None and curve is None:
                curve = llm.engine.verify_schedule.step_seconds.tolist()
                print(f"     step seconds (plain decode, then verify by width) at {c}:",
                      " ".join(f"{s * 1e3:.1f}ms" for s in curve))
            print(f"{c:>4} {name:>10} {tok_s:>10.1f} {user:>10.2f} {tau:>5} {drafts:>11} {tok_s / base:>9.2f}x",
                  flush=True)
            del llm


if __name__ == "__main__":
    main()
