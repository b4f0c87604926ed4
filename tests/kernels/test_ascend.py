"""The Ascend path: PJRT plugin discovery/registration errors, and the reference-ops forward
exported as StableHLO without GPU-only custom calls."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.pallas_kernels import ascend
from deepinfer.pallas_kernels.ascend import AscendUnavailableError, custom_call_targets, gpu_only_targets
from deepinfer.pallas_kernels.registry import KernelConfig

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


@pytest.fixture
def no_plugin(monkeypatch):
    monkeypatch.delenv(ascend.JAX_PLUGIN_ENV, raising=False)
    monkeypatch.setattr(ascend, "entry_points", lambda group: [])


def test_requesting_ascend_without_a_plugin_says_what_to_install(no_plugin):
    with pytest.raises(AscendUnavailableError, match="no PJRT plugin is configured: install a PJRT plugin for Ascend"):
        ascend.ascend_devices()
    assert ascend.find_plugin() is None


def test_missing_explicit_path(no_plugin, tmp_path):
    missing = tmp_path / "libascend_pjrt.so"
    with pytest.raises(AscendUnavailableError, match="libascend_pjrt.so.*does not exist"):
        ascend.register_ascend_plugin(missing)


def test_path_json_and_entry_point_sources(no_plugin, tmp_path, monkeypatch):
    lib = tmp_path / "libascend_pjrt.so"
    lib.write_bytes(b"\x7fELF")
    cfg = tmp_path / "ascend.json"
    cfg.write_text(json.dumps({"library_path": str(lib), "create_options": {"visible_devices": "0,1"}}))
    calls = []

    def fake_register(name, *, library_path, options):
        calls.append((name, library_path, options))

    src = ascend.register_ascend_plugin(lib, _register=fake_register)
    assert (src.kind, src.location) == ("path", str(lib))
    src = ascend.register_ascend_plugin(cfg, _register=fake_register)
    assert src.kind == "path" and src.options == {"visible_devices": "0,1"}
    assert calls == [("ascend", str(lib), None), ("ascend", str(lib), {"visible_devices": "0,1"})]
    # JAX's own variable: JAX registers it at backend start, we only validate the path
    env = {ascend.JAX_PLUGIN_ENV: f"cuda:/x.so,ascend:{lib}"}
    src = ascend.register_ascend_plugin(environ=env, _register=fake_register)
    assert (src.kind, src.location) == ("jax_env", str(lib)) and len(calls) == 2
    with pytest.raises(AscendUnavailableError, match="nope.so.*PJRT_NAMES_AND_LIBRARY_PATHS setting"):
        ascend.find_plugin(environ={ascend.JAX_PLUGIN_ENV: "ascend:/nope.so"})

    class EP:
        name, value = "ascend_pjrt", "ascend_pjrt.plugin"

    monkeypatch.setattr(ascend, "entry_points", lambda group: [EP()] if group == "jax_plugins" else [])
    assert ascend.find_plugin().kind == "entry_point"


def test_unloadable_library_and_late_registration(no_plugin, tmp_path):
    lib = tmp_path / "libascend_pjrt.so"
    lib.write_bytes(b"not a shared library")

    def failing(name, **kw):
        raise RuntimeError("dlopen failed: invalid ELF header")

    with pytest.raises(AscendUnavailableError, match="could not load.*invalid ELF header"):
        ascend.register_ascend_plugin(lib, _register=failing)
    jnp.zeros(1).block_until_ready()  # backends are running in this process now
    with pytest.raises(AscendUnavailableError, match="PJRT_NAMES_AND_LIBRARY_PATHS=ascend:"):
        ascend.register_ascend_plugin(lib)


def test_reference_forward_exports_without_gpu_custom_calls():
    from deepinfer.model import abstract_params, load_config
    from deepinfer.model.forward import engram_hash_ids, forward_jit

    config = load_config("tiny-v4.1")
    ids = np.arange(100, 116, dtype=np.int32)[None]
    hash_ids = engram_hash_ids(config, ids)
    specs = (abstract_params(config), jax.ShapeDtypeStruct(ids.shape, jnp.int32),
             jax.ShapeDtypeStruct(hash_ids.shape, jnp.int32))
    reference = KernelConfig(backend="reference")
    text = ascend.export_stablehlo(lambda p, i, h: forward_jit(p, config, i, h, reference), *specs,
                                   platforms=("cpu", "cuda"))
    assert "stablehlo.dot_general" in text
    targets = custom_call_targets(text)
    print("custom_call targets of the reference forward:", targets)
    assert gpu_only_targets(targets) == []


def test_the_check_sees_gpu_custom_calls():
    """The detector is not vacuous: a forward-like function with the Triton kernel fails it."""
    from deepinfer.pallas_kernels.lowering import lower_for_cuda
    from deepinfer.pallas_kernels.sparse_attention import sparse_attention_pallas

    q = jnp.zeros((1, 1, 4, 128))
    text = lower_for_cuda(lambda q, kv: sparse_attention_pallas(
        q, kv, jnp.ones((1, 1, 16), bool), jnp.zeros((1, 0, 128)), jnp.zeros((1, 1, 0), jnp.int32),
        jnp.zeros(4), 0.1), q, jnp.zeros((1, 16, 128)))
    assert gpu_only_targets(custom_call_targets(text)) == ["__gpu$xla.gpu.triton"]
    assert gpu_only_targets(["mosaic_gpu_v2", "tpu_custom_call", "cublas_gemm", "lapack_sgetrf_ffi"]) == [
        "mosaic_gpu_v2", "tpu_custom_call", "cublas_gemm"]


def test_real_jax_registration_reports_the_loader_error(tmp_path):
    """Through jax's own `register_plugin`, in a fresh interpreter (backends not started yet)."""
    import subprocess
    import sys

    lib = tmp_path / "libascend_pjrt.so"
    lib.write_text("not a shared library")
    code = ("from deepinfer.pallas_kernels import ascend\n"
            "try:\n"
            f"    ascend.register_ascend_plugin({str(lib)!r})\n"
            "except ascend.AscendUnavailableError as e:\n"
            "    print('ERROR:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert "ERROR: could not load the Ascend PJRT plugin" in out.stdout, out.stdout + out.stderr
    assert "libascend_pjrt.so" in out.stdout
