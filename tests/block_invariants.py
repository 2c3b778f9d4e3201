"""The paged KV cache's invariants, checked by the block manager and scheduler tests."""
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PENDING, Sequence


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Reference counts are the number of live holders; every block is free or used, never both;
    a hashed block holds the very tokens of the prefix block it is registered for, all of them known."""
    holders: dict[int, int] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), "a sequence holds a block twice"
        assert seq.num_cached_tokens <= len(seq) and len(seq.block_table) <= seq.num_blocks + 1
        for i, block_id in enumerate(seq.block_table):
            holders[block_id] = holders.get(block_id, 0) + 1
            block = bm.blocks[block_id]
            if block.hash != -1:                         # a hashed block holds exactly this prefix block
                assert block.token_ids == seq.block(i)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert set(holders) == bm.used_block_ids
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == len(bm.blocks)
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)
    assert not set(bm.free_block_ids) & bm.used_block_ids
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == h and len(block.token_ids) == bm.block_size
        assert PENDING not in block.token_ids, "a block was hashed before its tokens were known"
    for (h, next_token), block_id in bm.followed_to_block_id.items():
        block = bm.blocks[block_id]
        assert bm.reads_next_token and block.hash == h and block.next_token == next_token != -1
    if bm.reads_next_token:     # a block's last position read the token after it in every holder
        for seq in live:
            known = seq.num_tokens - seq.num_pending_tokens
            for i, block_id in enumerate(seq.block_table):
                following, block = (i + 1) * bm.block_size, bm.blocks[block_id]
                if block.next_token != -1 and following < known:
                    assert block.next_token == seq[following], "a block shared past a token it did not read"
