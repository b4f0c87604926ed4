"""Engram addressing (spec §2.7, §7.1) and the pinned tokenizer (interfaces.md §3).

Ground truth: constants of the release config (compressed vocabulary size, multipliers,
primes, table sizes) and hashes recomputed here with Python ints, independently of the
module's vectorised loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sympy

from deepinfer.model import engram_hash as eh
from deepinfer.model import tokenizer as tk
from deepinfer.model.config import DEEPSEEK_V41_FLASH, TINY_V41

CFG = DEEPSEEK_V41_FLASH
MULT = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


@pytest.fixture(scope="module")
def tokenizer():
    return tk.load_tokenizer()


@pytest.fixture(scope="module")
def token_map(tokenizer):
    cmap, size = eh.compressed_token_map(tokenizer)
    return cmap, size


@pytest.fixture(scope="module")
def hasher(token_map):
    return eh.EngramHasher(CFG, token_map[0])


def _release_primes() -> list[list[list[int]]]:
    # One shared pool, each (layer, n-gram) pair restarting above vocab-1 and skipping used
    # primes == simply the first 48 primes above 15,999,999, in order.
    pool = list(sympy.primerange(CFG.engram_vocab_size, CFG.engram_vocab_size + 2000))[:48]
    return [[pool[(li * 3 + n) * 8 : (li * 3 + n + 1) * 8] for n in range(3)] for li in range(2)]


def _hand_hash(cmap: np.ndarray, ids: list[int], dead: list[bool] | None = None) -> np.ndarray:
    """Rows [T, 2, 24] with Python ints: t_s sticky-padded at the start and at DEAD tokens."""
    primes = _release_primes()
    pad = int(cmap[2])
    dead = dead or [False] * len(ids)
    out = np.zeros((len(ids), 2, 24), dtype=np.int64)
    for p in range(len(ids)):
        t, blocked = [], False
        for s in range(4):
            q = p - s
            blocked = blocked or q < 0 or dead[q]
            t.append(pad if blocked else int(cmap[ids[q]]))
        for li, layer_id in enumerate((1, 14)):
            m = MULT[layer_id]
            flat = [pr for per in primes[li] for pr in per]
            r = t[0] * m[0]
            for n in range(1, 4):
                r ^= t[n] * m[n]
                for h in range(8):
                    col = (n - 1) * 8 + h
                    out[p, li, col] = r % flat[col] + sum(flat[:col])
    return out


# ---- tokenizer -------------------------------------------------------------------------


def test_tokenizer_pinned_and_encodes(tokenizer):
    assert tk.file_sha256(tk.tokenizer_path()) == tk.DEFAULT_SHA256
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 129280
    text = "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>hi<｜Assistant｜><think>"
    expected = [0, 3476, 477, 11502, 16, 128803, 6366, 128804, 128821]
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected
    assert tk.decode_token(tokenizer, 1) == "<｜end▁of▁sentence｜>"
    assert tk.load_tokenizer() is tokenizer  # cached per process


def test_tokenizer_sha256_rejects_tampered_file(tmp_path):
    data = tk.tokenizer_path().read_bytes()
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(data + b"\n")  # still valid JSON, different bytes
    with pytest.raises(tk.TokenizerHashError) as err:
        tk.load_tokenizer(bad)
    msg = str(err.value)
    assert str(bad.resolve()) in msg and tk.DEFAULT_SHA256 in msg and tk.file_sha256(bad) in msg
    with pytest.raises(tk.TokenizerHashError):
        tk.load_tokenizer(str(bad))  # a failed check is not cached
    assert tk.load_tokenizer(bad, expected_sha256=None).get_vocab_size(True) == 129280


# ---- compressed token map --------------------------------------------------------------


def test_compressed_map_matches_release(tokenizer, token_map):
    cmap, size = token_map
    assert cmap.dtype == np.int32 and cmap.shape == (129280,)
    assert size == 99_092 == CFG.engram_compressed_vocab_size
    assert int(cmap.max()) + 1 == size and int(cmap[2]) == 2
    # first-seen interning: a new compressed id is always the next one
    first = np.maximum.accumulate(cmap)
    assert np.all(np.diff(first) <= 1)
    # case / leading-space folding
    ids = [tokenizer.encode(s, add_special_tokens=False).ids for s in (" The", "the", "THE")]
    assert all(len(i) == 1 for i in ids) and len({int(cmap[i[0]]) for i in ids}) == 1
    # tokens that normalise to "" keep their own text as key (vertical tab vs form feed)
    assert tk.decode_token(tokenizer, 202) == "\x0b" and tk.decode_token(tokenizer, 203) == "\x0c"
    assert cmap[202] != cmap[203]


# ---- layout constants ------------------------------------------------------------------


def test_release_multipliers():
    mult = eh.engram_multipliers(CFG)
    assert mult.dtype == np.int64 and mult.shape == (2, 4)
    assert mult.tolist() == [MULT[1], MULT[14]]


def test_release_primes_offsets_and_sizes():
    primes = eh.engram_primes(CFG)
    assert primes.dtype == np.int64 and primes.shape == (2, 3, 8)
    assert primes[0].min() == primes[0, 0, 0] == 16_000_057 and primes[0].max() == primes[0, 2, 7] == 16_000_463
    assert primes[1].min() == primes[1, 0, 0] == 16_000_477 and primes[1].max() == primes[1, 2, 7] == 16_000_889
    assert primes.tolist() == _release_primes()
    assert len(set(primes.ravel().tolist())) == 48
    assert primes.reshape(2, -1).sum(axis=1).tolist() == [384_006_168, 384_016_682]
    assert list(CFG.engram_num_embeddings) == [384_006_168, 384_016_682]
    offsets = eh.engram_offsets(CFG)
    assert offsets.shape == (2, 24) and offsets[:, 0].tolist() == [0, 0]
    assert offsets[0, 1] == 16_000_057 and offsets[1, 23] == 384_016_682 - 16_000_889
    eh.check_engram_config(CFG)


def test_tiny_preset_table_sizes():
    primes = eh.engram_primes(TINY_V41)
    assert primes.shape == (2, 3, 4)
    assert list(TINY_V41.engram_num_embeddings) == primes.reshape(2, -1).sum(axis=1).tolist()
    eh.check_engram_config(TINY_V41)
    bad = dataclasses.replace(TINY_V41, engram_num_embeddings=(12458, 13417))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        eh.check_engram_config(bad)


def test_hasher_rejects_wrong_compressed_vocab(token_map):
    cmap = token_map[0].copy()
    cmap[cmap == 99_091] = 0  # one id fewer
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        eh.EngramHasher(CFG, cmap)


# ---- hashing ---------------------------------------------------------------------------


def test_hash_matches_hand_computation(tokenizer, token_map, hasher):
    ids = tokenizer.encode("Hello World, the quick brown fox sat.", add_special_tokens=False).ids
    got = hasher.hash_ids(np.array(ids))
    assert got.dtype == np.int32 and got.shape == (len(ids), 2, 24)
    np.testing.assert_array_equal(got, _hand_hash(token_map[0], ids))
    assert np.all(got >= 0) and np.all(got[:, 0] < 384_006_168) and np.all(got[:, 1] < 384_016_682)


def test_sticky_pad_at_sequence_start(hasher):
    ids = np.array([19923, 2058, 14, 270, 7539])
    whole = hasher.hash_ids(ids)
    # the look-back before position 0 reads pad (= map of token id 2) for every shift
    for p in range(4):
        padded = np.concatenate([np.full(3, 2), ids])
        np.testing.assert_array_equal(whole[p], hasher.hash_ids(padded)[3 + p])
    # a sequence start inside a longer history differs from one with real tokens before it
    assert not np.array_equal(hasher.hash_ids(ids[2:])[0], whole[2])


@pytest.mark.parametrize("split", [0, 1, 2, 3, 7, 40])
def test_incremental_equals_whole(hasher, split):
    ids = np.random.default_rng(split).integers(0, 129280, 40)
    whole = hasher.hash_ids(ids)
    hist = hasher.lookback(ids[:split])
    assert len(hist) == min(split, 3)
    parts = [hasher.hash_ids(ids[:split]), hasher.hash_ids(ids[split:], hist)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_token_by_token_decode(hasher):
    ids = np.random.default_rng(7).integers(0, 129280, 12)
    dead = np.zeros(12, bool)
    dead[4:6] = True
    whole = hasher.hash_ids(ids, dead_mask=dead)
    hist, steps = None, []
    for p in range(12):
        steps.append(hasher.hash_ids(ids[p : p + 1], hist, dead_mask=dead[p : p + 1]))
        hist = hasher.lookback(ids[p : p + 1], hist, dead_mask=dead[p : p + 1])
    np.testing.assert_array_equal(np.concatenate(steps), whole)


def test_dead_tokens_block_lookback(token_map, hasher):
    ids = [19923, 2058, 14, 270, 7539, 3825, 100, 200]
    dead = [False, False, True, False, False, False, False, False]
    got = hasher.hash_ids(np.array(ids), dead_mask=np.array(dead))
    np.testing.assert_array_equal(got, _hand_hash(token_map[0], ids, dead))
    a = np.array(ids)
    np.testing.assert_array_equal(got[2], hasher.hash_ids(np.array([2]))[0])  # DEAD itself: all pad
    np.testing.assert_array_equal(got[3], hasher.hash_ids(a[3:4])[0])  # like a sequence start
    # sticky: position 5 sees 7539, 270, then DEAD -> pad, and pad again for token 2058
    np.testing.assert_array_equal(got[5], hasher.hash_ids(a[3:6])[2])
    np.testing.assert_array_equal(got[6], hasher.hash_ids(a[3:])[3])  # past the DEAD: normal
    assert not np.array_equal(got[5], hasher.hash_ids(a)[5])


def test_batch_matches_rows(hasher):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 129280, 20) for _ in range(3)]
    starts = [0, 2, 9]  # row b hashes seqs[b][starts[b]:starts[b] + 8]
    chunk = np.stack([s[st : st + 8] for s, st in zip(seqs, starts)])
    hists = [hasher.lookback(s[:st]) for s, st in zip(seqs, starts)]
    full_hists = np.stack([np.concatenate([np.full(3 - len(h), 0), h]) for h in hists])
    got = hasher.hash_ids_batch(chunk, start_positions=starts, histories=full_hists)
    for b, (s, st) in enumerate(zip(seqs, starts)):
        np.testing.assert_array_equal(got[b], hasher.hash_ids(s)[st : st + 8])
    np.testing.assert_array_equal(hasher.hash_ids_batch(chunk, histories=hists), got)
    np.testing.assert_array_equal(hasher.hash_ids_batch(chunk, starts, [np.asarray(h) for h in full_hists]), got)
    with pytest.raises(ValueError, match="histories"):
        hasher.hash_ids_batch(chunk, start_positions=starts)
