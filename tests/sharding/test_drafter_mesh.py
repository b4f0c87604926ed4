"""The DSpark drafter rings on a device mesh: written by shard-mapped steps (a sequence on dp rank 1,
its 128-token prefill chunk split over cp), read by drafting over the dp-sharded cache; the drafts
equal the drafter on the whole sequence."""

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.drafter import draft_after
from deepinfer.model.kv_cache import FLOAT, CacheLayout
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, token_bucket
from deepinfer.sharding import make_mesh
from tests.argmax_check import assert_argmax_agrees


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=3)


def test_drafts_from_a_mesh_cache_equal_the_whole_sequence_drafter(model):
    config, params = model
    mesh = make_mesh("dp=2,cp=2,tp=2")
    layout = CacheLayout(num_slots=4, page_size=64, num_pages=16, max_pages_per_slot=4, storage=FLOAT, dp=2,
                         draft_rings=config.num_nextn_predict_layers)
    runner = ModelRunner(params, config, layout, mesh=mesh)
    ids = np.random.default_rng(31).integers(3, 128000, 140)
    ids[0] = 0
    slot = 3  # global slot 3 = rank 1, local slot 1
    table = np.full((4, 4), -1, np.int32)
    table[slot, :3] = [2, 0, 5]  # pages local to rank 1
    runner.run([ChunkWork(slot, ids[:128], 0, ids[:0])], table, rows=1, tokens=token_bucket(128))
    for start in range(128, len(ids)):
        runner.run([ChunkWork(slot, ids[start:start + 1], start, ids[:start])], table, rows=2, tokens=1)
    anchor = np.array([777])
    ours = runner.draft([slot], anchor, [len(ids)])
    ref = {k: np.asarray(v) for k, v in draft_after(params, config, ids[None], anchor).items()}
    rel = np.abs(ours["logits"] - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert rel <= 1e-4, rel
    assert_argmax_agrees(ours["tokens"], ref["logits"], 1e-4 * np.abs(ref["logits"]).max(), sequential=True)
