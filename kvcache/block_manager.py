"""Block tables of live sequences with prefix caching (the scheduler's view of the KV cache).

A full block is identified by a hash chained over its token ids and all blocks before it, so equal hashes
mean equal prefixes. A full block is registered once its KV is known to be written: `append(seq, tokens)`
registers full blocks lying entirely before the last token (the last token's KV is written by the next step);
`publish(seq, tokens)` registers them without growing the table (a prefill whose KV is now written).

With record_events(), every change to the prefix cache's contents is recorded in `events`, in order, for the KV-cache
events a router reads (service.engine.kv_events): ("cleared",); ("stored", hash, parent hash or None, the block's
keys, the sequence's first key) when a block is registered; ("removed", hash) when its block is reused (LRU eviction).
"""
from kvcache.block_allocator import BlockAllocator


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks, on_evict=self._forget)
        self.hash_to_block: dict[int, int] = {}
        self.block_to_hash: dict[int, int] = {}
        self.tables: dict[object, list[int]] = {}
        self.num_tokens: dict[object, int] = {}
        self.hashes: dict[object, list[int]] = {}  # chained hashes of the sequence's registered full blocks
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.events: list[tuple] | None = None  # None: not recorded

    def record_events(self) -> None:
        """Records the prefix cache's changes from now on (call it while the cache is empty: before any sequence),
        beginning with "cleared"."""
        self.events = [("cleared",)]

    def take_events(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    # -- accounting ------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _chain(prev_hash: int, tokens) -> int:
        return hash((prev_hash, tuple(tokens)))

    def _forget(self, block: int) -> None:
        h = self.block_to_hash.pop(block)
        del self.hash_to_block[h]
        if self.events is not None:
            self.events.append(("removed", h))

    def _prefix_hits(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) of the longest cached prefix of full blocks before the last token."""
        blocks, hashes, h = [], [], 0
        if not self.enable_prefix_caching:
            return blocks, hashes
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            h = self._chain(h, token_ids[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
        return blocks, hashes

    # -- sequences -------------------------------------------------------------------------------------
    def can_allocate(self, token_ids: list[int]) -> bool:
        hits, _ = self._prefix_hits(token_ids)
        revived = sum(self.allocator.is_evictable(b) for b in hits)
        return self._num_blocks(len(token_ids)) - len(hits) <= self.num_free_blocks - revived

    def allocate(self, seq_id, token_ids: list[int]) -> int:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError("cannot allocate an empty prompt")
        if not self.can_allocate(token_ids):
            raise RuntimeError("out of KV-cache blocks")
        hits, hashes = self._prefix_hits(token_ids)
        table = [self.allocator.fork(b) for b in hits]  # revive hits before allocating may evict
        table += [self.allocator.allocate() for _ in range(self._num_blocks(len(token_ids)) - len(hits))]
        self.tables[seq_id], self.hashes[seq_id], self.num_tokens[seq_id] = table, hashes, len(token_ids)
        cached = len(hits) * self.block_size
        self.prefix_queried_tokens += len(token_ids)
        self.prefix_hit_tokens += cached
        return cached

    def append(self, seq_id, token_ids: list, lookahead: int = 0) -> list[tuple[int, int]] | None:
        """Grows the sequence to len(token_ids) tokens, with slots for `lookahead` more past them (speculative
        decoding's draft tokens: written by the step, the sequence's only once accepted, see truncate): the
        copy-on-write block copies to do before they are written, or None (and nothing changed) when there are not
        enough free blocks."""
        table, old, n, bs = self.tables[seq_id], self.num_tokens[seq_id], len(token_ids), self.block_size
        if n < old:
            raise ValueError("a sequence cannot shrink")
        end = n + lookahead
        first, blocks, copies = old // bs, -(-end // bs), []
        # A decode's common case stays short: its token lands in the one block it already owns. (The scheduler
        # calls this for every decode in every step.)
        private = blocks <= len(table) and blocks - first == 1 and self.allocator.ref_counts[table[first]] == 1
        if end > old and not private:
            refs = self.allocator.ref_counts
            # Copy-on-write: positions from the old length on are about to be written; a block shared with a
            # fork (or cached) must become private first.
            shared = [i for i in range(first, min(len(table), blocks)) if refs[table[i]] > 1]
            if blocks - len(table) + len(shared) > self.num_free_blocks:
                return None
            for index in shared:
                new = self.allocator.allocate()
                copies.append((table[index], new))
                self.allocator.free(table[index], cached=table[index] in self.block_to_hash)
                table[index] = new
            while len(table) < blocks:
                table.append(self.allocator.allocate())
        self.num_tokens[seq_id] = n
        if self.enable_prefix_caching and (n - 1) // bs > len(self.hashes[seq_id]):  # publish's bound, without a call
            self.publish(seq_id, token_ids)
        return copies

    def publish(self, seq_id, token_ids: list) -> None:
        """Registers the sequence's full blocks before its last token in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table, hashes, bs = self.tables[seq_id], self.hashes[seq_id], self.block_size
        for index in range(len(hashes), (len(token_ids) - 1) // bs):
            keys = token_ids[index * bs:(index + 1) * bs]
            parent = hashes[-1] if hashes else None
            h = self._chain(0 if parent is None else parent, keys)
            hashes.append(h)
            block = table[index]
            if h not in self.hash_to_block and block not in self.block_to_hash:
                self.hash_to_block[h] = block
                self.block_to_hash[block] = h
                if self.events is not None:
                    self.events.append(("stored", h, parent, keys, token_ids[0]))

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Gives back the blocks past the first num_tokens slots: those that only a speculative step's rejected draft
        tokens reached (append's lookahead). They were never registered in the prefix cache: it registers only
        blocks wholly before the last token. A table never loses the blocks of the tokens its sequence has (the
        runner's decode-graph tables, which saw the lookahead's, rewrite the new last entry)."""
        table = self.tables[seq_id]
        keep = max(self._num_blocks(num_tokens), self._num_blocks(self.num_tokens[seq_id]))
        while len(table) > keep:
            block = table.pop()
            self.allocator.free(block, cached=block in self.block_to_hash)

    def fork(self, parent_seq_id, child_seq_id) -> None:
        if child_seq_id in self.tables:
            raise ValueError(f"sequence {child_seq_id!r} already has blocks")
        self.tables[child_seq_id] = [self.allocator.fork(b) for b in self.tables[parent_seq_id]]
        self.hashes[child_seq_id] = list(self.hashes[parent_seq_id])
        self.num_tokens[child_seq_id] = self.num_tokens[parent_seq_id]

    def free(self, seq_id) -> None:
        table = self.tables.pop(seq_id)
        del self.hashes[seq_id], self.num_tokens[seq_id]
        for block in reversed(table):  # tail blocks are evicted before the shared prefix blocks
            self.allocator.free(block, cached=block in self.block_to_hash)

    def block_table(self, seq_id) -> list[int]:
        return list(self.tables[seq_id])

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        table, bs = self.tables[seq_id], self.block_size
        if not 0 <= start <= end <= len(table) * bs:
            raise ValueError(f"positions [{start}, {end}) outside the sequence's {len(table)} blocks")
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
