"""Figures of the shipped trained tiny model on the held-out split of its corpus.

    python scripts/eval_tiny.py --out RUN_DIR [--model tiny-v4.1-trained] [--tau] [--compact] [--prefix] [--samples]

* `--heldout`: the trained target's mean NLL / perplexity over every 512-token window of the
  held-out split (the training run's state in RUN_DIR), against the unigram and bigram baselines.
* `--samples`: greedy completions of a few held-out file openings.
* `--tau`: DSpark acceptance length τ (accepted drafts + 1 per verify step that checked drafts,
  i.e. tokens gained per step, including the bonus or correction token) with block 5 on 50
  held-out prompts (256 tokens each, spread over the split), greedy and temperature 1, 64 new tokens.
* `--prefix`: turn 2 of a two-turn prompt after a prefix-cache hit, bounded and exact replay vs cold.
* `--compact`: `compact` prefill (keep 140) vs `full` on 20 held-out files of at least 1,064
  tokens: the first 1,000 tokens are the prompt and each mode generates 64 greedy tokens; the
  greedy tokens equal before the first difference, and at those positions (same context in both)
  the KL(full || compact) of the next-token distributions over full's top 20 (both renormalised
  there; the engine returns at most 20 logprobs).

RUN_DIR holds the tokenized corpus (`scripts/train_data.py`; built there when missing).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_data  # noqa: E402

from deepinfer.serve.api import LLM, SamplingParams  # noqa: E402

SMALL = dict(max_num_seqs=8, max_model_len=2048)


def heldout(run_dir: str) -> tuple[np.ndarray, np.ndarray]:
    train_data.build_corpus(run_dir)
    return np.asarray(train_data.load_split(run_dir, "heldout")), np.load(
        pathlib.Path(run_dir) / "data" / "heldout_starts.npy")


def heldout_loss(run_dir: str) -> dict:
    """Mean NLL (nats) and perplexity of the finished target over every 512-token window of the
    held-out split, scored as the exported model (`train_tiny.HeldOut`), with the baselines'."""
    import baselines
    import dataclasses

    import train_tiny as tt

    run = tt.RunConfig(**json.loads((pathlib.Path(run_dir) / "run.json").read_text()))
    s = tt.setup(run)
    every = dataclasses.replace(run, eval_windows=10**9)
    held = tt.HeldOut(every, s)
    eval_fn = tt.make_eval(s["config"], run.weight_qat)
    params = held.params(s["state"]["params"])
    losses = [float(eval_fn(params, b)) for b in held.batches]
    train, test = (np.asarray(train_data.load_split(run_dir, n)) for n in ("train", "heldout"))
    uni, bi = baselines.bigram_nll(train, test)
    out = {"step": s["state"]["step"], "windows": sum(len(b["inputs"]) for b in held.batches),
           "nll": float(np.mean(losses)), "ppl": float(np.exp(np.mean(losses))),
           "unigram_nll": uni, "unigram_ppl": float(np.exp(uni)), "bigram_nll": bi, "bigram_ppl": float(np.exp(bi))}
    print(json.dumps(out))
    return out


def samples(model: str, tokens: np.ndarray, starts: np.ndarray) -> None:
    llm = LLM(model, **SMALL)
    prompts = [tokens[s:s + 48].tolist() for s in starts[:: max(1, len(starts) // 4)][:4]]
    for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False):
        print("--- prompt:", repr(llm.tokenizer.decode(out.prompt_token_ids[1:])))
        print("--- completion:", repr(out.outputs[0].text))


def tau(model: str, tokens: np.ndarray) -> dict:
    result = {}
    offsets = np.linspace(0, len(tokens) - 400, 50).astype(int)
    prompts = [[0, *tokens[o:o + 255].tolist()] for o in offsets]
    for label, params in (("greedy", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)),
                          ("T=1", SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True))):
        llm = LLM(model, speculative_config={"method": "dspark", "num_speculative_tokens": 5}, **SMALL)
        llm.generate(prompts, params, use_tqdm=False)
        m = llm.get_metrics()
        steps, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
        per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
        result[label] = {"tau": 1 + accepted / max(steps, 1), "verify_rows": steps,
                         "accept_rate_by_position": [round(per_pos[str(j)] / max(steps, 1), 3) for j in range(5)]}
        print(label, json.dumps(result[label]))
    return result


def _kl(p: dict, q: dict) -> float:
    """KL(p || q) over p's top tokens, both renormalised over p's support (q's missing: its floor)."""
    ids = list(p)
    lp = np.array([p[i].logprob for i in ids])
    floor = min(v.logprob for v in q.values())
    lq = np.array([q[i].logprob if i in q else floor for i in ids])
    pp = np.exp(lp - np.logaddexp.reduce(lp))
    qq = np.exp(lq - np.logaddexp.reduce(lq))
    return float(np.sum(pp * (np.log(pp) - np.log(qq))))


def compact_vs_full(model: str, tokens: np.ndarray, starts: np.ndarray) -> dict:
    ends = [*starts[1:], len(tokens)]
    files = [(s, e) for s, e in zip(starts, ends) if e - s >= 1064][:20]
    prompts = [tokens[s:s + 1000].tolist() for s, _ in files]
    runs = {}
    for mode in ("full", "compact"):
        llm = LLM(model, prefill_mode=mode, keep_tokens=140, **SMALL)
        runs[mode] = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=20),
                                  use_tqdm=False)
    out = {"files": len(files), **_agreement(runs["full"], runs["compact"])}
    print(json.dumps(out))
    return out


def _agreement(references: list, outputs: list) -> dict:
    """Greedy agreement of `outputs` with `references` (64 tokens each, top-20 logprobs): mean KL
    at the shared positions, equal tokens before the first difference, runs all equal."""
    kls, agree = [], []
    for reference, output in zip(references, outputs):
        a, b = reference.outputs[0], output.outputs[0]
        same = 0
        for i in range(len(a.token_ids)):
            if b.token_ids[i] != a.token_ids[i]:
                break
            same += 1
            kls.append(_kl(a.logprobs[i], b.logprobs[i]))
        agree.append(same)
    return {"mean_kl_top20_until_divergence": float(np.mean(kls)),
            "greedy_tokens_equal_before_first_difference_mean": float(np.mean(agree)),
            "all_64_equal": int(sum(a == 64 for a in agree))}


def prefix_replay(model: str, tokens: np.ndarray, starts: np.ndarray) -> dict:
    """Two turns per held-out file: turn 1 the file's first 1,536 tokens, turn 2 its first 2,000
    (hit: 1,536 tokens). Turn 2's 64 greedy tokens with the prefix cache off (cold), with bounded
    replay (128 tokens) and with exact replay (the window halo), each against cold."""
    ends = [*starts[1:], len(tokens)]
    files = [(s, e) for s, e in zip(starts, ends) if e - s >= 2064][:20]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=20)
    runs = {}
    for mode in ("cold", "bounded", "exact"):
        kwargs = {} if mode == "cold" else {"enable_prefix_caching": True, "prefix_replay": mode}
        llm = LLM(model, max_num_seqs=8, max_model_len=4096, **kwargs)
        outs = []
        for s, _ in files:
            llm.generate([tokens[s:s + 1536].tolist()], SamplingParams(max_tokens=1), use_tqdm=False)
            outs.append(llm.generate([tokens[s:s + 2000].tolist()], params, use_tqdm=False)[0])
        runs[mode] = outs
        print(mode, "turn-2 cached tokens", [o.num_cached_tokens for o in outs][:3], flush=True)
    out = {"files": len(files), **{mode: _agreement(runs["cold"], runs[mode]) for mode in ("bounded", "exact")}}
    print(json.dumps(out))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-v4.1-trained")
    ap.add_argument("--heldout", action="store_true")
    ap.add_argument("--samples", action="store_true")
    ap.add_argument("--tau", action="store_true")
    ap.add_argument("--compact", action="store_true")
    ap.add_argument("--prefix", action="store_true")
    args = ap.parse_args(argv)
    tokens, starts = heldout(args.out)
    if args.heldout:
        heldout_loss(args.out)
    if args.samples:
        samples(args.model, tokens, starts)
    if args.tau:
        tau(args.model, tokens)
    if args.compact:
        compact_vs_full(args.model, tokens, starts)
    if args.prefix:
        prefix_replay(args.model, tokens, starts)


if __name__ == "__main__":
    main()
