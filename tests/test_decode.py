"""Split-KV paged decode attention against the float64 reference."""
import pytest
import torch

from kernels.configs import PREFILL_TILE_M
from kernels.decode import attend_single_rows, flash_attn_with_kvcache
from kernels.prefill import flash_attn_forward, max_tiles, multi_row_tiles
from kernels.reference import gather_paged_kv, paged_attention_ref, varlen_attention_ref
from tests.helpers import cu_seqlens, rel_err


def make_paged(batch, seqlens, block_size, nheads, nheads_k, head_dim, seqlen_q, dtype, device, extra_cols=1):
    """Random q and a paged cache whose blocks are shuffled over a larger pool; the block table is a
    non-contiguous slice padded with extra columns (as a CUDA-graph-sized table would be)."""
    max_blocks = max(-(-s // block_size) for s in seqlens) + extra_cols
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, nheads_k, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=device)[: batch * max_blocks].view(batch, max_blocks)
    wide = torch.zeros(batch, max_blocks * 2, dtype=torch.int32, device=device)
    wide[:, :max_blocks] = table.int()
    block_table = wide[:, :max_blocks]  # rows strided apart, as a slice of a larger table
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, cache_seqlens, block_table


def check(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, causal=True, tol=1e-2):
    ref = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens, block_table,
                              causal=causal)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=causal,
                                  num_splits=num_splits)
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err}"
    return out, ref


# Interpreter-sized cases: (seqlens, block_size, nheads, nheads_k, head_dim, seqlen_q, num_splits)
CASES = [
    ([1, 37, 300], 16, 4, 4, 32, 1, 0),
    ([200, 5], 16, 8, 2, 64, 1, 3),
    ([129, 64, 1], 32, 8, 1, 80, 1, 16),
    ([100, 250], 64, 8, 2, 32, 4, 1),
    ([17, 40], 16, 4, 1, 96, 8, 2),
    ([260], 128, 2, 2, 32, 3, 5),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_reference(case, dtype, device):
    seqlens, block_size, nheads, nheads_k, head_dim, seqlen_q, num_splits = case
    tensors = make_paged(len(seqlens), seqlens, block_size, nheads, nheads_k, head_dim, seqlen_q, dtype, device)
    check(*tensors, num_splits)


def test_non_causal_and_empty_sequences(device):
    q, kc, vc, lens, table = make_paged(3, [0, 50, 3], 16, 4, 2, 32, 2, torch.float16, device)
    out, ref = check(q, kc, vc, lens, table, num_splits=4, causal=False)
    assert (out[0] == 0).all()
    out1 = flash_attn_with_kvcache(q, kc, vc, lens, table, num_splits=1)
    assert (out1[0] == 0).all()


def test_bad_inputs_raise(device):
    q, kc, vc, lens, table = make_paged(2, [10, 20], 16, 4, 2, 32, 1, torch.float16, device)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q[0], kc, vc, lens, table)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q.float(), kc, vc, lens, table)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, kc, vc, lens.long(), table)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q[:, :, :3], kc, vc, lens, table)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, kc, vc, lens, table, num_splits=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [0, 1, 7, 16])
def test_decode_gpu_bf16(block_size, head_dim, group, num_splits):
    seqlens = [1, 4097, 333, 2048, 1500, 17]
    tensors = make_paged(len(seqlens), seqlens, block_size, 8 * group, 8, head_dim, 1, torch.bfloat16, "cuda")
    check(*tensors, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [2, 8])
def test_decode_gpu_multi_query_and_graph(seqlen_q):
    seqlens = [3000, 700, 9]
    q, kc, vc, lens, table = make_paged(3, seqlens, 16, 32, 8, 128, seqlen_q, torch.bfloat16, "cuda", extra_cols=50)
    check(q, kc, vc, lens, table, num_splits=8)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flash_attn_with_kvcache(q, kc, vc, lens, table, num_splits=8)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(flash_attn_with_kvcache(q, kc, vc, lens, table, num_splits=8))
    lens.copy_(torch.tensor([3800, 1, 3700], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), lens, table)
    assert rel_err(out, ref) < 1e-2


def check_mixed_step(lens_q, lens_k, block_size, nheads, nheads_k, head_dim, dtype, device, num_splits, tol=1e-2):
    """A serving step's attention over a paged cache, decodes (one query row) among prompt chunks: the decode
    kernel computes the one-row sequences in place, the prefill kernel skips them and computes the rest. Each
    leaves the other's rows alone (a NaN sentinel stays), and together they match the float64 reference."""
    batch = len(lens_q)
    max_blocks = max(-(-n // block_size) for n in lens_k) + 2
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, nheads_k, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=device)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    q = torch.randn(sum(lens_q), nheads, head_dim, dtype=dtype, device=device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    single = torch.tensor([k if n == 1 else 0 for n, k in zip(lens_q, lens_k)], dtype=torch.int32, device=device)
    one_row = torch.tensor([n == 1 for n in lens_q for _ in range(n)], device=device)
    scale = head_dim ** -0.5

    out = torch.full_like(q, float("nan"))
    attend_single_rows(q, k_cache, v_cache, cu_q, single, table, out, scale, num_splits)
    assert out[~one_row].isnan().all() and not out[one_row].isnan().any()
    # The prefill kernel over the multi-row sequences' tiles, padded as a CUDA graph's grid is.
    tiles = torch.from_numpy(multi_row_tiles(lens_q, max_tiles(sum(lens_q), batch))).to(device)
    alone = torch.full_like(q, float("nan"))
    flash_attn_forward(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), scale, True, table, out=alone,
                       q_tiles=tiles)
    assert alone[one_row].isnan().all() and not alone[~one_row].isnan().any()
    flash_attn_forward(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), scale, True, table, out=out,
                       q_tiles=tiles)
    k = torch.cat([gather_paged_kv(k_cache, table[b], n) for b, n in enumerate(lens_k)])
    v = torch.cat([gather_paged_kv(v_cache, table[b], n) for b, n in enumerate(lens_k)])
    ref, _ = varlen_attention_ref(q.double(), k.double(), v.double(), cu_q, cu_k, scale, causal=True)
    assert rel_err(out, ref) < tol


def test_multi_row_tiles_cover_the_prompt_chunks_highest_rows_first():
    m = PREFILL_TILE_M
    tiles = multi_row_tiles([1, 2 * m + 1, 1, m, 2], width=max_tiles(3 * m + 6, 5))
    assert tiles.dtype.name == "int32" and tiles.shape == (2, max_tiles(3 * m + 6, 5))
    assert tiles[0, :5].tolist() == [1, 1, 1, 3, 4] and tiles[1, :5].tolist() == [2 * m, m, 0, 0, 0]
    assert (tiles[:, 5:] == -1).all()
    assert multi_row_tiles([1, 1, 1]).shape == (2, 0)
    # a batch's tiles never outnumber the bound a graph of its (tokens, sequences) sizes its grid by
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lens = torch.randint(1, 3 * m, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        assert multi_row_tiles(lens).shape[1] <= max_tiles(sum(lens), len(lens))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_step_single_rows_by_the_decode_kernel(device, dtype, num_splits):
    # Decodes first, between and last; a one-token prompt (k = 1); a chunk continuing a cached prefix.
    lens_q = [1, 7, 1, 1, 20, 1]
    lens_k = [33, 7, 1, 70, 45, 17]
    check_mixed_step(lens_q, lens_k, 16, 4, 2, 32, dtype, device, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 16])
def test_mixed_step_gpu_bf16(head_dim, num_splits):
    # Qwen2.5-0.5B's heads (14 query, 2 KV): 200 decodes of random lengths around three prompt chunks.
    lens_q = [1] * 90 + [128] + [1] * 60 + [300, 77] + [1] * 50
    lens_k = [q if q > 1 and i % 2 else q + int(torch.randint(1, 3000, ())) for i, q in enumerate(lens_q)]
    check_mixed_step(lens_q, lens_k, 16, 14, 2, head_dim, torch.bfloat16, "cuda", num_splits)
