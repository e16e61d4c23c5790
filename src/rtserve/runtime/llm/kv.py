"""The key/value block pool: a fixed number of blocks of ``block_size`` token slots,
allocated per sequence, with prefix caching.

Memory is preallocated once (``kv_cache_bytes``), so traffic never grows it. A full block
of a sequence is registered under the hash of its tokens and of everything before it; a
later sequence with the same prefix takes those blocks (reference counted) instead of
computing them. A freed block with a hash stays cached until the pool needs it back
(least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NO_HASH = -1


@dataclass(slots=True)
class Block:
    index: int
    refs: int = 0
    hash: int = NO_HASH


class BlockPool:
    """Which blocks are free, cached or in use; never touches the tensors."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block index
        self.queries = 0  # prefix-cache lookups (blocks) and hits, for metrics
        self.hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or only cached)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self) -> int:
        """A block for new tokens (evicts the least recently freed cached block)."""
        index, _ = self._free.popitem(last=False)
        block = self.blocks[index]
        if block.hash != NO_HASH:
            if self._cached.get(block.hash) == index:
                del self._cached[block.hash]
            block.hash = NO_HASH
        block.refs = 1
        return index

    def free(self, indices: list[int]) -> None:
        """Release a sequence's blocks; the last ones first, so a shared prefix is the
        last to be evicted."""
        for index in reversed(indices):
            block = self.blocks[index]
            block.refs -= 1
            if block.refs == 0:
                self._free[index] = None
                if block.hash == NO_HASH:
                    self._free.move_to_end(index, last=False)  # reuse plain blocks first

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks for the longest run of ``hashes`` from the start, taken (one
        more reference each)."""
        found: list[int] = []
        if not self.prefix_caching:
            return found
        for h in hashes:
            self.queries += 1
            index = self._cached.get(h)
            if index is None:
                break
            self.hits += 1
            block = self.blocks[index]
            if block.refs == 0:
                del self._free[index]
            block.refs += 1
            found.append(index)
        return found

    def register(self, index: int, block_hash: int) -> None:
        """Block ``index`` is full with the tokens hashed as ``block_hash``."""
        if not self.prefix_caching or block_hash in self._cached:
            return
        self.blocks[index].hash = block_hash
        self._cached[block_hash] = index


def block_hashes(tokens: list[int], block_size: int, start: int = 0, parent: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` from block ``start`` (``parent``:
    the hash of block ``start - 1``, 0 at the start)."""
    hashes = []
    for b in range(start, len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[b * block_size : (b + 1) * block_size])))
        hashes.append(parent)
    return hashes
