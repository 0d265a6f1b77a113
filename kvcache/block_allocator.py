"""Reference-counted pool of KV-cache block ids.

A block whose last reference is dropped goes either to the free list or, when it holds a prefix-cache entry,
to an LRU of evictable blocks that stay reusable until memory is needed. Every operation is O(1).
"""
from collections import OrderedDict, deque
from typing import Callable, Optional


class BlockAllocator:
    def __init__(self, num_blocks: int, on_evict: Optional[Callable[[int], None]] = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A block with one reference: a never-cached one if any, else the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(block)
        else:
            raise RuntimeError("out of KV-cache blocks")
        self.ref_counts[block] = 1
        return block

    def fork(self, block: int) -> int:
        """One more reference to a block; revives an evictable cached block."""
        if self.ref_counts[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is free, cannot share it")
            del self._evictable[block]
        self.ref_counts[block] += 1
        return block

    def free(self, block: int, cached: bool = False) -> None:
        """Drop one reference; at zero the block becomes evictable (cached=True) or free."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if cached:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable
