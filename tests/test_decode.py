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


# -- fewer launches per decode step (kernels.configs DECODE_MERGE_IN_SPLIT, kernels.decode.decode_attention_rope) --
@pytest.fixture
def merge_in_split(monkeypatch):
    from kernels import configs
    monkeypatch.setattr(configs, "DECODE_MERGE_IN_SPLIT", True)


def scratch_at_zero(name: str | None = "decode_split_counters") -> bool:
    """Whether scratch `name` exists (if named) and every buffer the kernels keep zero between launches is
    (kernels.configs.zeroed_scratch; on any device: the GPU's key is cuda:0, not the tests' "cuda")."""
    from kernels.configs import _ZEROED
    named = name is None or any(key[0] == name for key in _ZEROED)
    return named and all((c == 0).all() for buffers in _ZEROED.values() for c in buffers)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", [c for c in CASES if c[-1] != 1])
def test_merge_in_the_split_kernel(case, dtype, device, merge_in_split):
    """The last split program of each (sequence, KV head) merges: the reference's output, the counters back at 0
    (so the next launch, or graph replay, starts from 0), twice in a row; and for the decodes of a mixed step."""
    seqlens, block_size, nheads, nheads_k, head_dim, seqlen_q, num_splits = case
    tensors = make_paged(len(seqlens), seqlens, block_size, nheads, nheads_k, head_dim, seqlen_q, dtype, device)
    for _ in range(2):
        check(*tensors, num_splits)
        assert scratch_at_zero(None)  # (num_splits 0 may choose one split: no merge)
    check_mixed_step([1, 7, 1], [40, 30, 1], 16, 8, 2, 32, dtype, device, num_splits=3)
    assert scratch_at_zero()


def rope_table(head_dim: int, positions: int, device) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().to(device)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, d] (float32, its halves rounded) by each row's cos/sin [..., d / 2]: the half-split layout."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("splits", [0, 1, 4])  # 0: whole q/k/v, else float32 partial sums over K
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits,merge", [(1, False), (3, False), (5, True), (0, True)])
def test_decode_attention_rope_rotates_writes_and_attends(splits, dtype, num_splits, merge, device, monkeypatch):
    """Against the unfused order: q, k, v summed and rounded, q and k rotated and rounded, k and v written into the
    new token's slot, attention over the cache. A sequence whose slot is -1 (a graph's padding) writes nothing."""
    from kernels import configs
    from kernels.decode import decode_attention_rope

    monkeypatch.setattr(configs, "DECODE_MERGE_IN_SPLIT", merge)
    case = RopeCase([37, 1, 90, 16], 16, 8, 2, 32, splits, dtype, device)
    if not splits:  # q and k as the q/k norms give them (tensors of their own), v a view of the projection
        case.q, case.k = case.q.contiguous(), case.k.contiguous()
    want = case.expected()
    out = decode_attention_rope(case.q, case.k, case.v, case.positions, case.cos_sin, case.slots, case.k_cache,
                                case.v_cache, case.lens, case.table, case.head_dim ** -0.5, num_splits)
    case.check(out, *want)


class RopeCase:
    """A decode step's q/k/v of each sequence's new token (the last of seqlens; the last sequence a graph's padding:
    slot -1), its paged cache, and what the unfused kernels make of them."""

    def __init__(self, seqlens, block_size, nheads, nheads_k, head_dim, splits, dtype, device):
        self.nheads, self.nheads_k, self.head_dim, self.splits, self.dtype = nheads, nheads_k, head_dim, splits, dtype
        batch = len(seqlens)
        _, self.k_cache, self.v_cache, self.lens, self.table = make_paged(batch, seqlens, block_size, nheads,
                                                                          nheads_k, head_dim, 1, dtype, device)
        shape = (splits,) if splits else ()
        self.qkv = torch.randn(*shape, batch, (nheads + 2 * nheads_k) * head_dim,
                               dtype=torch.float32 if splits else dtype, device=device)
        self.q, self.k, self.v = (t.unflatten(-1, (-1, head_dim)) for t in self.qkv.split(
            [nheads * head_dim, nheads_k * head_dim, nheads_k * head_dim], dim=-1))
        self.positions = self.lens - 1
        rows = torch.arange(batch, device=device)
        self.slots = self.table[rows, self.positions // block_size] * block_size + self.positions % block_size
        self.slots[-1] = -1
        self.cos_sin = rope_table(head_dim, 8192, device)

    def expected(self):
        dtype, d = self.dtype, self.head_dim
        whole = [(t.sum(0) if self.splits else t.float()).to(dtype).float() for t in (self.q, self.k, self.v)]
        cos, sin = self.cos_sin[self.positions.long()].chunk(2, dim=-1)
        q_ref, k_new = (rotated(t, cos, sin).to(dtype) for t in whole[:2])
        k_ref, v_ref = self.k_cache.clone(), self.v_cache.clone()
        for b in range(len(self.slots) - 1):  # not the padding row's
            k_ref.view(-1, self.nheads_k, d)[self.slots[b]] = k_new[b]
            v_ref.view(-1, self.nheads_k, d)[self.slots[b]] = whole[2][b].to(dtype)
        ref = paged_attention_ref(q_ref.unsqueeze(1).double(), k_ref.double(), v_ref.double(), self.lens,
                                  self.table).squeeze(1)
        return ref, k_ref, v_ref

    def check(self, out, ref, k_ref, v_ref):
        # In float32 the rotation's products are not rounded apart, and the kernel may fuse them (an H200 run read
        # 0.14% of K's values an ulp or so off with the merge in the split compiled in): float32 K within 1e-5
        # instead of mostly equal.
        half = self.dtype != torch.float32
        assert (self.v_cache == v_ref).all() and (not half or (self.k_cache == k_ref).float().mean() > 0.999)
        tol = 2e-3 if half else 1e-5
        assert torch.allclose(self.k_cache.float(), k_ref.float(), atol=tol, rtol=tol)
        assert out.dtype == self.dtype and rel_err(out[:-1], ref[:-1]) < 1e-2
        assert scratch_at_zero(None)  # (with or without the merge in the split)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group,num_splits", [(64, 7, 16), (64, 4, 16), (128, 8, 5)])
def test_one_attention_kernel_gpu_bf16_in_a_graph(head_dim, group, num_splits, merge_in_split):
    """decode_attention_rope on float32 partial sums with the splits merged in the split kernel, captured in a CUDA
    graph and replayed on new q/k/v, lengths and slots: each replay writes and attends as the unfused kernels."""
    from kernels.decode import decode_attention_rope

    case = RopeCase([1, 4097, 333, 2048, 1500, 17, 700], 16, 2 * group, 2, head_dim, 4, torch.bfloat16, "cuda")
    args = lambda: (case.q, case.k, case.v, case.positions, case.cos_sin, case.slots, case.k_cache,  # noqa: E731
                    case.v_cache, case.lens, case.table, head_dim ** -0.5, num_splits)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_attention_rope(*args())  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_rope(*args())
    for lens in ([2, 4000, 334, 1, 1501, 18, 700], [3000, 12, 1, 2049, 64, 17, 5]):
        case.qkv.normal_()
        case.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.positions.copy_(case.lens - 1)
        rows = torch.arange(len(lens), device="cuda")
        case.slots.copy_(case.table[rows, case.positions // 16] * 16 + case.positions % 16)
        case.slots[-1] = -1
        want = case.expected()
        graph.replay()
        case.check(out, *want)
