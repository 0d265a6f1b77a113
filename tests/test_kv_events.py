"""KV-cache events (kv_events_endpoint): a subscriber that reads nothing but the events rebuilds exactly the set of
blocks in the core's prefix cache, through prefix hits, LRU evictions and a restart of the server. In-process server
(the test reads the core's cache), embedded model, CPU."""
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import zmq
from server import serve_in_process

from kvcache import BlockManager
from service.engine.kv_events import (
    U64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    binds,
    core_endpoint,
)

BLOCK = 16
SETTINGS = {"num_kv_blocks": 24, "block_size": BLOCK}  # 384 tokens: a few prompts fill it, then it evicts


class Subscriber:
    """Rebuilds a core's prefix cache from its events alone."""

    def __init__(self):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        # Bound here, so that the cores connect to it, as they would to a router's (vLLM's convention).
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.cached: set[int] = set()
        self.messages: list[tuple[bytes, int, KVEventBatch]] = []
        # A bound SUB socket subscribes a connecting publisher only once its owner polls it: as a router does, a
        # thread polls it all the time.
        self.frames: queue.Queue = queue.Queue()
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while self.running:
            if self.socket.poll(50):
                self.frames.put(self.socket.recv_multipart())

    def receive(self, timeout: float) -> bool:
        try:
            topic, seq, payload = self.frames.get(timeout=timeout)
        except queue.Empty:
            return False
        batch = self.decode(payload)
        self.messages.append((topic, int.from_bytes(seq, "big"), batch))
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.cached.clear()
            elif isinstance(event, BlockStored):
                check_chain(event)
                self.cached.update(event.block_hashes)
            else:
                self.cached.difference_update(event.block_hashes)
        return True

    def catch_up(self, core, timeout: float = 30) -> set[int]:
        """Reads events until the rebuilt set is the core's (it is, once the core's last step was published)."""
        deadline = time.monotonic() + timeout
        while True:
            actual = cache_contents(core)
            if self.cached == actual:
                return actual
            if time.monotonic() > deadline:
                raise AssertionError(f"rebuilt {len(self.cached)} blocks, the core holds {len(actual)}: missing "
                                     f"{len(actual - self.cached)}, extra {len(self.cached - actual)}")
            self.receive(0.2)

    def events(self, kind) -> list:
        return [e for _, _, batch in self.messages for e in batch.events if isinstance(e, kind)]

    def close(self):
        self.running = False
        self.thread.join()
        self.socket.close(linger=0)
        self.context.term()


def check_chain(event: BlockStored) -> None:
    """Each hash is the prefix cache's: the block's tokens chained onto the hash before it (the parent's)."""
    assert len(event.token_ids) == BLOCK * len(event.block_hashes) and event.block_size == BLOCK
    assert event.medium == "CPU" and event.lora_id is None and event.lora_name is None
    h = 0 if event.parent_block_hash is None else signed(event.parent_block_hash)
    for i, expected in enumerate(event.block_hashes):
        h = BlockManager._chain(h, event.token_ids[i * BLOCK:(i + 1) * BLOCK])
        assert h & U64 == expected


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def cache_contents(core) -> set[int]:
    for _ in range(100):
        try:  # the core's thread may be changing it
            return {h & U64 for h in list(core.engine.scheduler.block_manager.hash_to_block)}
        except RuntimeError:
            time.sleep(0.01)
    raise AssertionError("the prefix cache never held still")


def complete(url: str, prompt: list[int], max_tokens: int = 6) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tgi", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_subscriber_rebuilds_the_prefix_cache_from_the_events_alone():
    sub = Subscriber()
    shared = list(range(100, 100 + 3 * BLOCK))  # three full blocks that several prompts begin with
    try:
        with serve_in_process(kv_events_endpoint=sub.endpoint, **SETTINGS) as (url, core):
            bm = core.engine.scheduler.block_manager
            complete(url, shared + list(range(1000, 1040)))
            first = sub.catch_up(core)
            assert len(first) >= 5 and isinstance(sub.messages[0][2].events[0], AllBlocksCleared)
            assert sub.messages[0][1] == 0 and sub.messages[0][2].data_parallel_rank == 0

            complete(url, shared + list(range(2000, 2040)))  # hits the three shared blocks
            assert bm.prefix_hit_tokens >= 3 * BLOCK
            sub.catch_up(core)
            assert not sub.events(BlockRemoved)

            for i in range(6):  # distinct prompts of 6 blocks each: the 24-block cache must evict
                complete(url, [3000 + 97 * i + t for t in range(6 * BLOCK + 3)], max_tokens=12)
            sub.catch_up(core)
            assert sub.events(BlockRemoved)
            assert not first <= sub.cached  # the oldest prompt's blocks were evicted

            # Concurrent requests, some sharing the prefix: one step registers and evicts for several at once.
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: complete(url, shared[:BLOCK * (1 + i % 3)] + [50 + i] * 20), range(8)))
            sub.catch_up(core)
            seqs = [seq for _, seq, _ in sub.messages]
            assert seqs == list(range(len(seqs)))  # nothing dropped

        count = len(sub.messages)
        with serve_in_process(kv_events_endpoint=sub.endpoint, **SETTINGS) as (url, core):
            complete(url, shared + list(range(4000, 4040)))
            rebuilt = sub.catch_up(core)
            _, seq, batch = sub.messages[count]  # the new core's first message starts over
            assert seq == 0 and isinstance(batch.events[0], AllBlocksCleared)
            assert rebuilt and rebuilt == cache_contents(core)
    finally:
        sub.close()


def test_an_adapters_blocks_name_it_and_runs_of_blocks_merge():
    context = zmq.Context()
    try:
        publisher = KVEventPublisher(context, "inproc://kv-events", "kv@pod@model", 0, 4, "GPU",
                                     lambda key: f"served-{key}")
        bm = BlockManager(num_blocks=4, block_size=4)
        bm.record_events()
        salted = [("adapter", 1)] + list(range(2, 10))  # Sequence.cache_keys of an adapter's 9-token prompt
        bm.allocate("a", salted)
        bm.publish("a", salted)
        bm.free("a")
        bm.allocate("b", list(range(20, 33)))  # needs 4 blocks: evicts the adapter's two
        cleared, stored, removed = publisher._events(bm.take_events())
        assert isinstance(cleared, AllBlocksCleared)
        assert stored.token_ids == list(range(1, 9)) and stored.lora_name == "served-adapter"
        assert stored.parent_block_hash is None and len(stored.block_hashes) == 2
        assert set(removed.block_hashes) == set(stored.block_hashes) and not bm.hash_to_block
        publisher.close()
    finally:
        context.term()


def test_cores_bind_one_endpoint_each_and_connect_to_one():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://router:5557")
    assert core_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert core_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert core_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


@pytest.mark.parametrize("endpoint", ["5557", "http://x:1"])
def test_the_endpoint_must_be_a_zeromq_one(endpoint):
    from pydantic import ValidationError

    from service.config import Settings
    with pytest.raises(ValidationError, match="kv_events_endpoint"):
        Settings(kv_events_endpoint=endpoint)
