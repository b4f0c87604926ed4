"""Flip-aware comparison of runs with the QAT fake-quant on.

Why: the fake-quant rounds activations onto FP8/FP4 grids. Two correct computations of one value
(fp32 against the float64 reference, another XLA fusion, another reduction order across shards,
a chunked engine step against the whole-sequence program) differ by a few ulps, and a value that
close to a rounding boundary lands on different grid points; in a random tiny model one such
flip moves every later logit by up to ~1. Which values flip depends on the CPU's instruction set
and XLA's fusion, so a plain comparison of the outputs holds on one machine and fails on the next.

So one side adopts the other's quantization decisions, after checking at every quantization site
that they are legitimate, and the outputs are then compared as tightly as with fake-quant off:

- `record(fn, *args)` runs `fn` (any jax function; traced with `jax.make_jaxpr` and re-run
  under `jax.jit`, so the model code is untouched; inside `shard_map`, per shard) and captures
  every QAT site: each call of `ops.quant`'s jitted quantizers (`fake_quant_fp8/fp4`,
  `pack_fp8_blocks`, `pack_fp4_*`), its input rows and its quantized values. `Sites.check_quantizers()` compares the values bit for bit
  with the float64 reference's quantizers (tests/reference/v41_reference.py) on the same inputs.
- `adopting(sites)`: the numpy references quantize through the recorded decisions. Each reference
  row is matched to the recorded row of the same site kind nearest to it, which must lie within
  `tol` of it (relative to the row's largest magnitude; every other row is O(1) away), and the
  recorded values are used from there on, so a flip cannot propagate.
- `Replayer(sites)(key, fn, *args)`: the same for another jax program; a row with no recorded row
  within `tol` (padding, or a real difference, which the outputs then show) keeps its own values.

Both sum up what they found in an `Adoption`, whose `check` asserts that the matched rows agree
to 1e-4 (measured ~1e-5), that the expected number of rows found no twin, and that few matched
rows quantize differently on their own (rounding flips, measured 0.1-0.4 %; a wrong quantizer
flips most rows). tests/test_qat_sites.py shows both sides of that on small programs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from deepinfer.ops import quant

_FAKE = {"_fake_quant_fp8_jit": "fp8", "_fake_quant_fp4_jit": "fp4"}
_PACK = {"_pack_fp8_jit": "fp8", "_pack_fp4_jit": "fp4"}
TOL = 1e-3


@dataclass(frozen=True)
class Kind:
    """One quantizer configuration: format, block along the last axis, FP4 scale format."""

    fmt: str  # "fp8" (e4m3, ue8m0 scale) or "fp4" (e2m1)
    block: int
    e4m3_scales: bool
    width: int  # the last axis


def _site_kind(eqn) -> Kind | None:
    name = eqn.params.get("name") if eqn.primitive.name in ("jit", "pjit") else None
    fmt = _FAKE.get(name) or _PACK.get(name)
    if fmt is None:
        return None
    inner = eqn.params["jaxpr"].jaxpr
    block = next(e.params["new_sizes"][-1] for e in inner.eqns if e.primitive.name == "reshape")
    e4m3 = fmt == "fp4" and any(e.primitive.name == "convert_element_type"
                                and e.params["new_dtype"] == jnp.float8_e4m3fn for e in inner.eqns)
    return Kind(fmt, int(block), e4m3, int(eqn.invars[0].aval.shape[-1]))


def _values(kind: Kind, name: str, outs):
    """The dequantized values of a site's outputs (pack sites return codes and scales)."""
    if name in _FAKE:
        return outs[0].astype(jnp.float32)
    if kind.fmt == "fp8":
        return quant.unpack_fp8_blocks(*outs)
    return quant._unpack_fp4_jit(outs[0], outs[1], kind.block, kind.e4m3_scales)


def _contains_site(params) -> bool:
    for sub in jcore.jaxprs_in_params(params):
        for e in sub.eqns:
            if _site_kind(e) is not None or _contains_site(e.params):
                return True
    return False


def _eval(jaxpr, consts, args, on_site, extras):
    """Evaluate `jaxpr` by binding its equations (inside a trace: the same program), inlining
    nested jits, and handing each QAT site to `on_site(kind, name, eqn, invals) -> outvals`, which
    may append to `extras`."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, a in zip(jaxpr.constvars, consts):
        env[v] = a
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        kind = _site_kind(eqn)
        if kind is not None:
            outvals = on_site(kind, eqn.params["name"], eqn, invals)
        elif eqn.primitive.name in ("jit", "pjit"):
            inner = eqn.params["jaxpr"]
            outvals = _eval(inner.jaxpr, inner.consts, invals, on_site, extras)
        elif eqn.primitive.name == "custom_vjp_call":  # the quantizers' straight-through wrapper:
            inner = eqn.params["call_jaxpr"]  # its forward is exactly the call inside
            outvals = _eval(inner.jaxpr, inner.consts, invals, on_site, extras)
        elif eqn.primitive.name == "shard_map" and _contains_site(eqn.params):
            outvals = _eval_shard_map(eqn, invals, on_site, extras)
        else:
            if _contains_site(eqn.params):
                raise NotImplementedError(f"a QAT site inside `{eqn.primitive.name}` cannot be intercepted")
            outvals = _outs(_bind(eqn, invals))
        for v, a in zip(eqn.outvars, outvals):
            env[v] = a
    return [read(v) for v in jaxpr.outvars]


def _eval_shard_map(eqn, invals, on_site, extras):
    """A `shard_map` holding QAT sites, re-run as a `shard_map` of its body with the sites handed to
    `on_site` per shard. What the handler appends to `extras` inside the body (per-shard arrays
    with a leading row axis) leaves the map concatenated over the shards."""
    p = eqn.params
    manual = tuple(a for a in p["mesh"].axis_names if a in p["newly_manual_axes"])

    def body(*args):
        outer, extras[:] = list(extras), []
        try:
            outs = _eval(p["jaxpr"], (), args, on_site, extras)
            return outs, list(extras)
        finally:
            extras[:] = outer

    mapped = jax.shard_map(body, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                           out_specs=(list(p["out_specs"]), P(manual)), axis_names=set(manual),
                           check_vma=p["check_vma"])
    outs, new = mapped(*invals)
    extras.extend(new)
    return outs


def _bind(eqn, invals):
    with eqn.ctx.manager:
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))


def _outs(outs) -> list:
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _intercepting(fn, site_handler):
    """A jitted `run(*args) -> (fn(*args), extras)` evaluating `fn`'s jaxpr with its sites handed
    to `site_handler(extras, aux)(kind, name, eqn, invals)`, which may append to the `extras` list
    of the current trace; `run(aux, *args)` passes `aux` (arrays) to the handler. Retraces per
    input shape like any jit."""

    def run(aux, *args):
        flat, tree = jax.tree.flatten(args)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
        closed, out_shape = jax.make_jaxpr(lambda *a: fn(*jax.tree.unflatten(tree, a)), return_shape=True)(*avals)
        extras = []
        outs = _eval(closed.jaxpr, closed.consts, flat, site_handler(extras, aux), extras)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs), extras

    return jax.jit(run)


# ---- recording ----------------------------------------------------------------------------------


@dataclass
class Sites:
    """Recorded QAT sites: per kind, the input rows `x [N, width]` and values `q [N, width]`."""

    x: dict = field(default_factory=dict)
    q: dict = field(default_factory=dict)
    calls: int = 0

    def add(self, kind: Kind, x, q) -> None:
        self.x[kind] = np.concatenate([self.x.get(kind, np.zeros((0, kind.width), np.float32)), x])
        self.q[kind] = np.concatenate([self.q.get(kind, np.zeros((0, kind.width), np.float32)), q])
        self.calls += 1

    def check_quantizers(self) -> None:
        """Every recorded site's values are the float64 reference's quantization of its input,
        bit for bit (so a wrong scale or rounding in the model fails here)."""
        for kind, x in self.x.items():
            want = np.asarray(reference_quantize(kind, x), np.float32)
            bad = np.flatnonzero(np.any(want != self.q[kind], axis=-1))
            assert bad.size == 0, f"{kind}: {bad.size} of {len(x)} rows differ from the reference quantizer"


_RECORDERS: dict = {}


def record(fn, *args, key=None):
    """(fn's outputs, `Sites`) of one run of `fn(*args)` with every QAT site captured. With a
    `key` (naming `fn` and its static setup) the compiled program is kept for later calls."""
    flat = jax.tree.leaves(args)
    full_key = None if key is None else (key, tuple((a.shape, str(a.dtype)) for a in flat))
    if full_key not in _RECORDERS:
        kinds: list[Kind] = []

        def handler(extras, _):
            kinds.clear()

            def on_site(kind, name, eqn, invals):
                outs = _outs(_bind(eqn, invals))
                w = kind.width
                kinds.append(kind)
                extras.append((invals[0].reshape(-1, w).astype(jnp.float32),
                               _values(kind, name, outs).reshape(-1, w)))
                return outs
            return on_site

        entry = (_intercepting(fn, handler), kinds)
        if full_key is None:
            return _collect(entry, args)
        _RECORDERS[full_key] = entry
    return _collect(_RECORDERS[full_key], args)


def _collect(entry, args):
    run, kinds = entry
    out, captured = run(None, *args)
    sites = Sites()
    for kind, (x, q) in zip(kinds, captured):
        sites.add(kind, np.asarray(x), np.asarray(q))
    return out, sites


def record_forward(params: dict, config, token_ids):
    """`model.forward`'s logits (float64 `[T, vocab]` for one prompt `[T]`, `[B, T, vocab]` for
    `[B, T]`) and its recorded QAT sites."""
    from deepinfer.model.forward import engram_hash_ids, forward_jit

    ids = np.asarray(token_ids)
    batch = ids if ids.ndim == 2 else ids[None]
    hash_ids = engram_hash_ids(config, batch)
    logits, sites = record(lambda p, i, h: forward_jit(p, config, i, h), params, jnp.asarray(batch, jnp.int32),
                           None if hash_ids is None else jnp.asarray(hash_ids, jnp.int32), key=("forward", config))
    logits = np.asarray(logits, np.float64)
    return (logits if ids.ndim == 2 else logits[0]), sites


def reference_quantize(kind: Kind, x: np.ndarray) -> np.ndarray:
    """The float64 reference's quantization (float32 arithmetic) of rows `x` of `kind`."""
    if kind.fmt == "fp8":
        return _ORIGINAL["fake_quant_fp8_ue8m0"](x, kind.block)
    return _ORIGINAL["fake_quant_fp4"](x, kind.block, e4m3_scale=kind.e4m3_scales)


# ---- adopting the recorded decisions ---------------------------------------------------------


@dataclass
class Adoption:
    """What adopting recorded decisions found: rows matched within `tol`, rows left unmatched,
    matched rows whose own quantization differs (flips), and the largest matched distance."""

    rows: int = 0
    matched: int = 0
    flipped_rows: int = 0
    flipped_values: int = 0
    max_distance: float = 0.0

    def add(self, rows, matched, flipped_rows, flipped_values, distance) -> None:
        self.rows += int(rows)
        self.matched += int(matched)
        self.flipped_rows += int(flipped_rows)
        self.flipped_values += int(flipped_values)
        self.max_distance = max(self.max_distance, float(distance))

    def check(self, *, unmatched: int | None = 0, max_flipped: float = 0.02, agree: float = 1e-4) -> None:
        """The adoption was legitimate: exactly `unmatched` rows (None: any number, for programs
        with padding rows) found no recorded twin, the matched ones agree within `agree`, and at
        most `max_flipped` of them quantize differently on their own (rounding flips; a wrong
        quantizer flips most rows). Prints the figures (pytest -s)."""
        print(f" QAT sites: {self}", end="")
        assert self.matched > 0, "no row matched a recorded site: the runs compute different things"
        if unmatched is not None:
            assert self.rows - self.matched == unmatched, \
                f"{self.rows - self.matched} of {self.rows} rows match no recorded row (expected {unmatched})"
        assert self.max_distance <= agree, f"matched rows differ by up to {self.max_distance:.3g}"
        assert self.flipped_rows <= max_flipped * self.matched, \
            f"{self.flipped_rows} of {self.matched} rows quantize differently: not rounding flips"


def _nearest(xp, rows, table):
    """Index of the nearest table row to each row, and the distance (max |diff| over the row,
    relative to the table row's largest magnitude)."""
    d2 = (rows * rows).sum(-1)[:, None] + (table * table).sum(-1)[None, :] - 2.0 * (rows @ table.T)
    idx = xp.argmin(d2, axis=-1)
    twin = table[idx]
    scale = xp.maximum(xp.abs(twin).max(-1), 1e-6)
    return idx, xp.abs(rows - twin).max(-1) / scale


@contextlib.contextmanager
def adopting(sites: Sites, tol: float = TOL):
    """Within this block the numpy references (v41, v4, dspark) quantize through the recorded
    decisions (rows with no recorded twin within `tol` keep their own); yields the `Adoption`."""
    from tests.reference import dspark_reference, v4_reference, v41_reference

    found = Adoption()

    def adopt(kind: Kind, x: np.ndarray) -> np.ndarray:
        own = reference_quantize(kind, x)
        if kind not in sites.x:
            found.add(np.prod(x.shape[:-1]), 0, 0, 0, 0.0)
            return own
        rows = np.asarray(x, np.float32).reshape(-1, kind.width).astype(np.float64)
        idx, dist = _nearest(np, rows, sites.x[kind].astype(np.float64))
        matched = dist <= tol
        twin_q = sites.q[kind][idx].astype(np.float64)
        mine = own.reshape(rows.shape)
        differs = (mine != twin_q) & matched[:, None]
        found.add(len(rows), matched.sum(), differs.any(-1).sum(), differs.sum(),
                  dist[matched].max(initial=0.0))
        return np.where(matched[:, None], twin_q, mine).reshape(x.shape)

    def fp8(x, block=32):
        x = np.asarray(x)
        return adopt(Kind("fp8", block, False, x.shape[-1]), x) if x.shape[-1] % block == 0 else x.astype(np.float64)

    def fp4(x, block, *, e4m3_scale):
        x = np.asarray(x)
        return adopt(Kind("fp4", block, e4m3_scale, x.shape[-1]), x) if x.shape[-1] % block == 0 else \
            x.astype(np.float64)

    modules = (v41_reference, v4_reference, dspark_reference)
    saved = [(m, n, getattr(m, n)) for m in modules for n in _ORIGINAL if hasattr(m, n)]
    try:
        for m, n, _ in saved:
            setattr(m, n, fp8 if n == "fake_quant_fp8_ue8m0" else fp4)
        yield found
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


_REPLAYERS: dict = {}


class Replayer:
    """Runs jax programs with each QAT site's rows taking the recorded values of their twin
    within `tol` (rows with none keep their own values); `found` sums up every run's `Adoption`.

    `replayer(key, fn, *args)`: `key` names `fn` and its static setup; the compiled program is
    shared by every replayer whose tables have the same shapes."""

    def __init__(self, sites: Sites, tol: float = TOL):
        self.kinds = tuple(sorted(sites.x, key=repr))
        self.tables = [(sites.x[k], sites.q[k]) for k in self.kinds]
        self.tol = tol
        self.found = Adoption()

    def __call__(self, key, fn, *args):
        full_key = (key, self.kinds, tuple(x.shape for x, _ in self.tables), self.tol)
        if full_key not in _REPLAYERS:
            _REPLAYERS[full_key] = _intercepting(fn, functools.partial(_replay_handler, self.kinds, self.tol))
        out, stats = _REPLAYERS[full_key](self.tables, *args)
        for s in np.concatenate([np.asarray(s) for s in stats]) if stats else ():
            assert s[5] == 0, "adopted values did not survive packing"
            self.found.add(*s[:5])
        return out


def _replay_handler(kinds, tol, extras, tables):
    tables = dict(zip(kinds, tables))

    def on_site(kind, name, eqn, invals):
        x = invals[0]
        outs = _outs(_bind(eqn, invals))
        w = kind.width
        rows = x.reshape(-1, w).astype(jnp.float32)
        f32 = jnp.float32
        if kind not in tables:  # no recorded site of this kind: every row unmatched
            extras.append(jnp.asarray([[rows.shape[0], 0, 0, 0, 0, 0]], f32))
            return outs
        own = _values(kind, name, outs).reshape(-1, w)
        table_x, table_q = tables[kind]
        idx, dist = _nearest(jnp, rows, table_x)
        matched = dist <= tol
        twin = table_q[idx]
        new = jnp.where(matched[:, None], twin, own)
        differs = (own != twin) & matched[:, None]
        if name in _FAKE:
            result = [new.reshape(x.shape).astype(outs[0].dtype)]
            stored = new
        else:  # pack the adopted values (on-grid values pack losslessly)
            result = _outs(_bind(eqn, [new.reshape(x.shape).astype(x.dtype)]))
            stored = _values(kind, name, result).reshape(-1, w)
        extras.append(jnp.stack([f32(rows.shape[0]), matched.sum().astype(f32), differs.any(-1).sum().astype(f32),
                                 differs.sum().astype(f32), jnp.where(matched, dist, 0.0).max(initial=0.0),
                                 jnp.any(stored != new).astype(f32)])[None])  # one row (per shard)
        return result
    return on_site


def _originals():
    from tests.reference import v41_reference as R

    return {"fake_quant_fp8_ue8m0": R.fake_quant_fp8_ue8m0, "fake_quant_fp4": R.fake_quant_fp4}


_ORIGINAL = _originals()
