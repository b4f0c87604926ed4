"""Choosing the accelerator (`--accelerator`, `DEEPINFER_ACCELERATOR`, `LLM(accelerator=...)`):
`cpu` runs a tiny generate end to end with the params, cache and kernels on the CPU backend;
`cuda` and `ascend`, absent here (the test session runs JAX on CPU only, without an Ascend
plugin), fail with one clear line saying what to install, from the CLI (exit code 2) and from
LLM() (ValueError) before any work is done."""

from __future__ import annotations

import json

import jax
import pytest

from deepinfer.pallas_kernels.accelerator import (
    AcceleratorUnavailableError, Accelerator, normalize, select_accelerator,
)
from deepinfer.pallas_kernels.registry import KernelConfig, resolve
from deepinfer.serve.cli import EnvDefaults, main

SMALL = dict(max_num_seqs=2, max_model_len=256, page_size=64, prefill_chunk=128, prefill_mode="full")
SMALL_ARGS = ["--max-num-seqs", "2", "--max-model-len", "256", "--page-size", "64", "--prefill-chunk", "128",
              "--prefill-mode", "full"]
CUDA_NEEDLES = ["accelerator 'cuda'", "no CUDA backend", "deepinfer-jax[gpu]"]
ASCEND_NEEDLES = ["accelerator 'ascend'", "no PJRT plugin is configured", "PJRT_NAMES_AND_LIBRARY_PATHS"]


@pytest.fixture(autouse=True)
def no_plugin_config(monkeypatch, tmp_path):
    """No Ascend plugin from the environment, no DEEPINFER_* defaults, an empty home."""
    for name in ("PJRT_NAMES_AND_LIBRARY_PATHS", "DEEPINFER_ACCELERATOR", "DEEPINFER_COMPILATION_CACHE",
                 "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "DEEPINFER_MESH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, needles) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


# ---- the selection itself -------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [("auto", "auto"), ("CPU", "cpu"), (" cuda ", "cuda"),
                                            ("nvidia", "cuda"), ("ascend", "ascend")])
def test_names(name, expected):
    assert normalize(name) == expected


@pytest.mark.parametrize("name", ["tpu", "", None, 3])
def test_bad_names_are_named(name):
    with pytest.raises(ValueError, match="accelerator: must be one of auto, cuda, ascend, cpu"):
        normalize(name)


def test_cpu_and_auto_select_devices_and_the_kernel_platform():
    cpu = select_accelerator("cpu")
    assert cpu.devices == tuple(jax.devices("cpu")) and cpu.platform == "cpu"
    assert cpu.first_local_device == jax.devices("cpu")[0]
    assert cpu.kernel_config() == KernelConfig(platform="cpu")
    assert cpu.kernel_config(KernelConfig(backend="interpret")) == KernelConfig(backend="interpret", platform="cpu")
    impl, why = resolve("sparse_attention", cpu.kernel_config())
    assert impl.backend == "reference" and "on cpu" in why
    auto = select_accelerator()
    assert auto == Accelerator("auto", None, tuple(jax.devices()))
    assert auto.kernel_config() is None  # today's behaviour: the registry's default platform


@pytest.mark.parametrize("name, needles", [("cuda", CUDA_NEEDLES), ("nvidia", CUDA_NEEDLES),
                                           ("ascend", ASCEND_NEEDLES)])
def test_absent_backends_say_what_to_install(name, needles):
    with pytest.raises(AcceleratorUnavailableError) as info:
        select_accelerator(name)
    for needle in needles:
        assert needle in str(info.value)


def test_a_missing_ascend_plugin_file_is_named(tmp_path):
    missing = tmp_path / "libascend_pjrt.so"
    with pytest.raises(AcceleratorUnavailableError, match="libascend_pjrt.so.*does not exist"):
        select_accelerator("ascend", ascend_plugin=str(missing))


# ---- LLM(accelerator=...) ------------------------------------------------------------------------


@pytest.mark.parametrize("name, needles", [("cuda", CUDA_NEEDLES), ("ascend", ASCEND_NEEDLES),
                                           ("tpu", ["accelerator: must be one of"])])
def test_llm_rejects_an_absent_accelerator_before_any_work(tmp_path, name, needles):
    from deepinfer import LLM

    cache_dir = tmp_path / "tiny-v4.1-seed0"
    with pytest.raises(ValueError) as info:
        LLM("tiny-v4.1", cache_dir=cache_dir, accelerator=name, **SMALL)
    for needle in needles:
        assert needle in str(info.value)
    assert not cache_dir.exists()  # the embedded checkpoint was not even written


def test_llm_on_cpu_generates_with_everything_on_the_cpu_backend(tmp_path):
    from deepinfer import LLM, SamplingParams

    llm = LLM("tiny-v4.1", cache_dir=tmp_path / "tiny-v4.1-seed0", accelerator="cpu", **SMALL)
    cpu = jax.devices("cpu")[0]
    assert llm.accelerator.name == "cpu"
    assert llm.engine.engine_config.kernels == KernelConfig(platform="cpu")
    for leaf in (*jax.tree.leaves(llm.params), *jax.tree.leaves(llm.engine.runner.cache)):
        assert leaf.sharding.device_set == {cpu}
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert out[0].outputs[0].finish_reason == "length"


def test_llm_mesh_spec_is_laid_over_the_accelerator_devices():
    from deepinfer.serve.api.llm_inputs import resolve_mesh

    mesh = resolve_mesh("dp=4,cp=2", select_accelerator("cpu"))
    assert list(mesh.devices.flat) == jax.devices("cpu") and mesh.shape["cp"] == 2


# ---- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, env, needles", [
    (["generate", "--prompt", "x", "--accelerator", "cuda"], {}, CUDA_NEEDLES),
    (["generate", "--prompt", "x"], {"DEEPINFER_ACCELERATOR": "ascend"}, ASCEND_NEEDLES),
    (["run-batch", "-i", "-", "-o", "-", "--accelerator", "ascend"], {}, ASCEND_NEEDLES),
    (["serve", "--port", "0", "--accelerator", "cuda"], {}, CUDA_NEEDLES),
    (["forward", "--preset", "tiny-v4.1", "--prompt", "x"], {"DEEPINFER_ACCELERATOR": "nvidia"}, CUDA_NEEDLES),
    (["kernels", "--accelerator", "ascend"], {}, ASCEND_NEEDLES),
    (["generate", "--prompt", "x"], {"DEEPINFER_ACCELERATOR": "tpu"}, ["DEEPINFER_ACCELERATOR", "'tpu'"]),
    (["kernels"], {"DEEPINFER_ACCELERATOR": "tpu"}, ["DEEPINFER_ACCELERATOR", "'tpu'"]),
    (["generate", "--prompt", "x", "--accelerator", "tpu"], {}, ["--accelerator", "'tpu'"]),
])
def test_cli_rejects_an_absent_accelerator_with_one_line(capsys, monkeypatch, argv, env, needles):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, needles)


def test_the_environment_default_is_read_once_at_the_boundary():
    assert EnvDefaults.from_environ({"DEEPINFER_ACCELERATOR": "NVIDIA"}).resolved_accelerator() == "cuda"
    assert EnvDefaults.from_environ({}).resolved_accelerator() == "auto"


def test_cli_kernels_forward_and_generate_on_cpu(capsys, monkeypatch):
    code, out, err = run(capsys, "kernels", "--accelerator", "cpu", "--json")
    assert code == 0, err
    listing = json.loads(out)
    assert listing["platform"] == "cpu" and {row["implementation"] for row in listing["ops"]} == {"reference"}

    code, out, err = run(capsys, "forward", "--preset", "tiny-v4.1", "--prompt", "Hi", "--accelerator", "cpu")
    assert code == 0, err
    assert "backend cpu (cpu)" in out

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")  # the environment's default reaches the engine
    code, out, err = run(capsys, "generate", "--prompt", "Hello", "--max-tokens", "2", "--temperature", "0",
                         "--json", *SMALL_ARGS)
    assert code == 0, err
    assert len(json.loads(out.strip())["token_ids"]) == 2
