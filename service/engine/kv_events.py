"""KV-cache events: what enters and leaves an engine core's prefix cache, published (kv_events_endpoint) for a
prefix-aware router (llm-d's KV-cache indexer, say) to send each request where its prompt's prefix is cached. The
layout is vLLM's (vllm/distributed/kv_events.py, its array-like msgpack encoding, which llm-d decodes):

    ZeroMQ PUB, one message per engine step that changed the cache, in three frames:
        topic             kv_events_topic, UTF-8 ("" by default; llm-d's indexer wants kv@<pod>@<model>)
        sequence number   8 bytes, big-endian, from 0 at the core's start: a gap means messages were dropped
        payload           msgpack [ts, events, data_parallel_rank]: ts in seconds since the epoch, the rank is the
                          core's index (engine_index, 0 without data parallelism)
    events, each an array led by its tag:
        ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
            consecutive full blocks of one sequence entered the cache: parent_block_hash is the hash of the block
            before the first (nil for a prompt's first block), token_ids their tokens (block_size per block),
            lora_id nil (adapters have names here), lora_name the adapter's served name or nil
        ["BlockRemoved", block_hashes, medium]      the blocks left the cache (reused for others: LRU eviction)
        ["AllBlocksCleared"]                        the cache is empty: a core's first event (nothing else resets
                                                    the cache), sent with its first step's, so that a subscriber
                                                    that joined after the start gets it
    medium is "GPU" or "CPU": where the KV cache lives.

Block hashes are the prefix cache's own (kvcache.block_manager): a full block's hash chains its tokens with the hash
of the block before it, so a hash names a whole prefix; sent as unsigned 64-bit integers. They are the same across
restarts and cores for the base model; an adapter's blocks are salted with its name, whose hash is per process.

Sockets follow vLLM's rule: an endpoint with a wildcard host (tcp://*:5557, tcp://[::]:5557) or an ipc:// or
inproc:// one is bound, core K binding port + K (ipc/inproc: the path + _dpK); any other endpoint is connected to
(a router's bound SUB socket) by every core: the rank in each message tells them apart (vLLM offsets the port there
too, which a single bound SUB socket cannot take).

Publishing never holds a step up: a step's events go in one message, sent without blocking; a PUB socket drops what
nobody subscribes to, and what a subscriber more than HWM messages behind would get. There is no replay socket
(vLLM's optional ROUTER that resends missed messages): a gap in the sequence numbers tells a subscriber that its
view of the cache is incomplete.
"""
import time
from collections.abc import Callable

import msgspec
import zmq

U64 = (1 << 64) - 1
HWM = 100_000  # messages a subscriber may fall behind before it misses some


class KVCacheEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Tagged with the class name, encoded as an array: [tag, fields...]."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def binds(endpoint: str) -> bool:
    """Whether a core binds the endpoint (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def core_endpoint(endpoint: str, index: int) -> str:
    """The endpoint core `index` binds."""
    if not index:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + index}"
    return f"{endpoint}_dp{index}"


class KVEventPublisher:
    def __init__(self, context: zmq.Context, endpoint: str, topic: str, engine_index: int, block_size: int,
                 medium: str, lora_name: Callable[[str], str]):
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, HWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self.socket.bind(core_endpoint(endpoint, engine_index))
        else:
            self.socket.connect(endpoint)
        self.topic = topic.encode()
        self.rank, self.block_size, self.medium, self.lora_name = engine_index, block_size, medium, lora_name
        self.seq = 0
        self._encode = msgspec.msgpack.Encoder().encode

    def publish(self, changes: list[tuple]) -> None:
        """Sends the prefix cache's changes (BlockManager.take_events) as one message, if there are any."""
        if not changes:
            return
        payload = self._encode(KVEventBatch(time.time(), self._events(changes), self.rank))
        # A PUB socket never blocks: past the high-water mark it drops the message.
        self.socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.seq += 1

    def _events(self, changes: list[tuple]) -> list[KVCacheEvent]:
        events = []
        for change in changes:
            last = events[-1] if events else None
            if change[0] == "stored":
                _, h, parent, keys, first = change
                # An adapter's sequence salts its first cache key: (adapter, token) (Sequence.cache_keys).
                lora = self.lora_name(first[0]) if isinstance(first, tuple) else None
                tokens = [keys[0][1], *keys[1:]] if isinstance(keys[0], tuple) else list(keys)
                parent = None if parent is None else parent & U64
                if (isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent
                        and last.lora_name == lora):  # the next block of the same sequence
                    last.block_hashes.append(h & U64)
                    last.token_ids += tokens
                else:
                    events.append(BlockStored([h & U64], parent, tokens, self.block_size, None, self.medium, lora))
            elif change[0] == "removed":
                if isinstance(last, BlockRemoved):
                    last.block_hashes.append(change[1] & U64)
                else:
                    events.append(BlockRemoved([change[1] & U64], self.medium))
            else:
                events.append(AllBlocksCleared())
        return events

    def close(self) -> None:
        self.socket.close()
