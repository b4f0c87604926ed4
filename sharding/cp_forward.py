"""Balanced context-parallel (CP) prefill of the full forward.

The prompt is padded and laid out rank-major in zigzag order (`context_parallel.zigzag_slots`):
rank ``r`` of the mesh's ``"cp"`` axis holds blocks ``r`` and ``2 * cp - 1 - r``, so causal
attention work is even.  Every token-local op (embedding, Engram, mHC, MoE, head) runs on the
local tokens only.  Attention is the one place tokens mix; `model.attention.attention_full` takes a
`SequenceShards` whose `gather` is implemented here as an all-gather over ``"cp"`` followed by a
static block shuffle back to natural order.  Everything there is position-based, so local queries
at their true positions see exactly what they see in the single-device forward.

Padding: slots past the prompt hold position -1 and token id 0.  They are never window keys
(`window_mask` drops ``k_pos < 0``), and in natural order they sit after the last real token, so
any compressed entry that pools one of them starts at a position whose group ends past the prompt
and is invisible to every real query under the causal rule ``entry < (pos + 1) // ratio``.

Costs (a first version, exact rather than minimal): every layer all-gathers x and the window KV,
each rank masks its queries against all ``Tp`` window keys although only a ``window``-token halo
can be visible, and the compressor / indexer keys are recomputed on every rank from the gathered
x.  The attention itself (window + top-k, the indexer scores and top-k) is split by query.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from deepinfer.model.config import ModelConfig
from deepinfer.model.forward import backbone, engram_hash_ids, final_hidden
from deepinfer.model.layers import linear
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.sharding.context_parallel import PAD, zigzag_slots

CP_AXIS = "cp"

__all__ = ["CP_AXIS", "ZigzagShards", "cp_layout", "forward_cp", "unzigzag"]


def unzigzag(a: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """Rank-major zigzag order -> natural order along `axis` (a static block shuffle).

    The first halves of the ranks, in rank order, are blocks ``0 .. cp-1``; the second halves, in
    reverse rank order, are blocks ``cp .. 2cp-1``."""
    shape = a.shape
    halves = a.reshape(shape[:axis] + (cp, 2, shape[axis] // (2 * cp)) + shape[axis + 1:])
    first = jnp.take(halves, 0, axis=axis + 1)
    second = jnp.flip(jnp.take(halves, 1, axis=axis + 1), axis=axis)
    return jnp.concatenate([first, second], axis=axis).reshape(shape)


@dataclass(frozen=True)
class ZigzagShards:
    """`model.attention.SequenceShards` inside `shard_map` over the CP axis: gather every rank's
    tokens (axis 1, rank-major) and restore natural order."""

    cp: int
    axis_name: str = CP_AXIS

    def gather(self, a: jax.Array) -> jax.Array:
        return unzigzag(jax.lax.all_gather(a, self.axis_name, axis=1, tiled=True), self.cp)


def cp_layout(num_tokens: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, positions) of the rank-major padded layout `forward_cp` uses: `slots` index the
    padded natural sequence, `positions` are the same with padding slots set to PAD (-1)."""
    slots = zigzag_slots(num_tokens, cp)
    return slots, np.where(slots < num_tokens, slots, PAD)


def _permute(a: np.ndarray, slots: np.ndarray, num_tokens: int) -> np.ndarray:
    """`a [B, T, ...]` -> `[B, len(slots), ...]` in slot order, zeros in padding slots."""
    out = np.zeros((a.shape[0], len(slots), *a.shape[2:]), a.dtype)
    real = slots < num_tokens
    out[:, real] = a[:, slots[real]]
    return out


@partial(jax.jit, static_argnames=("config", "mesh", "kernels"))
def forward_cp_program(params: dict, token_ids: jax.Array, positions: jax.Array, hash_ids: jax.Array | None, *,
                       config: ModelConfig, mesh: Mesh, kernels: KernelConfig | None = None) -> jax.Array:
    """Rank-major `[B, Tp]` inputs (`cp_inputs`) -> rank-major fp32 logits `[B, Tp, vocab]` (token axis
    sharded over "cp"; the caller un-permutes on the host, which moves no logits between devices)."""
    cp = mesh.shape[CP_AXIS]
    seq = ZigzagShards(cp)
    tokens = P(None, CP_AXIS)

    def local(params, token_ids, positions, *hash_ids):
        streams, pre, _ = backbone(params, config, token_ids, hash_ids[0] if hash_ids else None, kernels,
                                positions=positions, seq=seq)
        return linear(final_hidden(params, config, streams, pre), params["head"]).astype(jnp.float32)

    args = (params, token_ids, positions) + (() if hash_ids is None else (hash_ids,))
    specs = (P(), tokens, tokens) + (() if hash_ids is None else (tokens,))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tokens)(*args)


def cp_inputs(config: ModelConfig, token_ids: np.ndarray, cp: int) -> tuple[tuple, np.ndarray]:
    """The rank-major inputs of `forward_cp_program` for prompts `token_ids [B, T]` (token ids,
    positions, Engram hash ids or None: computed on the host from the unpermuted prompts, then
    permuted with them), and `order`: `logits[:, order]` is the program's output in natural order."""
    ids = np.asarray(token_ids)
    B, T = ids.shape
    slots, positions = cp_layout(T, cp)
    hash_ids = engram_hash_ids(config, ids)
    inputs = (jnp.asarray(_permute(ids.astype(np.int32), slots, T)),
              jnp.asarray(np.broadcast_to(positions.astype(np.int32), (B, len(slots)))),
              None if hash_ids is None else jnp.asarray(_permute(hash_ids.astype(np.int32), slots, T)))
    return inputs, np.argsort(slots)[:T]


def forward_cp(params: dict, config: ModelConfig, token_ids, mesh: Mesh, *,
               kernels: KernelConfig | None = None) -> np.ndarray:
    """Logits of whole sequences (`[T]` or `[B, T]`, positions from 0) with the token axis split
    over the mesh's "cp" axis; params replicated. Returns numpy fp32 `[B, T, vocab]` (`[T, vocab]`
    for 1-D input) in natural order, equal to `model.forward.forward` up to summation order.
    The result is fetched to the host, which also blocks (CPU collectives must not queue up)."""
    ids = np.asarray(token_ids)
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    if CP_AXIS not in mesh.shape:
        raise ValueError(f"forward_cp needs a mesh with a {CP_AXIS!r} axis, got axes {tuple(mesh.shape)}")
    inputs, order = cp_inputs(config, ids, mesh.shape[CP_AXIS])
    logits = forward_cp_program(params, *inputs, config=config, mesh=mesh, kernels=kernels)
    out = np.asarray(logits)[:, order]
    return out[0] if squeeze else out
