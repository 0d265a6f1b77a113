"""Block allocator, block manager (prefix caching, copy-on-write, eviction), storage sizing and store_kv."""
import pytest
import torch

from kvcache import BlockAllocator, BlockManager, KVCache, block_bytes, num_blocks_for_bytes, store_kv, store_kv_ref


def test_allocator_refcounts_and_double_free():
    a = BlockAllocator(4)
    b = a.allocate()
    a.fork(b)
    a.free(b)
    assert a.num_free_blocks == 3
    a.free(b)
    assert a.num_free_blocks == 4
    with pytest.raises(ValueError):
        a.free(b)
    with pytest.raises(ValueError):
        a.fork(b)
    for _ in range(4):
        a.allocate()
    with pytest.raises(RuntimeError):
        a.allocate()


def test_prefix_sharing_and_hit_rate():
    m = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert m.allocate("a", prompt) == 0
    m.append("a", prompt + [99])  # the prompt's KV is written: its full blocks get registered
    assert m.allocate("b", prompt) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] != m.block_table("a")[2]
    assert m.hit_rate == pytest.approx(8 / 20)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 16 and m.usage == 0.0
    # Cached blocks stay reusable after their sequences end.
    assert m.allocate("c", prompt + [5, 6]) == 8
    m.free("c")
    assert m.num_free_blocks == 16


def test_fully_cached_prompt_recomputes_last_token():
    m = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    m.allocate("a", prompt)
    m.append("a", prompt + [1, 2])
    cached = m.allocate("b", prompt)
    assert cached == 4 and cached < len(prompt)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 8


def test_lru_eviction_keeps_recent_prefixes():
    m = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [7, 8, 9]
    for seq, prompt in (("old", old), ("new", new)):
        m.allocate(seq, prompt)
        m.append(seq, prompt + [0])
        m.free(seq)
    assert m.num_free_blocks == 4
    # Needs 3 blocks: the 2 never-cached ones, then evicts the least recently freed cached block ("old").
    m.allocate("x", [5, 5, 5, 5, 5])
    m.free("x")
    assert m.allocate("y", new) == 2
    m.free("y")
    assert m.allocate("z", old) == 0
    m.free("z")
    assert m.num_free_blocks == 4


def test_fork_copy_on_write_and_no_leaks():
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    tokens = list(range(6))
    m.allocate("p", tokens)
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p")
    assert m.num_free_blocks == 6
    copies = m.append("c", tokens + [1])  # writes position 6 into the shared last block
    assert copies == [(m.block_table("p")[1], m.block_table("c")[1])]
    assert m.append("p", tokens + [2]) == []  # now private to the parent
    assert m.slot_mapping("c", 4, 7) == [m.block_table("c")[1] * 4 + i for i in range(3)]
    free = m.num_free_blocks
    assert m.append("c", tokens + [1] * 100) is None  # more blocks than are free: nothing changes
    assert m.num_free_blocks == free and len(m.block_table("c")) == 2
    m.append("c", tokens + [1, 2, 3])
    assert len(m.block_table("c")) == 3
    m.free("p")
    m.free("c")
    assert m.num_free_blocks == 8
    with pytest.raises(KeyError):
        m.free("c")


def test_can_allocate_counts_capacity():
    m = BlockManager(num_blocks=3, block_size=4)
    assert m.can_allocate(list(range(12)))
    assert not m.can_allocate(list(range(13)))
    m.allocate("a", list(range(12)))
    assert m.usage == 1.0 and not m.can_allocate([1])
    with pytest.raises(RuntimeError):
        m.allocate("b", [1])
    m.free("a")
    assert m.num_free_blocks == 3


def test_sizing_and_storage():
    assert block_bytes(2, 16, 4, 64, torch.float16) == 2 * 2 * 16 * 4 * 64 * 2
    n = num_blocks_for_bytes(10 * block_bytes(2, 16, 4, 64, torch.float16) + 1, 2, 16, 4, 64, torch.float16)
    assert n == 10
    with pytest.raises(ValueError):
        num_blocks_for_bytes(10, 2, 16, 4, 64, torch.float16)
    cache = KVCache(num_layers=2, num_blocks=n, block_size=16, nheads_k=4, head_dim=64)
    assert cache.k_caches[1].shape == (n, 16, 4, 64) and cache.nbytes == n * block_bytes(2, 16, 4, 64, torch.float16)
    cache.k_caches[0][3] = 1.0
    cache.copy_blocks([(3, 5)])
    assert (cache.k_caches[0][5] == 1.0).all() and (cache.v_caches[1][5] == 0).all()


@pytest.mark.parametrize("head_dim", [32, 80])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_kv_matches_reference(head_dim, dtype, device):
    num_blocks, block_size, nheads_k, tokens = 6, 16, 2, 20
    qkv = torch.randn(tokens, 3 * nheads_k, head_dim, dtype=dtype, device=device)
    k, v = qkv[:, nheads_k:2 * nheads_k], qkv[:, 2 * nheads_k:]  # strided views, as from a fused projection
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[3] = -1
    caches = [torch.full((num_blocks, block_size, nheads_k, head_dim), float("nan"), dtype=dtype, device=device)
              for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    for out, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0))
    written = caches[0].view(-1, nheads_k, head_dim)[slots[slots >= 0].long()]
    assert torch.equal(written, k[slots >= 0])
    with pytest.raises(ValueError):
        store_kv(k, v[:, :1], caches[0], caches[1], slots)


def test_an_adapters_salted_tokens_read_as_the_salted_list():
    """Sequence.cache_keys of an adapter's sequence is a view (no copy a step): every length, index and slice the
    block manager could take reads as the list with its first token salted; and it hashes blocks as that list does."""
    import itertools

    from service.engine.sequence import SaltedTokens

    for n in (1, 2, 7, 40):
        tokens = list(range(1, n + 1))
        salted, view = [("adapter", 1)] + tokens[1:], SaltedTokens("adapter", tokens)
        assert len(view) == len(salted) and bool(view)
        for a, b, c in itertools.product([None, 0, 1, 3, -1, -3, 100], [None, 0, 2, 5, -1, -2, 100],
                                         [None, 1, 2, -1, -2]):
            assert view[a:b:c] == salted[a:b:c], (n, a, b, c)
        assert [view[i] for i in range(-n, n)] == [salted[i] for i in range(-n, n)]
    tokens = list(range(3, 40))
    by_list, by_view = BlockManager(16, 4), BlockManager(16, 4)
    by_list.allocate("s", [("a", 3)] + tokens[1:])
    by_view.allocate("s", SaltedTokens("a", tokens))
    by_list.publish("s", [("a", 3)] + tokens[1:])
    by_view.publish("s", SaltedTokens("a", tokens))
    assert by_list.hashes["s"] == by_view.hashes["s"] and by_list.hashes["s"]
