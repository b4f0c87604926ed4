"""`serve.engine.programs`: engines of one configuration share its step programs, both kinds (the
sampling step and the logits step) compile there and nowhere process-wide, and a family no engine
holds is forgotten (and its executables freed) once the process holds more than half of
`vm.max_map_count`, and kept for the next engine below that."""

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model import step as model_step
from deepinfer.model.kv_cache import CacheLayout
from deepinfer.serve.engine import programs
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, StepSampling
from deepinfer.serve.engine.sampler import SampleOutput


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(programs, "_live", weakref.WeakValueDictionary())
    monkeypatch.setattr(programs, "_kept", programs.OrderedDict())
    maps = {"count": 0}
    monkeypatch.setattr(programs, "memory_maps", lambda: (maps["count"], 1000))
    return maps


def test_one_family_per_configuration_released_only_under_map_pressure(fresh):
    config = load_config("tiny-v4.1-short")
    a, b = CacheLayout(4, 128, 16, 4), CacheLayout(8, 128, 32, 4)
    first = programs.step_programs(config, a, None)
    assert programs.step_programs(config, a, None) is first  # shared by the engines of `a`
    assert programs.step_programs(config, b, None) is not first
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is not None  # below half the limit: kept for the next engine of `a`
    fresh["count"] = 600
    held = programs.step_programs(config, CacheLayout(2, 128, 8, 4), None)  # a new family releases
    gc.collect()
    assert gone() is None
    assert programs.step_programs(config, held.key[1], None) is held  # a held family stays shared


def _counts(config):
    return jnp.zeros((config.num_hidden_layers, config.n_routed_experts), jnp.int32)


def fake_body(params, cache, batch, *, config, layout, kernels=None, all_logits=False, decoder=True):
    """Stands in for `model.step.step_body`: compiles in a moment."""
    logits = jnp.zeros((batch.tokens.shape[0], 8), jnp.float32) + batch.tokens[:, :1] if decoder else None
    return cache, logits, _counts(config)


def fake_logits(params, cache, state, batch, rows, *, config, layout, kernels=None):
    """Stands in for `device_step.step_logits`: each row's first token as its logits."""
    return cache, jnp.zeros((batch.tokens.shape[0], 8), jnp.float32) + batch.tokens[:, :1], _counts(config)


def fake_sample(logits, state, slots, rows, *, head=None):
    """Stands in for `device_step.sample_logits`: samples what `fake_logits` put there."""
    return state, SampleOutput(tokens=logits[:, 0].astype(jnp.int32))


def test_the_runner_runs_both_kinds_of_step_in_its_family(fresh, monkeypatch):
    """A decode (sampled on the device) and an encoder-only prefill chunk (logits step) compile
    in the runner's own family; the module-level jit of `model.step` compiles nothing; the
    family is freed with the runner under map pressure."""
    monkeypatch.setattr(programs, "step_body", fake_body)
    monkeypatch.setattr(programs, "step_logits", fake_logits)
    monkeypatch.setattr(programs, "sample_logits", fake_sample)
    config = load_config("tiny-v4.1-short")
    layout = CacheLayout(2, 128, 4, 2)
    runner = ModelRunner(init_params(config, seed=0), config, layout)
    family, module_level = runner._programs, model_step.forward_step._cache_size()
    assert programs.step_programs(config, layout, None) is family
    table = np.zeros((2, 2), np.int32)
    out = runner.run([ChunkWork(1, np.array([9], np.int32), 5, np.zeros(3, np.int32))], table, rows=2, tokens=1,
                     sample=StepSampling([True]))
    assert out.tokens.tolist() == [9]
    assert runner.run([ChunkWork(0, np.arange(1, 129, dtype=np.int32), 0, np.zeros(0, np.int32), floor=200)],
                      table, rows=1, tokens=128, decoder=False) is None
    assert family.logits._cache_size() == family.sample_logits._cache_size() == family.forward._cache_size() == 1
    assert model_step.forward_step._cache_size() == module_level
    gone = weakref.ref(family)
    del runner, family
    fresh["count"] = 600
    programs.step_programs(config, CacheLayout(4, 128, 8, 2), None)  # another configuration's engine
    gc.collect()
    assert gone() is None
