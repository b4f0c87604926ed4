"""Engram n-gram addressing, computed on the host with numpy int64 (spec §2.7).

Each position p is hashed, per Engram layer, from the compressed ids of the tokens
p, p-1, ..., p-(N-1) (N = `engram_max_ngram_size`): the ids are multiplied by odd 64-bit
per-layer multipliers, XOR-folded one look-back at a time, and each prefix of the fold (the
2..N-gram) is reduced modulo `engram_n_heads` distinct primes into disjoint bucket ranges of
the layer's table. The products need the full 64-bit range, which JAX's default 32-bit
integers cannot hold on device (and enabling x64 globally would change every other dtype).
Since the ids depend only on token ids, the engine computes them here, beside tokenization,
and ships int32 row ids (< 2^31 by construction) to the device.

Look-back stops at the sequence start and at DEAD tokens (image-span tokens): that shift
and every longer one use the pad id instead ("sticky" padding), so an n-gram never spans
a sequence start or an image. Incremental use (chunked prefill, decode) carries the last
N-1 compressed ids (`EngramHasher.lookback`) from one call to the next.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import sympy
import tokenizers
from tokenizers import Regex, normalizers

from deepinfer.model.config import ModelConfig

__all__ = [
    "DEAD",
    "EngramHasher",
    "check_engram_config",
    "compressed_token_map",
    "default_token_map",
    "engram_multipliers",
    "engram_offsets",
    "engram_primes",
]

# Marks a blocked look-back slot: an image-span (DEAD) token, or a position before the
# sequence start. Compressed ids are >= 0.
DEAD = -1
_INT64_MAX = int(np.iinfo(np.int64).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
# Private-use character standing in for a token that is exactly one space, so that it
# survives Strip() instead of becoming the empty string.
_SPACE_SENTINEL = "\ue000"
# Tokens hashed per numpy pass.
_CHUNK = 16384


# ---- compressed token map ----------------------------------------------------------


def _engram_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: tokenizers.Tokenizer) -> tuple[np.ndarray, int]:
    """Map every token id to a compressed id; returns `(map int32 [vocab], n_distinct)`.

    Each id is decoded on its own (special tokens kept) and normalised; ids whose keys are
    equal share a compressed id, numbered in first-seen order of token id. Keys: a decode
    containing U+FFFD (a partial UTF-8 byte sequence) is keyed by its raw `id_to_token`
    string; otherwise the normalised text, or the decoded text itself when normalisation
    leaves nothing (e.g. a lone combining mark or a vertical tab). Takes ~0.4 s for the
    129,280-id vocabulary on one core, so it is not cached on disk.
    """
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    normalize = _engram_normalizer().normalize_str
    key_to_id: dict[str, int] = {}
    out = np.empty(vocab, dtype=np.int32)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize(text) or text
        out[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return out, len(key_to_id)


@functools.lru_cache(maxsize=1)
def _default_token_map() -> tuple[np.ndarray, int]:
    from deepinfer.model.tokenizer import load_tokenizer

    token_map, size = compressed_token_map(load_tokenizer())
    token_map.setflags(write=False)
    return token_map, size


def default_token_map() -> tuple[np.ndarray, int]:
    """`compressed_token_map` of the pinned tokenizer, computed once per process (read-only)."""
    return _default_token_map()


# ---- table layout: primes, offsets, multipliers -------------------------------------


@functools.lru_cache(maxsize=16)
def _primes(n_layers: int, n_gram_sizes: int, n_heads: int, vocab_size: int) -> tuple:
    # One set of primes shared by all (layer, n-gram size) pairs: each pair restarts its
    # search just above vocab_size - 1 and skips every prime an earlier pair took.
    seen: set[int] = set()
    layers = []
    for _ in range(n_layers):
        per_ngram = []
        for _ in range(n_gram_sizes):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current = int(sympy.nextprime(current))
                while current in seen:
                    current = int(sympy.nextprime(current))
                seen.add(current)
                heads.append(current)
            per_ngram.append(tuple(heads))
        layers.append(tuple(per_ngram))
    return tuple(layers)


def engram_primes(cfg: ModelConfig) -> np.ndarray:
    """Table sizes per hash column: int64 `[n_engram_layers, max_ngram - 1, n_heads]`."""
    return np.array(
        _primes(
            len(cfg.engram_layer_ids), cfg.engram_max_ngram_size - 1, cfg.engram_n_heads, cfg.engram_vocab_size
        ),
        dtype=np.int64,
    ).reshape(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size - 1, cfg.engram_n_heads)


def engram_offsets(cfg: ModelConfig) -> np.ndarray:
    """First table row of each hash column: int64 `[n_engram_layers, n_cols]`.

    Exclusive running sum of the layer's primes over the flat (n-gram size, head) order,
    so column `(n - 1) * n_heads + h` owns rows `[offset, offset + prime)` of its layer.
    """
    flat = engram_primes(cfg).reshape(len(cfg.engram_layer_ids), -1)
    return np.cumsum(flat, axis=1) - flat


def engram_multipliers(cfg: ModelConfig) -> np.ndarray:
    """Odd hash multipliers: int64 `[n_engram_layers, max_ngram]` (one per look-back).

    Bounded by `int64_max // engram_compressed_vocab_size` so that compressed id times
    multiplier cannot overflow int64.
    """
    bound = max(1, (_INT64_MAX // cfg.engram_compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer_id).integers(0, bound, cfg.engram_max_ngram_size, dtype=np.int64) * 2 + 1
        for layer_id in cfg.engram_layer_ids
    ]
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, cfg.engram_max_ngram_size), np.int64)


def check_engram_config(cfg: ModelConfig) -> None:
    """Raise ValueError unless the Engram table sizes equal the prime sums and ids fit int32."""
    if cfg.engram_max_ngram_size < 2:
        raise ValueError(f"`engram_max_ngram_size` must be >= 2, got {cfg.engram_max_ngram_size}")
    if cfg.engram_vocab_size < 2:
        raise ValueError(f"`engram_vocab_size` must be >= 2, got {cfg.engram_vocab_size}")
    if cfg.engram_compressed_vocab_size < 1:
        raise ValueError(f"`engram_compressed_vocab_size` must be >= 1, got {cfg.engram_compressed_vocab_size}")
    sums = [int(s) for s in engram_primes(cfg).reshape(len(cfg.engram_layer_ids), -1).sum(axis=1)]
    if list(cfg.engram_num_embeddings) != sums:
        raise ValueError(
            f"`engram_num_embeddings` is {list(cfg.engram_num_embeddings)} but the prime-sized hash "
            f"tables of Engram layers {list(cfg.engram_layer_ids)} sum to {sums} rows"
        )
    if sums and max(sums) > _INT32_MAX:
        raise ValueError(f"`engram_num_embeddings` {sums} exceed int32 row ids (max {_INT32_MAX})")


# ---- hashing ----------------------------------------------------------------------


class EngramHasher:
    """Turns token ids into Engram table rows for every Engram layer of `cfg`.

    `token_map` is the int32 compressed map of `compressed_token_map` (its number of
    distinct ids must equal `cfg.engram_compressed_vocab_size`). Histories exchanged with
    the caller hold compressed ids (DEAD = -1 for an image-span token), most recent last.
    """

    def __init__(self, cfg: ModelConfig, token_map: np.ndarray):
        check_engram_config(cfg)
        token_map = np.asarray(token_map)
        if token_map.ndim != 1 or not np.issubdtype(token_map.dtype, np.integer) or token_map.size == 0:
            raise ValueError(f"token_map must be a non-empty 1-D int array, got {token_map.dtype} {token_map.shape}")
        n_distinct = int(token_map.max()) + 1
        if int(token_map.min()) < 0 or n_distinct != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"`engram_compressed_vocab_size` is {cfg.engram_compressed_vocab_size} but the token map "
                f"has ids in [{int(token_map.min())}, {n_distinct - 1}]; the hash multipliers would "
                "re-address the whole Engram table"
            )
        if not 0 <= cfg.engram_pad_token_id < token_map.size:
            raise ValueError(f"`engram_pad_token_id` {cfg.engram_pad_token_id} is outside the vocabulary")
        self.cfg = cfg
        self.token_map = token_map.astype(np.int64)
        self.token_map.setflags(write=False)
        self.vocab_size = int(token_map.size)
        self.pad_id = int(self.token_map[cfg.engram_pad_token_id])
        self.max_ngram = cfg.engram_max_ngram_size
        self.lookback_len = self.max_ngram - 1
        self.n_layers = len(cfg.engram_layer_ids)
        self.n_heads = cfg.engram_n_heads
        self.n_cols = cfg.n_hash_columns
        self.primes = engram_primes(cfg)  # [L, N-1, H]
        self.offsets = engram_offsets(cfg).reshape(self.primes.shape)  # [L, N-1, H]
        self.multipliers = engram_multipliers(cfg)  # [L, N]
        # compressed id * multiplier and the XOR of such products stay in int64 ...
        if self.n_layers and (n_distinct - 1) * int(self.multipliers.max()) > _INT64_MAX:
            raise ValueError("`engram_compressed_vocab_size` too small for the multipliers: int64 overflow")
        # ... and every row id (< offset + prime <= table size) fits int32 (checked above).
        assert all(n <= _INT32_MAX for n in cfg.engram_num_embeddings)
        self._offsets32 = self.offsets.astype(np.int32)

    @classmethod
    def from_tokenizer(cls, cfg: ModelConfig, tokenizer: tokenizers.Tokenizer | None = None) -> EngramHasher:
        """Build from a tokenizer (default: the pinned one, map computed once per process)."""
        token_map = default_token_map()[0] if tokenizer is None else compressed_token_map(tokenizer)[0]
        return cls(cfg, token_map)

    # -- input preparation --

    def compress(self, token_ids: np.ndarray, dead_mask: np.ndarray | None = None) -> np.ndarray:
        """Compressed ids (int64, same shape), DEAD where `dead_mask` is True."""
        ids = np.asarray(token_ids)
        if ids.size == 0:
            ids = ids.astype(np.int64)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{ids.min()}, {ids.max()}]")
        out = self.token_map[ids]
        if dead_mask is not None:
            dead = np.asarray(dead_mask, dtype=bool)
            if dead.shape != ids.shape:
                raise ValueError(f"dead_mask shape {dead.shape} != token_ids shape {ids.shape}")
            out = np.where(dead, DEAD, out)
        return out

    def _as_history(self, history: np.ndarray | Sequence[int] | None) -> np.ndarray:
        h = np.zeros(0, np.int64) if history is None else np.asarray(history, dtype=np.int64).reshape(-1)
        if h.size and (int(h.min()) < DEAD or int(h.max()) >= self.cfg.engram_compressed_vocab_size):
            raise ValueError(
                f"history holds compressed ids in [0, {self.cfg.engram_compressed_vocab_size}) or DEAD (-1), "
                f"got [{h.min()}, {h.max()}]"
            )
        return h

    def _history_row(self, history: np.ndarray | Sequence[int] | None, valid: int | None = None) -> np.ndarray:
        """Left-pad a history to `lookback_len` with DEAD; keep only its last `valid` entries."""
        k = self.lookback_len
        h = self._as_history(history)
        h = h[h.size - min(k, h.size) :]
        if valid is not None:
            h = h[h.size - min(max(int(valid), 0), h.size) :]
        return np.concatenate([np.full(k - h.size, DEAD, np.int64), h])

    # -- hashing --

    def _hash_extended(self, ext: np.ndarray) -> np.ndarray:
        """ext: int64 [B, K + T] (history then tokens; DEAD blocks) -> int32 [B, T, L, n_cols]."""
        k = self.lookback_len
        batch, total = ext.shape
        t = total - k
        out = np.empty((batch, t, *self.primes.shape), dtype=np.int32)  # [B, T, L, N-1, H]
        # Chunks over T keep the int64 temporaries in cache (~10x faster than one pass).
        for c0 in range(0, t, _CHUNK):
            c1 = min(t, c0 + _CHUNK)
            ext_c, t_c = ext[:, c0 : c1 + k], c1 - c0
            blocked = np.zeros((batch, t_c), dtype=bool)
            shifts = []
            for s in range(self.max_ngram):
                src = ext_c[:, k - s : k - s + t_c]
                blocked |= src == DEAD  # sticky: once blocked, every longer shift is pad
                shifts.append(np.where(blocked, self.pad_id, src))
            tokens = np.stack(shifts, axis=-1)  # [B, t_c, N]
            products = tokens[:, :, None, :] * self.multipliers  # [B, t_c, L, N], no overflow
            folded = np.bitwise_xor.accumulate(products, axis=-1)[..., 1:]  # [B, t_c, L, N-1]
            rows = out[:, c0:c1]
            # Remainders are < prime < 2^31 and row + offset < table size <= 2^31 - 1.
            np.remainder(folded[..., None], self.primes, out=rows, casting="unsafe")
            rows += self._offsets32
        return out.reshape(batch, t, self.n_layers, self.n_cols)

    def hash_ids(
        self,
        token_ids: np.ndarray,
        history: np.ndarray | None = None,
        dead_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Table rows int32 `[T, n_engram_layers, n_cols]` for the tokens `token_ids` [T].

        `history`: compressed ids (DEAD = -1) of the up to `max_ngram - 1` tokens right
        before `token_ids[0]`, most recent last, as returned by `lookback`; None or a shorter
        array means the sequence starts right before it. `dead_mask` [T]: True for image-span
        tokens. Column `(n - 1) * n_heads + h` is head h of the (n+1)-gram.
        """
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {ids.shape}")
        ext = np.concatenate([self._history_row(history), self.compress(ids, dead_mask)])
        return self._hash_extended(ext[None])[0]

    def hash_ids_batch(
        self,
        token_ids: np.ndarray,
        start_positions: np.ndarray | Sequence[int] | None = None,
        histories: np.ndarray | Sequence[np.ndarray | None] | None = None,
        dead_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Table rows int32 `[B, T, n_engram_layers, n_cols]` for `token_ids` [B, T].

        Row b continues a sequence whose first token here sits at absolute position
        `start_positions[b]` (None: all 0 if `histories` is None, else unrestricted).
        `histories[b]` holds the compressed ids before it (a [B, K] array or a list of
        1-D arrays / None, most recent last); only its last `start_positions[b]` entries are
        used. Padding at the end of a row yields valid but meaningless rows.
        """
        ids = np.asarray(token_ids)
        if ids.ndim != 2:
            raise ValueError(f"token_ids must be [B, T], got shape {ids.shape}")
        batch = ids.shape[0]
        if start_positions is not None:
            starts = np.asarray(start_positions, dtype=np.int64).reshape(-1)
            if starts.shape != (batch,) or (starts.size and int(starts.min()) < 0):
                raise ValueError(f"start_positions must be [B] non-negative, got {start_positions!r}")
        else:
            starts = None
        k = self.lookback_len
        if histories is None:
            if starts is not None and starts.size and int(starts.max()) > 0:
                raise ValueError("start_positions > 0 need `histories` (the look-back before each row)")
            hist = np.full((batch, k), DEAD, np.int64)
        elif isinstance(histories, np.ndarray) and histories.ndim == 2:
            if histories.shape[0] != batch:
                raise ValueError(f"histories has {histories.shape[0]} rows for a batch of {batch}")
            width = histories.shape[1]
            h = self._as_history(histories).reshape(histories.shape)[:, width - min(k, width) :]
            hist = np.concatenate([np.full((batch, k - h.shape[1]), DEAD, np.int64), h], axis=1)
            if starts is not None:  # slot j holds absolute position start - k + j
                hist = np.where(np.arange(k) >= k - starts[:, None], hist, DEAD)
        else:
            rows = list(histories)
            if len(rows) != batch:
                raise ValueError(f"histories has {len(rows)} rows for a batch of {batch}")
            hist = np.stack(
                [self._history_row(rows[b], None if starts is None else int(starts[b])) for b in range(batch)]
            ).reshape(batch, k)
        ext = np.concatenate([hist, self.compress(ids, dead_mask)], axis=1)
        return self._hash_extended(ext)

    def pending_folds(self, history: np.ndarray | Sequence[int] | None) -> np.ndarray:
        """What the device needs to hash a token it has not told the host yet (asynchronous
        scheduling): the XOR fold of the look-back's products, `K_j = XOR_{s=1..j} c_s * m_s`
        for j = 1..N-1, as uint32 `[n_layers, N - 1, 2]` (high word, low word). The token's own
        product `c_0 * m_0` XOR `K_j`, reduced modulo the primes, gives its rows
        (`engram_hash_device.hash_pending`). `history` as for `hash_ids` (compressed ids,
        DEAD = -1 before the sequence start); the pending token itself is never DEAD."""
        hist = self._history_row(history)[::-1]  # shift 1 first
        blocked = np.cumsum(hist == DEAD) > 0  # sticky: a blocked shift blocks every longer one
        shifted = np.where(blocked, self.pad_id, hist)
        folds = np.bitwise_xor.accumulate(shifted[None, :] * self.multipliers[:, 1:], axis=-1)  # [L, N-1]
        words = folds.astype(np.uint64)
        return np.stack([(words >> np.uint64(32)).astype(np.uint32), (words & np.uint64(0xFFFFFFFF)).astype(np.uint32)],
                        axis=-1)

    def draft_folds(self, history: np.ndarray | Sequence[int] | None, k: int) -> np.ndarray:
        """What the device needs to hash k draft tokens it has not told the host (speculative
        decoding): for the drafts at 1..k positions after the last token of `history` (the
        anchor, compressed ids as for `hash_ids`), the XOR fold of the products of the shifts
        that reach the host's tokens: for draft j and n-gram n (shifts 0..n), `XOR_{s=j..n}
        c_s * m_s` (0 when n < j), uint32 `[k, n_layers, N - 1, 2]` (high word, low word). The
        drafts' own products are the device's (`engram_hash_device.hash_drafts`)."""
        hist = self._history_row(history)[::-1]  # offset o = shift j + o of draft j
        blocked = np.cumsum(hist == DEAD) > 0  # sticky, as in `_hash_extended` (drafts are never DEAD)
        shifted = np.where(blocked, self.pad_id, hist)
        folds = np.zeros((k, self.n_layers, self.max_ngram - 1), np.uint64)
        for j in range(1, k + 1):
            acc = np.zeros(self.n_layers, np.int64)
            for s in range(1, self.max_ngram):  # fold index s-1 covers shifts 0..s
                if s >= j:
                    acc = acc ^ (shifted[s - j] * self.multipliers[:, s])
                folds[j - 1, :, s - 1] = acc.astype(np.uint64)
        return np.stack([(folds >> np.uint64(32)).astype(np.uint32), (folds & np.uint64(0xFFFFFFFF)).astype(np.uint32)],
                        axis=-1)

    def lookback(
        self,
        token_ids: np.ndarray,
        history: np.ndarray | None = None,
        dead_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """History to pass with the tokens after `token_ids`: the last `max_ngram - 1`
        compressed ids (DEAD = -1) of history + token_ids, int64, shorter near the start."""
        ids = np.asarray(token_ids).reshape(-1)
        h = self._as_history(history)
        seq = np.concatenate([h, self.compress(ids, None if dead_mask is None else np.asarray(dead_mask).reshape(-1))])
        k = self.lookback_len
        return seq[seq.size - min(k, seq.size) :].copy()


@functools.lru_cache(maxsize=8)
def hasher_for(cfg: ModelConfig) -> EngramHasher:
    """The hasher of a config with the pinned tokenizer (one per config per process)."""
    return EngramHasher.from_tokenizer(cfg)
