"""Cache accounting: bytes per token from the config, what fits in a memory budget, pages."""

import pytest

from deepinfer.model import load_config
from deepinfer.model.kv_cache import FLOAT, PACKED, CacheLayout, bytes_per_token, slot_bytes
from deepinfer.serve.engine.cache import AdmissionError, CacheBudget, CacheManager, PageAllocator, make_layout


def test_release_config_global_cache_is_890_bytes_per_token():
    config = load_config("deepseek-v4.1-flash")
    layout = make_layout(config, CacheBudget(num_slots=1, max_model_len=1 << 20, page_size=256, num_pages=1))
    assert layout.storage == PACKED
    assert bytes_per_token(config, layout) == 890 == config.global_cache_bytes_per_token()
    # window rings: 40 layers x 128 positions x 528 B (FP8 e4m3 + one UE8M0 per 32), plus state
    assert slot_bytes(config, layout) == 40 * 128 * 528 + 128 * 4 + 3 * 2 * 512 * 4


def test_memory_budget_decides_how_many_tokens_fit():
    config = load_config("deepseek-v4.1-flash")
    gib = 1 << 30
    layout = make_layout(config, CacheBudget(num_slots=16, max_model_len=1 << 20, page_size=256, memory_bytes=8 * gib))
    free = 8 * gib - 16 * slot_bytes(config, layout)
    assert layout.num_pages == free // (890 * 256)
    manager = CacheManager(config, layout)
    assert manager.tokens_that_fit() == layout.num_pages * 256
    assert manager.tokens_that_fit() > 9_000_000  # about 9.6M tokens of context in 8 GiB
    with pytest.raises(AdmissionError, match="holds no page"):
        make_layout(config, CacheBudget(num_slots=16, memory_bytes=1 << 20))


def test_float_rows_for_exact_tests_cost_more():
    config = load_config("tiny-v4.1", fake_quant=False)
    layout = CacheLayout(1, 64, 4, 4, storage=FLOAT)
    per_source = (config.head_dim + config.index_head_dim) * 4  # fp32 rows
    expected = sum(per_source / config.compress_ratios[s] for s in config.kv_source_layer_ids)
    assert bytes_per_token(config, layout) == expected


def test_pages_are_owned_and_released():
    config = load_config("tiny-v4.1")
    manager = CacheManager(config, CacheLayout(2, 64, 5, 4, storage=PACKED))
    slot = manager.acquire_slot()
    manager.ensure(slot, 130)  # 3 pages
    assert manager.owned_pages(slot) == 3 and manager.pages.free == 2
    assert list(manager.page_table[slot, :3]) != [-1, -1, -1] and manager.page_table[slot, 3] == -1
    with pytest.raises(MemoryError):
        manager.ensure(manager.acquire_slot(), 64 * 3)
    manager.release(slot)
    assert manager.pages.free >= 4 and (manager.page_table[slot] == -1).all()
    with pytest.raises(AdmissionError):
        manager.check_admissible(64 * 6, 10_000)  # more pages than the whole pool
    allocator = PageAllocator(3)
    assert sorted(allocator.alloc(3)) == [0, 1, 2] and allocator.free == 0
