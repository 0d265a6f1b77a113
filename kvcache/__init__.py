"""Paged KV cache: block allocator, block tables with prefix caching, storage and the slot-write kernel."""
from kvcache.block_allocator import BlockAllocator
from kvcache.block_manager import BlockManager
from kvcache.cache import KVCache, block_bytes, gpu_kv_budget, num_blocks_for_bytes, num_blocks_for_gpu
from kvcache.store import store_kv, store_kv_ref

__all__ = ["BlockAllocator", "BlockManager", "KVCache", "block_bytes", "gpu_kv_budget", "num_blocks_for_bytes",
           "num_blocks_for_gpu", "store_kv", "store_kv_ref"]
