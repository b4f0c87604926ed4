"""Kernel selection: platform defaults, explicit requests, clear errors, `describe` and the CLI."""

from __future__ import annotations

import argparse
import json

import jax
import pytest

from deepinfer.pallas_kernels import registry
from deepinfer.pallas_kernels.cli import add_kernels_parser
from deepinfer.pallas_kernels.registry import (
    GPU_TRITON, INTERPRET, REFERENCE, KernelConfig, KernelUnavailableError, PlatformInfo, describe, get_kernel,
    platform_info, resolve,
)
from deepinfer.pallas_kernels.reference.moe import moe_experts
from deepinfer.pallas_kernels.reference.sparse_attention import sparse_attention

H200 = PlatformInfo("gpu", "cuda", "NVIDIA H200", 90)
T4 = PlatformInfo("gpu", "cuda", "Tesla T4", 75)
ROCM = PlatformInfo("gpu", "rocm", "gfx942", None)


def test_platform_is_read_once_and_is_cpu_here():
    assert platform_info() is platform_info()
    assert platform_info().platform == "cpu"


def test_model_default_is_the_reference_on_cpu():
    assert get_kernel("sparse_attention", None) is sparse_attention
    assert get_kernel("moe_experts") is moe_experts
    assert {impl for _, impl, _ in describe()} == {REFERENCE}


def test_ops_and_backends_registered():
    assert {"sparse_attention", "moe_experts", "mhc_mixes"} <= set(registry.ops())
    assert set(registry.available("sparse_attention")) == {REFERENCE, GPU_TRITON, INTERPRET}
    assert set(registry.available("mhc_mixes")) == {REFERENCE, GPU_TRITON, INTERPRET}


def test_auto_on_a_cuda_gpu_prefers_kernels_where_they_exist():
    rows = {op: (impl, why) for op, impl, why in describe(info=H200)}
    assert rows["sparse_attention"][0] == GPU_TRITON
    assert rows["mhc_mixes"][0] == GPU_TRITON
    assert rows["moe_experts"][0] == REFERENCE
    assert "no GPU kernel for this op yet" in rows["moe_experts"][1]
    assert "NVIDIA H200" in rows["sparse_attention"][1]


@pytest.mark.parametrize("info,needle", [(T4, "sm_80+"), (ROCM, "CUDA GPU"), (PlatformInfo("ascend"), "CUDA GPU")])
def test_auto_elsewhere_uses_the_reference_and_says_why(info, needle):
    impl, why = resolve("sparse_attention", None, info)
    assert impl.backend == REFERENCE and needle in why


def test_explicit_gpu_backend_on_cpu_is_a_clear_error():
    with pytest.raises(KernelUnavailableError) as e:
        get_kernel("sparse_attention", KernelConfig(backend=GPU_TRITON))
    msg = str(e.value)
    assert "'sparse_attention'" in msg and "'gpu_triton'" in msg and "CUDA GPU" in msg and "cpu" in msg
    # also for an op that has no such kernel: the backend itself cannot run here
    with pytest.raises(KernelUnavailableError, match="'moe_experts'.*'gpu_triton'"):
        get_kernel("moe_experts", KernelConfig(backend=GPU_TRITON))
    with pytest.raises(KernelUnavailableError, match="sm_80"):
        resolve("sparse_attention", KernelConfig(backend=GPU_TRITON), T4)


def test_explicit_backend_covers_the_ops_that_have_it():
    config = KernelConfig(backend=INTERPRET)
    assert get_kernel("sparse_attention", config) is registry.available("sparse_attention")[INTERPRET]
    impl, why = resolve("moe_experts", config)
    assert impl.backend == REFERENCE and "no interpret implementation" in why
    impl, _ = resolve("sparse_attention", KernelConfig(backend=GPU_TRITON), H200)
    assert impl.backend == GPU_TRITON


def test_pinned_ops():
    config = KernelConfig(ops=(("mhc_mixes", INTERPRET),))
    assert resolve("mhc_mixes", config)[0].backend == INTERPRET
    assert resolve("sparse_attention", config)[0].backend == REFERENCE
    with pytest.raises(KernelUnavailableError, match="'moe_experts' has no 'interpret' implementation"):
        get_kernel("moe_experts", KernelConfig(ops=(("moe_experts", INTERPRET),)))
    with pytest.raises(KernelUnavailableError, match="unknown kernel ops"):
        get_kernel("moe_experts", KernelConfig(ops=(("no_such_op", INTERPRET),)))


def test_bad_names():
    with pytest.raises(KernelUnavailableError, match="unknown kernel backend 'cuda'"):
        KernelConfig(backend="cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        registry.register("x", "tpu")
    with pytest.raises(KeyError, match="unknown kernel op"):
        get_kernel("no_such_op")


def test_config_is_a_jit_static_argument():
    config = KernelConfig(backend=INTERPRET, ops=(("mhc_mixes", REFERENCE),))
    assert hash(config) == hash(KernelConfig(backend=INTERPRET, ops=(("mhc_mixes", REFERENCE),)))
    f = jax.jit(lambda x, kernels: x + 1, static_argnames="kernels")
    assert int(f(1, kernels=config)) == 2


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_kernels_parser(parser.add_subparsers())
    args = parser.parse_args(["kernels", *argv])
    return args.func(args)


def test_cli_one_line_per_op(capsys):
    assert _cli([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == registry.ops()
    assert all(line.split()[1] == REFERENCE and "auto on cpu" in line for line in lines)
    assert _cli(["--op", "sparse_attention=interpret", "--json"]) == 0
    rows = {r["op"]: r["implementation"] for r in json.loads(capsys.readouterr().out)["ops"]}
    assert rows["sparse_attention"] == INTERPRET and rows["moe_experts"] == REFERENCE


def test_cli_impossible_request(capsys):
    assert _cli(["--backend", "gpu_triton"]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "gpu_triton" in err and "CUDA GPU" in err
