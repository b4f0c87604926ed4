"""DSpark's verify step on a device mesh: the three programs of `speculative.py` (propose,
target, accept), each run on every dp rank's share under `shard_map`, like the mesh's model step
(`sharding.engine_step`).

A verify row is a decode row: it lives on its slot's dp rank, with the rank's LOCAL slot and
page ids (`ModelRunner._batch` groups the rows by rank), so the drafter reads the rank's drafter
rings, the target writes the rank's cache and the acceptance rolls back the rank's slots and
counts into the rank's sampling state, all without leaving the rank. Only the MoE layers (the
target's and the drafter's) cross ranks, through the mesh's expert-parallel exchange (`ep`).
The per-row results that the next program reads (the proposal, the target's logits and undo
record) stay split over dp; what the host reads (the accepted tokens, and in a step with
structured output the drafts) is gathered over dp, so every process holds all rows.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from deepinfer.model.rollback import RingSnapshot, Undo
from deepinfer.ops.batch_invariant import batch_invariant
from deepinfer.serve.engine.speculative import VerifiedLogits, accept_drafts, propose_drafts, verify_target
from deepinfer.sharding.engine_step import MeshStep, batch_specs, cache_specs, params_specs

__all__ = ["MeshVerifyPrograms"]


def _rows(tree):
    """Specs of a pytree whose leaves lead with the step's rows: split over dp."""
    return jax.tree.map(lambda _: P("dp"), tree)


def _undo_specs(undo: Undo) -> Undo:
    """The ring snapshot's rows `[rings, B, T, ...]` split their row dim, the rest its leading."""
    rings = undo.rings
    return Undo(RingSnapshot(tuple(P(None, "dp") for _ in rings.rows), P("dp"), P("dp")),
                tuple(P("dp") for _ in undo.pair_inputs))


def _gathered(tree):
    """Every rank's rows, for the host (all processes) to read."""
    return jax.tree.map(lambda a: jax.lax.all_gather(a, "dp", axis=0, tiled=True), tree)


class MeshVerifyPrograms:
    """`StepPrograms`' `propose`, `target` and `accept` over `mesh_step`'s mesh, with the same
    arguments (the step's inputs placed by `place`, rows over dp); `accept` returns its
    `VerifyOutput` gathered over dp."""

    def __init__(self, mesh_step: MeshStep):
        self.step = mesh_step
        self._programs: dict[tuple, object] = {}

    def place(self, tree):
        """A verify step's host inputs (batch, sampler rows, draft inputs) as global arrays."""
        return self.step.place_rows(tree)

    def _run(self, key: tuple, fn, args: tuple, in_specs: tuple, out_specs, donate: tuple):
        """`fn` over every rank's share of `args`, compiled on its first `key`; `out_specs`: the
        output specs, or a function of the per-rank output's abstract value."""
        if key not in self._programs:
            mesh = self.step.mesh
            if callable(out_specs):  # (traced once, at compilation)
                local = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
                out_specs = out_specs(jax.eval_shape(local, *args))
            mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
            jitted = jax.jit(mapped, donate_argnums=donate, compiler_options=self.step.options)
            self._programs[key] = self.step.compile(jitted, args, f"verify {key[0]}")
        return self._programs[key](*args)

    def _bound(self) -> dict:
        s = self.step
        return dict(config=s.config, layout=s.layout, kernels=s.kernels, ep=s.ep)

    @staticmethod
    def _shapes(tree) -> tuple:
        """A program's key: the structure (masks or none, ...) and shapes of the step's own
        arguments (params, cache and sampling state are the runner's, fixed)."""
        return jax.tree.structure(tree), tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves(tree))

    def propose(self, params, cache, state, batch, rows, drafts_in):
        fn = partial(propose_drafts, **self._bound(), coupled=self.step.invariant)
        args = (params, cache, state, batch, rows, drafts_in)
        specs = (params_specs(params), cache_specs(cache), _rows(state), batch_specs(batch, False), _rows(rows),
                 _rows(drafts_in))
        return self._run(("propose", self._shapes(args[3:])), fn, args, specs, _rows, ())

    def target(self, params, cache, batch, drafts_in, proposal):
        def fn(params, cache, batch, drafts_in, proposal):
            cache, verified, counts = verify_target(params, cache, batch, drafts_in, proposal, **self._bound())
            return cache, verified, jax.lax.psum(counts, "dp")

        args = (params, cache, batch, drafts_in, proposal)
        specs = (params_specs(params), cache_specs(cache), batch_specs(batch, False), _rows(drafts_in),
                 _rows(proposal))

        def out_specs(local):
            return cache_specs(cache), VerifiedLogits(P("dp"), _undo_specs(local[1].undo)), P()

        return self._run(("target", self._shapes(args[2:])), fn, args, specs, out_specs, (1,))

    def accept(self, cache, state, batch, rows, drafts_in, proposal, verified, masks, *, head):
        body = batch_invariant(partial(accept_drafts, by_sample=True)) if self.step.invariant else accept_drafts

        def fn(cache, state, batch, rows, drafts_in, proposal, verified, *masks):
            cache, state, out = body(cache, state, batch, rows, drafts_in, proposal, verified,
                                     masks[0] if masks else None, head=head)
            return cache, state, _gathered(out)

        args = (cache, state, batch, rows, drafts_in, proposal, verified) + (() if masks is None else (masks,))
        specs = (cache_specs(cache), _rows(state), batch_specs(batch, False), _rows(rows), _rows(drafts_in),
                 _rows(proposal), VerifiedLogits(P("dp"), _undo_specs(verified.undo))) + _rows(args[7:])
        out_specs = (cache_specs(cache), _rows(state), P())
        return self._run(("accept", head, self._shapes(args[2:])), fn, args, specs, out_specs, (0, 1))
