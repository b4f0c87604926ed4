"""The shipped trained tiny model (`model/weights/`, `model/compact_weights.py`), the embedded
default of `LLM()` and the commands: it is small, its checksum is checked when it is materialised,
and it greedy-completes a fixed prompt to the
continuation recorded when it was shipped.

Flip-aware: another CPU may round a fake-quant site the other way and change a near-tie; the
continuation must match up to a position whose recorded top-2 log-probability gap was small
(`NEAR_TIE`), and the first tokens (gaps of 0.6 nats and more) always."""

import json

import pytest

from deepinfer.serve.api import LLM, SamplingParams
from deepinfer.serve.api.embedded import TRAINED_MODEL, trained_weights

SMALL = dict(max_num_seqs=4, max_model_len=512, page_size=64, prefill_chunk=128, compilation_cache=None)
PROMPT = "import os\nimport sys\n\n\ndef main():\n"
# recorded with this file's settings when the weights were shipped: greedy tokens and the top-2
# log-probability gap at each
EXPECTED = [361, 26495, 25529, 260, 2310, 294, 270, 12124, 339, 361, 455, 2502, 270, 2573, 4245, 344, 260, 2310, 294,
            270, 201, 361, 294, 270]
GAPS = [7.144, 0.626, 1.027, 0.262, 0.445, 4.742, 0.597, 0.247, 0.846, 2.49, 0.562, 0.388, 1.054, 0.017, 0.148, 0.356,
        0.167, 0.208, 3.751, 1.265, 0.554, 4.005, 0.665, 1.645]
NEAR_TIE = 0.3


def test_the_shipped_pack_is_small_and_described():
    info = trained_weights()
    assert info["bytes"] < 20_000_000
    with open(info["path"], "rb") as f:
        assert len(f.read()) == info["bytes"]
    assert info["architecture"] == "tiny-v4.1" and info["target"]["steps"] > 0
    json.dumps(info)


@pytest.mark.slow
def test_the_default_model_is_the_trained_one_and_completes_a_fixed_prompt(tmp_path):
    llm = LLM(cache_dir=tmp_path / "trained", **SMALL)
    assert llm.model_name == TRAINED_MODEL
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=len(EXPECTED)), use_tqdm=False)[0]
    got = out.outputs[0].token_ids
    for i, token in enumerate(EXPECTED):
        if got[i] != token:
            assert i >= 3 and GAPS[i] < NEAR_TIE, f"token {i}: {got[i]} != {token} (recorded top-2 gap {GAPS[i]})"
            break
    assert out.outputs[0].text.startswith('    """')
