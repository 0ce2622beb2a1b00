from graphrt.core.block_manager import NULL_BLOCK, BlockManager


def test_allocate_grow_free_never_hands_out_the_null_block():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    assert bm.num_free_blocks == 8
    assert bm.allocate("a", 5) is not None and len(bm.block_table("a")) == 2
    assert bm.allocate("a", 8) == []  # still two blocks
    bm.allocate("a", 9)
    assert len(bm.block_table("a")) == 3
    assert bm.allocate("b", 21) is None  # needs 6, 5 free: nothing changes
    assert bm.block_table("b") == [] and bm.num_free_blocks == 5
    bm.allocate("b", 20)
    assert NULL_BLOCK not in bm.block_table("a") + bm.block_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_prefix_cache_shares_full_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert bm.match_prefix("a", prompt) == 0
    bm.allocate("a", len(prompt))
    bm.cache_full_blocks("a", prompt, len(prompt))
    other = prompt[:8] + [7, 7, 7, 7]
    assert bm.match_prefix("b", other) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    assert bm.pool.ref_count[bm.block_table("a")[0]] == 2
    assert bm.prefix_cache_hits == 2
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 19
    # freed blocks stay cached until reused: a third request still hits
    assert bm.match_prefix("c", prompt) == 8
    bm.free("c")


def test_last_token_is_never_served_from_the_cache():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(8))  # exactly 2 full blocks
    bm.match_prefix("a", prompt)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", prompt, 8)
    assert bm.match_prefix("b", prompt) == 4  # the block holding the last token is recomputed


def test_eviction_reuses_the_oldest_freed_block_and_drops_its_hash():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    bm.match_prefix("a", [1, 2, 3])
    bm.allocate("a", 3)
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    bm.free("a")
    bm.match_prefix("b", [9, 9, 9, 9])
    bm.allocate("b", 4)  # takes both blocks: the cached one is evicted
    bm.free("b")
    assert bm.match_prefix("c", [1, 2, 3]) == 0
