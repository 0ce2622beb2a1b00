"""The KV block manager: block pool, per-request block tables, reference counts, prefix caching.

Pure Python, no torch. Block 0 is the null block: never handed out, it absorbs padding writes and
fills unused block-table entries. A full block whose tokens are known is registered under a hash
chained over every earlier block, so requests sharing a prompt prefix share those blocks. Freed
blocks keep their hash until they are reused (an LRU free queue), so a finished request's prefix
can still be hit.
"""

from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0

BlockHash = int


def hash_block(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    return hash((parent, tokens))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is the null block)")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        # Free blocks in eviction order (least recently freed first); block 0 is never free.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # Blocks never used come first in that order, in id order: those below this one have been handed out
        self.fresh = 1
        self.hash_of: dict[int, BlockHash] = {}
        self.block_of: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        self.fresh = max(self.fresh, block + 1)
        old = self.hash_of.pop(block, None)
        if old is not None and self.block_of.get(old) == block:
            del self.block_of[old]
        self.ref_count[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Take one more reference to a (possibly free, cached) block."""
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} released twice"
        if self.ref_count[block] == 0:
            self.free[block] = None

    def lookup(self, h: BlockHash) -> int | None:
        return self.block_of.get(h)

    def register(self, block: int, h: BlockHash) -> None:
        if h not in self.block_of:
            self.block_of[h] = block
            self.hash_of[block] = h


class BlockManager:
    """Per-request block tables over one pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._salt: dict[str, object] = {}  # request → what its first block's hash starts from
        self.prefix_cache_hits = 0  # blocks reused from the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, request_id: str, token_ids: list[int], reuse: bool = True, salt=None) -> int:
        """On a request's first scheduling: take the cached blocks of its longest cached prefix
        (none when not ``reuse``). Returns the number of tokens they hold (never the last token:
        it must be computed). ``salt`` starts the chain of block hashes: requests share blocks only
        under the same salt (the same LoRA adapter, or none)."""
        assert request_id not in self.tables
        self.tables[request_id] = []
        self._hashes[request_id] = []
        self._salt[request_id] = salt
        if not self.enable_prefix_caching or not reuse:
            return 0
        bs = self.block_size
        parent = salt
        for i in range((len(token_ids) - 1) // bs):
            h = hash_block(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self.pool.lookup(h)
            if block is None:
                break
            self.pool.acquire(block)
            self.tables[request_id].append(block)
            self._hashes[request_id].append(h)
            self.prefix_cache_hits += 1
            parent = h
        return len(self.tables[request_id]) * bs

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        have = len(self.tables.get(request_id, []))
        return self.blocks_needed(num_tokens) - have <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold num_tokens; returns the new blocks, or None (and
        changes nothing) when the pool is short."""
        table = self.tables.setdefault(request_id, [])
        self._hashes.setdefault(request_id, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need > self.pool.num_free:
            return None
        new = [self.pool.allocate() for _ in range(max(need, 0))]
        table.extend(new)
        return new

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register every block that is full of computed tokens under its prefix hash."""
        if not self.enable_prefix_caching or request_id not in self.tables:
            return
        hashes, table, bs = self._hashes[request_id], self.tables[request_id], self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            parent = hashes[-1] if hashes else self._salt.get(request_id)
            h = hash_block(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            self.pool.register(table[i], h)
            hashes.append(h)

    def free(self, request_id: str) -> None:
        # Release in reverse so that a request's tail blocks are evicted before its prefix.
        for block in reversed(self.tables.pop(request_id, [])):
            self.pool.release(block)
        self._hashes.pop(request_id, None)
        self._salt.pop(request_id, None)
