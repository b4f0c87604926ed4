"""DeepSeek-V4-Flash against an external implementation: transformers' DeepseekV4ForCausalLM.

The oracle (tests/oracle/hf_v4_oracle.py) runs in a Python 3.11 side environment with torch;
it builds a tiny random HF model with every layer type (window-only, CSA ratio 4 with overlap
and its indexer, HCA, two hash-routed layers), writes its weights in the OFFICIAL checkpoint
format (FP8 128x128 UE8M0 blocks, MXFP4 experts, I64 tid2eid) and sets its own weights to the
dequantized values, then records logits and greedy continuations. We load the checkpoint with
`load_checkpoint` and compare (QAT fake-quant off: the HF port has none).
"""

import numpy as np
import pytest

from deepinfer.model import forward, load_checkpoint
from tests.oracle.sideenv import run_oracle


@pytest.fixture(scope="module", params=[0, 1])
def oracle(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"v4_oracle_{request.param}")
    run_oracle(["--out", str(out), "--seed", str(request.param)])
    config, params = load_checkpoint(out, fake_quant=False, dtype="float32")
    return config, params, np.load(out / "logits.npz")


def test_checkpoint_reads_as_v4(oracle):
    config, params, _ = oracle
    assert config.model_type == "deepseek_v4"
    kinds = {config.layer_kind(i) for i in range(config.num_hidden_layers)}
    assert kinds == {"swa", "csa", "hca"}
    assert config.num_hash_layers == 2 and "tid2eid" in params["layers"][0]["ffn"]["gate"]
    assert config.weight_block_size == (128, 128)


@pytest.mark.parametrize("prompt", [0, 1])
def test_logits_match_transformers(oracle, prompt):
    config, params, ref = oracle
    ids, expected = ref[f"ids_{prompt}"], ref[f"logits_{prompt}"].astype(np.float64)
    ours = np.asarray(forward(params, config, ids), np.float64)
    rel = np.abs(ours - expected).max() / np.abs(expected).max()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("prompt", [0, 1])
def test_greedy_continuation_matches_transformers(oracle, prompt):
    """One causal forward over prompt + HF's 32 greedy tokens: each of our argmaxes must pick the
    token HF generated next, which by causality is our own greedy continuation."""
    config, params, ref = oracle
    ids, greedy = ref[f"ids_{prompt}"], ref[f"greedy_{prompt}"]
    assert len(greedy) == 32
    sequence = np.concatenate([ids, greedy[:-1]])
    ours = np.asarray(forward(params, config, sequence))
    picked = ours[len(ids) - 1:].argmax(-1)
    np.testing.assert_array_equal(picked, greedy)
