"""`serve.compilation_cache`: JAX's persistent compilation cache is on by default for `LLM` and the
commands, under ~/.cache/deepinfer/xla (HOME is a temporary directory here), set once per process.

The suite runs with a cache of its own run (tests/conftest.py); the config-level tests unset it
while they run, and the end-to-end test starts its subprocesses with their own directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import pytest

from deepinfer.serve.compilation_cache import (
    default_compilation_cache_dir,
    enable_compilation_cache,
    resolve_compilation_cache,
)

SMALL = dict(max_num_seqs=2, max_model_len=128, page_size=64, prefill_chunk=128, prefill_mode="full")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def unset_cache():
    """No compilation cache directory set in this process (restored after the test)."""
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_settings_name_a_directory_or_off(home, tmp_path):
    assert default_compilation_cache_dir() == str(home / ".cache" / "deepinfer" / "xla")
    assert resolve_compilation_cache(True) == str(home / ".cache" / "deepinfer" / "xla")
    assert resolve_compilation_cache(None) is None and resolve_compilation_cache(False) is None
    assert resolve_compilation_cache(tmp_path / "x") == str(tmp_path / "x")
    assert resolve_compilation_cache("~/y") == str(home / "y")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"compilation_cache: .*file exists and is not a directory"):
        resolve_compilation_cache(tmp_path / "file")
    with pytest.raises(ValueError, match=r"--compilation-cache: must be a directory"):
        resolve_compilation_cache(3, "--compilation-cache")
    assert not (home / ".cache").exists()  # resolving creates nothing


def test_set_once_per_process(tmp_path, unset_cache, caplog):
    assert enable_compilation_cache(None) is None  # off: nothing set
    first = str(tmp_path / "first")
    assert enable_compilation_cache(first) == first
    assert jax.config.jax_compilation_cache_dir == first
    assert enable_compilation_cache(first) == first  # idempotent
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
        assert enable_compilation_cache(str(tmp_path / "second")) == first  # the first one stays
    assert "already" in caplog.text and "second" in caplog.text
    assert enable_compilation_cache(None) == first  # turning it off later cannot undo it
    assert not os.path.exists(first)  # JAX creates it when it first writes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from deepinfer.serve.api.embedded import ensure_random_checkpoint

    directory, _ = ensure_random_checkpoint(tmp_path_factory.mktemp("cc") / "tiny-v4.1-seed0")
    return directory


def test_llm_turns_it_on_by_default(checkpoint, home, unset_cache):
    from deepinfer import LLM

    off = LLM(checkpoint, compilation_cache=None, warmup=False, **SMALL)
    assert off.compilation_cache is None and not jax.config.jax_compilation_cache_dir
    with pytest.raises(ValueError, match="compilation_cache"):
        LLM(checkpoint, compilation_cache=12, **SMALL)
    on = LLM(checkpoint, warmup=False, **SMALL)
    assert on.compilation_cache == jax.config.jax_compilation_cache_dir == str(home / ".cache" / "deepinfer" / "xla")


@pytest.mark.slow
def test_a_command_writes_the_cache_where_told_and_nothing_when_off(tmp_path):
    """`deepinfer generate` with $DEEPINFER_COMPILATION_CACHE: the compiled step shapes land there
    (not the suite's); with --no-compilation-cache nothing. Both runs compile every shape from
    nothing (a new cache, then none), so they run without fake-quant, whose programs take longer
    to compile: the numerics play no part here."""
    cache = tmp_path / "jax-cache"
    env = {**os.environ, "HOME": str(tmp_path), "DEEPINFER_COMPILATION_CACHE": str(cache),
           "JAX_ENABLE_COMPILATION_CACHE": "true"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's own (tests/conftest.py) would stay
    argv = [sys.executable, "-m", "deepinfer.serve.cli", "generate", "--prompt", "Hi", "--max-tokens", "2",
            "--temperature", "0", "--max-num-seqs", "2", "--max-model-len", "128", "--page-size", "64",
            "--prefill-chunk", "128", "--prefill-mode", "full", "--no-fake-quant"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    assert f"persistent cache: {cache}" in first.stdout
    written = sorted(p.name for p in cache.iterdir())
    assert written, "nothing was written to the compilation cache"
    off = subprocess.run([*argv, "--no-compilation-cache"], env=env, capture_output=True, text=True, timeout=900)
    assert off.returncode == 0, off.stderr
    assert "persistent cache: off" in off.stdout
    assert sorted(p.name for p in cache.iterdir()) == written  # off: nothing new
