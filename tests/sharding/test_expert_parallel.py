"""Expert parallelism and EPLB layouts for the MoE on the 8 virtual CPU devices.

The EP MoE (`moe(..., ep=ExpertParallel(...))` inside `jax.shard_map`) must equal the single-device
`moe` for every method, mesh layout and weight format, padding rows included; an EPLB layout
(physical expert slots + routing remap) must not change the result, must balance the per-device
load of a skewed routing, and installing a new layout must not recompile.

Every sharded result is pulled to the host (np.asarray) before the next program is launched: the
CPU backend's collectives can deadlock when many sharded programs are queued.
"""

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from deepinfer.model import QuantWeight, init_params, load_config
from deepinfer.model.moe import moe, route
from deepinfer.model.params import FP4
from deepinfer.ops.quant import quantize_mxfp4
from deepinfer.sharding import ExpertParallel, ep_size, ffn_partition_specs, make_mesh, to_physical, with_placement
from deepinfer.sharding.eplb import rebalance
from deepinfer.sharding.expert_parallel import ep_experts
from deepinfer.sharding.expert_placement import placement_arrays

CFG = load_config("tiny-v4.1", dtype="float32", fake_quant=False)
CFG_HASH = load_config("tiny-v4", dtype="float32", fake_quant=False)  # layer 0 is hash-routed
E, K, D = CFG.n_routed_experts, CFG.num_experts_per_tok, CFG.hidden_size
EP_AXES = ("dp", "cp", "tp")
LAYER = 2

# name -> (mesh, spec of the token rows, replicated_axes, global rows N); every N leaves some
# shard with a row count its replica group does not divide, so the share padding is exercised
LAYOUTS = {
    "dp=8": ("dp=8", P("dp"), (), 40),
    "dp=2,cp=2,tp=2": ("dp=2,cp=2,tp=2", P("dp"), ("cp", "tp"), 26),
    "all-replicated": ("dp=2,cp=2,tp=2", P(), EP_AXES, 13),
}


def assert_close(out, ref, rtol=1e-5):
    """|out - ref| <= rtol x max|ref|: EP only reorders the fp32 sum over a token's experts.
    Prints the figures (pytest -s)."""
    err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
    print(f" max |diff| {err:.2e} (max |ref| {scale:.2f})", end="")
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol:g} x {scale:.3g}"


def quantized(ffn: dict) -> dict:
    """The routed experts as checkpoint-format FP4 (packed e2m1 + UE8M0 per 1x32)."""
    def fp4(w):
        q, s = quantize_mxfp4(np.asarray(w, np.float32))
        return QuantWeight(jnp.asarray(q), jnp.asarray(s), kind=FP4, block=(1, 32))
    return {**ffn, "experts": {n: fp4(w) for n, w in ffn["experts"].items()}}


def tokens(n: int, seed: int, n_dead: int = 3):
    """x `[n, D]` whose last `n_dead` rows are zero padding, with live flags."""
    x = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    live = np.arange(n) < n - n_dead
    x[~live] = 0.0
    return jnp.asarray(x), jnp.asarray(live)


@cache
def _jit(fn, config):
    return jax.jit(partial(fn, config=config))


def _moe(ffn, x, token_ids=None, *, config):
    return moe(ffn, config, x, token_ids=token_ids)


def _ids(ffn, x, token_ids=None, *, config):
    return route(ffn["gate"], x, config.num_experts_per_tok, config, token_ids)[1]


def single(ffn, x, config=CFG, token_ids=None):
    """The single-device MoE (jitted: eager dequantization is slow)."""
    return np.asarray(_jit(_moe, config)(ffn, x, token_ids))


def routed_only(ffn, x):
    """The single-device MoE without its shared expert."""
    return single({k: v for k, v in ffn.items() if k != "shared_experts"}, x)


def logical_counts(ffn, x, live, config=CFG, token_ids=None):
    """numpy bincount of the (token, choice) pairs of live rows per logical expert."""
    ids = _jit(_ids, config)(ffn, x, token_ids)
    return np.bincount(np.asarray(ids)[np.asarray(live)].reshape(-1), minlength=config.n_routed_experts)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=7)


@pytest.fixture(scope="module")
def ffns(params):
    dense = params["layers"][LAYER]["ffn"]
    return {"dense": dense, "fp4": quantized(dense)}


@cache
def ep_program(layout: str, method: str, config=CFG, hashed: bool = False):
    """jit(shard_map(moe with EP)) -> (y, counts summed over the token-splitting axes)."""
    mesh_spec, rows, replicated, _ = LAYOUTS[layout]
    mesh = make_mesh(mesh_spec)
    ep = ExpertParallel(EP_AXES, method, replicated)
    split = tuple(a for a in rows if a)

    def body(ffn, x, live, token_ids):
        y, counts = moe(ffn, config, x, token_ids=token_ids if hashed else None, ep=ep, live=live,
                        return_counts=True)
        return y, jax.lax.psum(counts, split) if split else counts

    def run(ffn, x, live, token_ids=None):
        token_ids = jnp.zeros(x.shape[0], jnp.int32) if token_ids is None else token_ids
        f = jax.shard_map(body, mesh=mesh, in_specs=(ffn_partition_specs(ffn, mesh, EP_AXES), rows, rows, rows),
                          out_specs=(rows, P()))
        y, counts = jax.jit(f)(ffn, x, live, token_ids)
        return np.asarray(y), np.asarray(counts)  # block before the next launch

    return run


# ---- EP == single device -----------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["dense", "fp4"])
@pytest.mark.parametrize("method", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_moe_matches_single_device(ffns, layout, method, weights):
    ffn = ffns[weights]
    x, live = tokens(LAYOUTS[layout][3], seed=1)
    ref = single(ffn, x)
    y, counts = ep_program(layout, method)(ffn, x, live)
    assert_close(y, ref)
    np.testing.assert_array_equal(counts, logical_counts(ffn, x, live))
    # every live row gets a routed contribution well above the tolerance
    assert np.abs(routed_only(ffn, x))[np.asarray(live)].max(axis=1).min() > 1e-2


def test_hash_routed_layer():
    assert CFG_HASH.is_hash_layer(0)
    ffn = init_params(CFG_HASH, seed=2)["layers"][0]["ffn"]
    x, live = tokens(26, seed=4)
    tids = jnp.asarray(np.random.default_rng(5).integers(0, CFG_HASH.vocab_size, 26), jnp.int32)
    ref = single(ffn, x, CFG_HASH, tids)
    y, counts = ep_program("dp=2,cp=2,tp=2", "all_to_all", CFG_HASH, hashed=True)(ffn, x, live, tids)
    assert_close(y, ref)
    np.testing.assert_array_equal(counts, logical_counts(ffn, x, live, CFG_HASH, tids))


def test_ep_size_and_specs(ffns):
    assert ep_size(make_mesh("dp=2,cp=2,tp=2"), EP_AXES) == 8 and ep_size(make_mesh("dp=8"), ("cp", "tp")) == 1
    specs = ffn_partition_specs(ffns["fp4"], make_mesh("dp=2,cp=2,tp=2"), EP_AXES)
    assert specs["experts"]["w1"].q == P(EP_AXES) == specs["experts"]["w1"].scale
    assert ffn_partition_specs(ffns["dense"], make_mesh("dp=8"), EP_AXES)["experts"]["w2"] == P("dp")
    assert specs["gate"]["weight"] == P() and specs["shared_experts"]["w2"] == P()


def test_bad_method():
    with pytest.raises(ValueError, match="method"):
        ExpertParallel(EP_AXES, "alltoall")


# ---- ragged_all_to_all --------------------------------------------------------------------------


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` from dense all_to_all: chunk j (padded to the operand's length)
    goes to peer j with its target offset; the receiver writes its first `recv_sizes[s]` rows from
    sender s there. Wrong sizes or offsets on either side corrupt or drop rows."""
    ep, rows = jax.lax.axis_size(axis_name), operand.shape[0]
    r = jnp.arange(rows)
    chunks = jnp.take(operand, jnp.minimum(input_offsets[:, None] + r, rows - 1), axis=0)
    chunks = jnp.where((r < send_sizes[:, None]).reshape(ep, rows, *[1] * (operand.ndim - 1)), chunks, 0)
    a2a = partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
    got = a2a(chunks.reshape(ep * rows, *operand.shape[1:]))
    offsets = a2a(output_offsets)
    dst = jnp.where(r < recv_sizes[:, None], offsets[:, None] + r, output.shape[0])
    return output.at[dst.reshape(-1)].set(got, mode="drop")


def ragged_program(ffn, ragged, mesh_spec="dp=2,cp=2,tp=2", rows=P("dp"), replicated=("cp", "tp")):
    def body(ffn, x):
        weights, ids = route(ffn["gate"], x, K, CFG)
        return ep_experts(x, weights, ids, ffn["experts"], CFG.swiglu_limit, axes=EP_AXES,
                          method="ragged_all_to_all", replicated_axes=replicated, ragged_all_to_all=ragged)

    mesh = make_mesh(mesh_spec)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ffn_partition_specs(ffn, mesh, EP_AXES), rows),
                                 out_specs=rows))


@pytest.mark.parametrize("layout", ["dp=8", "dp=2,cp=2,tp=2"])
def test_ragged_bookkeeping_with_emulated_collective(ffns, layout):
    """The exact-size path's offsets and sizes, run through an emulation of the collective."""
    mesh_spec, rows, replicated, n = LAYOUTS[layout]
    ffn = ffns["fp4"]
    x, _ = tokens(n, seed=3)
    ref = routed_only(ffn, x)
    y = np.asarray(ragged_program(ffn, emulated_ragged_all_to_all, mesh_spec, rows, replicated)(ffn, x))
    assert_close(y, ref, rtol=1e-5)


def test_ragged_lowers_on_cpu(ffns):
    """XLA:CPU cannot compile ragged-all-to-all, but the program lowers (and would run on GPU)."""
    x, _ = tokens(26, seed=3)
    text = ragged_program(ffns["dense"], jax.lax.ragged_all_to_all).lower(ffns["dense"], x).as_text()
    assert text.count("ragged_all_to_all") >= 4  # rows, ids, weights forward; results back


def test_ragged_refused_on_cpu(ffns):
    assert jax.default_backend() == "cpu"
    ep = ExpertParallel(EP_AXES, "ragged_all_to_all")
    x, _ = tokens(8, seed=3)
    mesh = make_mesh("dp=8")
    f = jax.shard_map(lambda p, x: moe(p, CFG, x, ep=ep), mesh=mesh,
                      in_specs=(ffn_partition_specs(ffns["dense"], mesh, EP_AXES), P("dp")), out_specs=P("dp"))
    with pytest.raises(ValueError, match="'ragged_all_to_all'.*CPU.*method='all_to_all'"):
        jax.jit(f).lower(ffns["dense"], x)


# ---- EPLB layouts -------------------------------------------------------------------------------


def zipf_layout(exponent: float, seed: int, num_slots: int = 16, devices: int = 8):
    """(phy2log, log2phy, count) of one layer from `rebalance` on a Zipf-like load over a shuffled
    expert order."""
    load = 1000.0 / (np.arange(1, E + 1) ** exponent)
    load = load[np.random.default_rng(seed).permutation(E)]
    phy2log, log2phy, count = rebalance(load[None], num_slots, 1, 1, devices)
    return phy2log[0], log2phy[0], count[0]


@pytest.fixture(scope="module")
def layout():
    phy2log, log2phy, count = zipf_layout(0.5, seed=0)
    assert phy2log.shape == (16,) and count.max() == 3 and count.min() == 1  # a skewed placement
    return phy2log, log2phy, count


@pytest.mark.parametrize("weights", ["dense", "fp4"])
def test_placement_single_device(ffns, layout, weights):
    ffn = ffns[weights]
    placed = with_placement(ffn, *layout, max_replicas=4)
    assert placed["placement"]["log2phy"].shape == (E, 4) and placed["placement"]["log2phy"].dtype == jnp.int32
    lead = placed["experts"]["w1"].q if weights == "fp4" else placed["experts"]["w1"]
    assert lead.shape[0] == 16
    x, live = tokens(40, seed=6)
    ref = single(ffn, x)
    y, counts = jax.jit(lambda p, x, live: moe(p, CFG, x, live=live, return_counts=True))(placed, x, live)
    assert_close(np.asarray(y), ref)
    np.testing.assert_array_equal(np.asarray(counts), logical_counts(ffn, x, live))


@pytest.mark.parametrize("method", ["all_to_all", "all_gather"])
def test_placement_with_ep(ffns, layout, method):
    """16 physical slots, 2 per device: EP + EPLB equals the plain single-device MoE."""
    ffn = ffns["fp4"]
    placed = with_placement(ffn, *layout, max_replicas=4)
    x, live = tokens(26, seed=8)
    ref = single(ffn, x)
    y, counts = ep_program("dp=2,cp=2,tp=2", method)(placed, x, live)
    assert_close(y, ref)
    np.testing.assert_array_equal(counts, logical_counts(ffn, x, live))


def test_new_layout_does_not_recompile(ffns, layout):
    ffn = ffns["dense"]
    other = zipf_layout(1.0, seed=1)
    assert not np.array_equal(other[0], layout[0])
    x, _ = tokens(24, seed=9)
    ref = single(ffn, x)
    f = jax.jit(lambda p, x: moe(p, CFG, x))
    for lay in (layout, other):
        assert_close(np.asarray(f(with_placement(ffn, *lay, max_replicas=6), x)), ref)
    assert f._cache_size() == 1


def test_to_physical_spreads_replicas(layout):
    phy2log, log2phy, count = layout
    table = placement_arrays(phy2log, log2phy, count, max_replicas=4)
    hot, warm = int(np.argmax(count)), int(np.flatnonzero(count == 2)[0])  # 3 and 2 replicas
    ids = jnp.asarray(np.tile([hot, warm], (30, 1)), jnp.int32)
    phys = np.asarray(to_physical(ids, table["log2phy"], table["count"], jnp.arange(30)))
    for j, e in enumerate((hot, warm)):
        assert (phy2log[phys[:, j]] == e).all()  # always a slot holding the expert
        used = np.bincount(phys[:, j], minlength=16)[log2phy[e, :count[e]]]
        assert used.min() == used.max() == 30 // count[e]  # every replica equally used


def test_bad_placement(layout):
    phy2log, log2phy, count = layout
    ffn = {"experts": {"w1": jnp.zeros((E, 2, 2))}}
    with pytest.raises(ValueError, match="max_replicas"):
        with_placement(ffn, phy2log, log2phy, count, max_replicas=2)
    wrong = log2phy.copy()
    wrong[0, 0], wrong[1, 0] = log2phy[1, 0], log2phy[0, 0]
    with pytest.raises(ValueError, match="slots"):
        with_placement(ffn, phy2log, wrong, count, max_replicas=4)


def test_eplb_balances_device_load():
    """Per-device (token, choice) pairs of a skewed synthetic routing, measured from the physical
    ids the remap produced: logical layout (1 expert per device) vs the EPLB layout (16 slots)."""
    rng = np.random.default_rng(0)
    probs = 1.0 / np.arange(1, E + 1) ** 1.0
    probs = probs[rng.permutation(E)]

    def sample(n):  # k distinct experts per token, Zipf-like popularity (Gumbel top-k)
        keys = np.log(probs) + rng.gumbel(size=(n, E))
        return np.argsort(-keys, axis=1)[:, :K].astype(np.int32)

    history = sample(4096)  # what the planner saw
    phy2log, log2phy, count = rebalance(np.bincount(history.reshape(-1), minlength=E)[None], 16, 1, 1, 8)
    ids = sample(4096)  # fresh traffic
    before = np.bincount(ids.reshape(-1), minlength=E)  # device d holds expert d
    phys = np.asarray(to_physical(jnp.asarray(ids), jnp.asarray(log2phy[0], jnp.int32),
                                  jnp.asarray(count[0], jnp.int32), jnp.arange(ids.shape[0])))
    assert (phy2log[0][phys] == ids).all()
    after = np.bincount(phys.reshape(-1) // 2, minlength=8)  # 2 slots per device
    ratio_before, ratio_after = before.max() / before.mean(), after.max() / after.mean()
    print(f"\nEPLB device load (max/mean pairs per device): before {ratio_before:.3f} "
          f"({before.tolist()}), after {ratio_after:.3f} ({after.tolist()})")
    assert after.sum() == before.sum() == ids.size
    assert ratio_after < ratio_before and ratio_after < 1.1
