"""Count-based baselines for the trained model's held-out loss: a unigram (add-1/2) and an
interpolated bigram (Witten-Bell), both over the full 129,280-id vocabulary, fitted on the
train split of `train_data.py` and scored on the held-out split (every next-token prediction
of the concatenated held-out stream). Prints nats per token and perplexity.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

import train_data

VOCAB = 129280


def unigram_log_probs(train: np.ndarray, vocab: int = VOCAB, alpha: float = 0.5) -> np.ndarray:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + alpha
    return np.log(counts / counts.sum())


def bigram_nll(train: np.ndarray, held: np.ndarray, vocab: int = VOCAB) -> tuple[float, float]:
    """(unigram, bigram) mean NLL in nats of held[1:] given held[:-1]."""
    uni = unigram_log_probs(train, vocab)
    keys, counts = np.unique(train[:-1].astype(np.int64) * vocab + train[1:], return_counts=True)
    prev_total = np.bincount(train[:-1], minlength=vocab).astype(np.float64)
    prev_types = np.bincount(keys // vocab, minlength=vocab).astype(np.float64)
    prev, nxt = held[:-1].astype(np.int64), held[1:].astype(np.int64)
    q = prev * vocab + nxt
    pos = np.clip(np.searchsorted(keys, q), 0, len(keys) - 1)
    pair = np.where(keys[pos] == q, counts[pos], 0).astype(np.float64)
    c, t = prev_total[prev], prev_types[prev]
    lam = np.where(c > 0, c / np.maximum(c + t, 1), 0.0)  # Witten-Bell weight of the bigram estimate
    p = lam * pair / np.maximum(c, 1) + (1 - lam) * np.exp(uni[nxt])
    return float(-uni[nxt].mean()), float(-np.log(p).mean())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="run directory holding data/ (train_data.py)")
    args = ap.parse_args(argv)
    train = np.asarray(train_data.load_split(args.out, "train"))
    held = np.asarray(train_data.load_split(args.out, "heldout"))
    uni, bi = bigram_nll(train, held)
    print(json.dumps({"heldout_tokens": int(held.size - 1), "unigram_nll": round(uni, 4),
                      "unigram_ppl": round(math.exp(uni), 1), "bigram_nll": round(bi, 4),
                      "bigram_ppl": round(math.exp(bi), 1)}))


if __name__ == "__main__":
    main()
