"""Tests of deepinfer.sharding on the 8 virtual CPU devices of tests/conftest.py: the sharded
forward pass equals the single-device one, experts and the vocabulary really are split, and
impossible meshes and rules fail with a message naming the culprit.

Every sharded result is pulled to the host (np.asarray) before the next program is launched: the
CPU backend's collectives can deadlock when many sharded programs are queued.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from deepinfer.model import QuantWeight, forward, init_params, load_checkpoint, load_config, write_checkpoint
from deepinfer.model.forward import engram_hash_ids, forward_jit
from deepinfer.model.params import FP4, FP8, FP8_ROWS, param_specs, tree_get
from deepinfer.sharding import AXES, logical_to_spec, make_mesh, mesh_placement, param_sharding, params_shardings, parse_mesh_spec
from tests import qat_sites
from tests.choice_margins import near_tie_finder

CFG = load_config("tiny-v4.1-short", dtype="float32", fake_quant=False)
CFG_FQ = dataclasses.replace(CFG, fake_quant=True)
D, F, E, V = CFG.hidden_size, CFG.moe_intermediate_size, CFG.n_routed_experts, CFG.vocab_size
# longer than the window (128), the candidate pool (64 positions) and both top-k budgets
TOKENS = np.random.default_rng(11).integers(3, V, (2, 144)).astype(np.int32)
MESHES = ["dp=2,cp=2,tp=2", "dp=8"]
NEAR_TIE = 1e-5  # a choice decided by less than this (relative) may go either way between two programs


def one_device_mesh():
    return make_mesh("dp=1", devices=jax.devices()[:1])


def place(params, mesh):
    out = jax.device_put(params, params_shardings(CFG, mesh))
    return jax.block_until_ready(out)


def logits(params, config):
    return np.asarray(forward(params, config, TOKENS))  # blocks before the next launch


def assert_close(out, ref, tol, upto=None):
    """|out - ref| <= tol on the scale of the logits (max |ref|, at least 1); with `upto` (per
    row of TOKENS), only at the positions before each row's first near-tie.

    Sharding the experts changes the order of the fp32 sum over experts, so exact equality is not
    expected; the measured error is a few 1e-6 in most rows and about 2e-5 in the worst row of
    logits of magnitude about 5."""
    assert out.shape == ref.shape
    scale = max(1.0, float(np.abs(ref).max()))
    if upto is not None:
        keep = np.arange(out.shape[1])[None, :] < np.asarray(upto)[:, None]
        out, ref = out[keep], ref[keep]
    err = float(np.abs(out - ref).max())
    assert err <= tol * scale, f"max |diff| {err:.3g} > {tol:g} x {scale:.3g}"


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=5)


@pytest.fixture(scope="module")
def near_ties(params):
    """Each row of TOKENS' first position with a choice (indexer top-k, candidate blocks, routers)
    decided by less than NEAR_TIE, from the float64 reference (tests/choice_margins.py): a
    sharded program may choose otherwise there by rounding alone and move every later logit."""
    find = near_tie_finder(CFG, params, NEAR_TIE)
    return [find(row) for row in TOKENS]


@pytest.fixture(scope="module")
def single(params):
    """Single-device logits per fake_quant setting, computed once."""
    placed = place(params, one_device_mesh())
    cache = {}

    def get(config):
        if config.fake_quant not in cache:
            cache[config.fake_quant] = logits(placed, config)
        return cache[config.fake_quant]

    return get


@pytest.fixture(scope="module")
def placed(params):
    return {m: place(params, make_mesh(m)) for m in MESHES}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, params):
    d = tmp_path_factory.mktemp("sharding_ckpt")
    write_checkpoint(params, CFG, d)
    return str(d)


# ---- sharded forward == single-device forward -------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_forward_matches_single_device(placed, single, near_ties, mesh):
    ref = single(CFG)
    out = logits(placed[mesh], CFG)
    assert out.shape == (*TOKENS.shape, V) and np.all(np.isfinite(out))
    assert_close(out, ref, 1e-5, upto=near_ties)


@pytest.fixture(scope="module")
def single_fq_sites(params):
    """Single-device logits with fake-quant on and its recorded QAT sites (tests/qat_sites.py)."""
    logits, sites = qat_sites.record_forward(place(params, one_device_mesh()), CFG_FQ, TOKENS)
    return logits, sites


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_forward_matches_single_device_fake_quant(placed, single, single_fq_sites, mesh):
    """Sharding reorders fp32 sums, so a value within ulps of an FP8/FP4 rounding boundary can
    land on the other grid point and move every later logit. The sharded run adopts the
    single-device run's quantization decisions wherever its site input is within 1e-3 of the
    recorded one (few rows may quantize differently on their own: rounding flips), and then
    equals it as tightly as with fake-quant off."""
    ref, sites = single_fq_sites
    assert not np.allclose(ref, single(CFG), atol=1e-3)  # fake-quant really changes the numerics
    replayer = qat_sites.Replayer(sites)
    out = replayer(("forward", mesh), lambda p, i, h: forward_jit(p, CFG_FQ, i, h), placed[mesh],
                   jnp.asarray(TOKENS), jnp.asarray(engram_hash_ids(CFG_FQ, TOKENS), jnp.int32))
    replayer.found.check()
    assert_close(np.asarray(out), ref, 1e-5)


def test_loaded_dequantized_checkpoint_on_mesh(ckpt, single):
    """`load_checkpoint(dir, placement=mesh_placement(mesh))` places each leaf like `params_shardings` and gives the same
    logits as the single-device load of the same checkpoint."""
    mesh = make_mesh("dp=2,cp=2,tp=2")
    _, on_mesh = load_checkpoint(ckpt, placement=mesh_placement(mesh), dequantize=True, dtype="float32", fake_quant=False)
    _, on_one = load_checkpoint(ckpt, dequantize=True, dtype="float32", fake_quant=False)
    want = params_shardings(CFG, mesh)
    for spec in param_specs(CFG):
        leaf = tree_get(on_mesh, spec.path)
        assert leaf.sharding.is_equivalent_to(tree_get(want, spec.path), leaf.ndim), spec.name
    ref = logits(on_one, CFG)
    assert_close(logits(on_mesh, CFG), ref, 1e-5)
    # quantization changed the weights, so this is not the init-params run
    assert not np.allclose(ref, single(CFG), atol=1e-3)


@pytest.mark.slow
def test_loaded_quantized_checkpoint_on_mesh(ckpt):
    mesh = make_mesh("dp=2,cp=2,tp=2")
    _, q_mesh = load_checkpoint(ckpt, placement=mesh_placement(mesh), dtype="float32", fake_quant=False)
    _, dq_one = load_checkpoint(ckpt, dequantize=True, dtype="float32", fake_quant=False)
    w1 = q_mesh["layers"][3]["ffn"]["experts"]["w1"]
    assert isinstance(w1, QuantWeight)
    assert w1.q.sharding.spec == P(("dp", "cp", "tp"), None, None)
    assert {s.data.shape for s in w1.q.addressable_shards} == {(1, F, D // 2)}
    assert {s.data.shape for s in w1.scale.addressable_shards} == {(1, F, D // 32)}
    assert_close(logits(q_mesh, CFG), logits(dq_one, CFG), 1e-5)


# ---- where the leaves live -----------------------------------------------------------------------


@pytest.mark.parametrize("mesh,want", [("dp=2,cp=2,tp=2", ("dp", "cp", "tp")), ("dp=8", "dp"),
                                       ("dp=2,tp=4", ("dp", "tp")), ("cp=8", "cp")])
@pytest.mark.parametrize("proj", ["w1", "w2", "w3"])
def test_expert_leaf_spec(mesh, want, proj):
    sharding = params_shardings(CFG, make_mesh(mesh))["layers"][0]["ffn"]["experts"][proj]
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == P(want, None, None)


@pytest.mark.parametrize("mesh", MESHES)
def test_experts_are_split_over_all_devices(placed, mesh):
    for layer in (0, CFG.decoder_start, CFG.num_hidden_layers - 1):
        for proj, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
            leaf = placed[mesh]["layers"][layer]["ffn"]["experts"][proj]
            assert leaf.shape == (E, *shape)
            assert len(leaf.sharding.device_set) == 8
            shards = leaf.addressable_shards
            assert len(shards) == 8
            assert {s.data.shape for s in shards} == {(E // 8, *shape)}
            starts = sorted(s.index[0].start for s in shards)
            assert starts == list(range(0, E, E // 8))  # every device holds different experts
            assert len({s.device for s in shards}) == 8


def test_vocab_shards_over_tp(placed):
    mesh = "dp=2,cp=2,tp=2"
    for name in ("embed", "head"):
        leaf = placed[mesh][name]
        assert leaf.sharding.spec == P("tp", None)
        assert {s.data.shape for s in leaf.addressable_shards} == {(V // 2, D)}
        assert {(s.index[0].start, s.index[0].stop) for s in leaf.addressable_shards} == {(0, V // 2), (V // 2, V)}
    # wider tensor parallelism splits the vocab further
    assert params_shardings(CFG, make_mesh("dp=2,tp=4"))["embed"].spec == P("tp", None)
    # without a tp axis the vocab stays whole
    assert placed["dp=8"]["head"].sharding.spec in (P(None, None), P())
    assert {s.data.shape for s in placed["dp=8"]["head"].addressable_shards} == {(V, D)}


def test_other_leaves_are_replicated(placed):
    leaves = placed["dp=2,cp=2,tp=2"]
    for spec in param_specs(CFG):
        if not {"experts", "vocab"} & set(spec.axes):
            leaf = tree_get(leaves, spec.path)
            assert leaf.sharding.is_fully_replicated, spec.name


@pytest.mark.parametrize("storage", [FP4, FP8, FP8_ROWS])
def test_quantized_leaf_shardings(storage):
    mesh = make_mesh("dp=2,cp=2,tp=2")
    spec = next(s for s in param_specs(CFG) if s.storage == storage)
    sh = param_sharding(spec, mesh, CFG, quantized=True)
    assert isinstance(sh, QuantWeight) and sh.kind == storage
    if storage == FP4:  # stacked experts: q and scale split along the expert axis like the dense leaf
        assert sh.q.spec == P(("dp", "cp", "tp"), None, None) == sh.scale.spec
    else:
        assert sh.q.is_fully_replicated and sh.scale.is_fully_replicated


# ---- invalid meshes and rules ---------------------------------------------------------------------


def test_mesh_shapes():
    mesh = make_mesh("dp=2,cp=2,tp=2")
    assert mesh.axis_names == AXES and dict(mesh.shape) == {"dp": 2, "cp": 2, "tp": 2}
    assert dict(make_mesh("dp=8").shape) == {"dp": 8, "cp": 1, "tp": 1}
    assert dict(make_mesh().shape) == {"dp": 8, "cp": 1, "tp": 1}
    assert parse_mesh_spec({"tp": 4, "dp": 2}, 8) == {"dp": 2, "cp": 1, "tp": 4}
    # a missing dp takes the devices the other axes leave
    assert parse_mesh_spec("cp=2", 8) == {"dp": 4, "cp": 2, "tp": 1}
    assert parse_mesh_spec("cp=2,tp=2", 8) == {"dp": 2, "cp": 2, "tp": 2}


@pytest.mark.parametrize("spec,named", [("dp=3", "dp=3"), ("dp=2,tp=2", "tp=2"), ("dp=16", "dp=16"),
                                        ("cp=3", "cp=3")])
def test_impossible_mesh(spec, named):
    with pytest.raises(ValueError) as e:
        make_mesh(spec)
    assert named in str(e.value) and "8" in str(e.value)


@pytest.mark.parametrize("spec", ["ep=2", "dp=2,ep=4", {"ep": 8}])
def test_unknown_axis(spec):
    with pytest.raises(ValueError, match="ep"):
        make_mesh(spec)


@pytest.mark.parametrize("spec", ["dp=x", "dp=0", "dp=-8"])
def test_bad_axis_size(spec):
    with pytest.raises(ValueError, match="dp"):
        make_mesh(spec)


def test_logical_to_spec_rejects_mesh_axis_used_twice():
    mesh = make_mesh("dp=2,cp=2,tp=2")
    with pytest.raises(ValueError, match="tp"):
        logical_to_spec(("experts", "vocab"), (E, V), mesh)  # experts take dp,cp,tp; vocab wants tp again
    with pytest.raises(ValueError, match="dp"):
        logical_to_spec(("a", "b"), (8, 8), mesh, rules={"a": ("dp",), "b": ("cp", "dp")})


def test_logical_to_spec_basics():
    mesh = make_mesh("dp=2,cp=2,tp=2")
    assert logical_to_spec(("vocab", "embed"), (V, D), mesh) == P("tp", None)
    assert logical_to_spec(("experts", "ffw", "embed"), (E, F, D), mesh) == P(("dp", "cp", "tp"), None, None)
    # a dim the axes do not divide stays replicated
    assert logical_to_spec(("experts",), (6,), mesh) == P(None)
    assert logical_to_spec(("vocab", "embed"), (V + 1, D), mesh) == P(None, None)
    # size-1 mesh axes are dropped, so no collision on a dp-only mesh
    assert logical_to_spec(("experts", "vocab"), (E, V), make_mesh("dp=8")) == P("dp", None)
