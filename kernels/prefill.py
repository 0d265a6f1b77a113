"""Prefill attention forward (FlashAttention-2 style) over packed varlen batches, optionally reading K/V
from a paged cache. One program computes BLOCK_M query rows of one head of one sequence. With
q_tiles (a serving step's), programs run over a list of (sequence, first row) tiles of PREFILL_TILE_M rows,
built on the host by `multi_row_tiles`: the one-row sequences (the step's decodes) are left to
kernels.decode.attend_single_rows, which reads each K/V row once per head group instead of once per head, and
the grid holds the prompt chunks' tiles only, not a q-block per sequence per the longest chunk (a CUDA graph's
grid is sized for its largest batch: 256 sequences x 24 q-blocks of programs that return at once cost more
than a 1536-token step's attention)."""
import math

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import hopper
from kernels.configs import PREFILL_CONFIGS, PREFILL_TILE_M, hopper_pays, prune_prefill_configs, tma_pays
from kernels.hopper_prefill import hopper_forward
from kernels.launches import CompiledLaunches, aligned
from kernels.tma import row_descriptor, tma_ok


def multi_row_tiles(seqlens_q, width: int | None = None) -> np.ndarray:
    """The q_tiles of a packed batch whose sequence i has seqlens_q[i] query rows: int32 [2, width], column j
    (sequence, first row) of a PREFILL_TILE_M-row tile of a sequence with more than one row, the tiles of the
    highest rows first (causal masking gives them the most keys); -1 pads to `width` (default: no padding)."""
    lens = np.asarray(seqlens_q, dtype=np.int64)
    multi = np.flatnonzero(lens > 1)
    counts = -(-lens[multi] // PREFILL_TILE_M)
    seqs = np.repeat(multi, counts)
    rows = (np.arange(len(seqs)) - np.repeat(np.cumsum(counts) - counts, counts)) * PREFILL_TILE_M
    order = np.argsort(-rows, kind="stable")
    tiles = np.full((2, len(seqs) if width is None else width), -1, dtype=np.int32)
    tiles[0, :len(seqs)], tiles[1, :len(seqs)] = seqs[order], rows[order]
    return tiles


def max_tiles(tokens: int, seqs: int) -> int:
    """The most tiles a batch of `tokens` query rows over `seqs` sequences can have: a CUDA graph's grid."""
    return -(-tokens // PREFILL_TILE_M) + min(seqs, tokens // 2)


@triton.jit
def sequence_span(cu_seqlens, batch):
    start = tl.load(cu_seqlens + batch)
    return start, tl.load(cu_seqlens + batch + 1) - start


@triton.jit
def query_block_keys(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      IS_CAUSAL: tl.constexpr):
    """Keys of query block start_m under bottom-right causal masking (query i sees keys j <= i + seqlen_k -
    seqlen_q): every row sees all of [0, unmasked_end); [unmasked_end, hi) is the diagonal band, up to the last
    row's horizon, that pays for the mask. Blocks past hi are never loaded."""
    if IS_CAUSAL:
        causal_offset = seqlen_k - seqlen_q
        last_row = tl.minimum(seqlen_q, (start_m + 1) * BLOCK_M) - 1
        hi = tl.maximum(tl.minimum(seqlen_k, last_row + causal_offset + 1), 0)
        full = tl.maximum(tl.minimum(seqlen_k, start_m * BLOCK_M + causal_offset + 1), 0)
    else:
        hi = seqlen_k
        full = seqlen_k
    return (full // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _attend_kv_range(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, tma_row, tma_col, block_table_row, offs_m,
                     offs_d, start_n, end_n, seqlen_k, causal_offset, qk_scale, stride_k_tok, stride_v_tok,
                     stride_k_blk, stride_v_blk, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PADDED: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                     USE_TMA: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Online softmax over keys [start_n, end_n). MASKED blocks pay for the length and causal masks; the
    unmasked stage is only called on blocks every query row fully sees. A TMA tile's keys past the sequence
    (the next sequence's, or zeros) are masked out of P like any other key past seqlen_k."""
    for n0 in range(start_n, end_n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seqlen_k
        if USE_TMA:
            k = desc_k.load([tma_row + n0, tma_col]).T
            v = desc_v.load([tma_row + n0, tma_col])
        else:
            if PAGED:
                blk = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
                k_rows = blk * stride_k_blk + (offs_n % PAGE_SIZE) * stride_k_tok
                v_rows = blk * stride_v_blk + (offs_n % PAGE_SIZE) * stride_v_tok
            else:  # offsets within one sequence fit int32; the int64 sequence start is already in k_base/v_base
                k_rows = offs_n * stride_k_tok
                v_rows = offs_n * stride_v_tok
            if MASKED or HEAD_DIM != HEAD_DIM_PADDED:
                d_ok = offs_d < HEAD_DIM
                k = tl.load(k_base + k_rows[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                            other=0.0)
                v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                            other=0.0)
            else:  # full block, unpadded head_dim, no masks
                k = tl.load(k_base + k_rows[None, :] + offs_d[:, None])
                v = tl.load(v_base + v_rows[:, None] + offs_d[None, :])
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = n_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if MASKED:  # a row that has seen no key yet keeps m = -inf; subtract 0 instead so nothing is NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=PREFILL_CONFIGS,
                 key=["HEAD_DIM", "IS_CAUSAL", "PAGED", "USE_TMA", "TILED", "seqlen_bucket"],
                 prune_configs_by={"early_config_prune": prune_prefill_configs})
# total_q (and an eager step's q_tiles row stride) change with every batch: specializing on them (== 1, divisible
# by 16) would compile new variants of a tuned config in the middle of serving, a second or more each.
@triton.jit(do_not_specialize=["total_q", "stride_tiles"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, desc_k, desc_v, out_ptr, lse_ptr, cu_seqlens_q, cu_seqlens_k, block_table,
                    q_tiles, stride_tiles, qk_scale, total_q, seqlen_bucket, group_size,
                    stride_q_tok, stride_q_h, stride_k_tok, stride_k_h, stride_k_blk,
                    stride_v_tok, stride_v_h, stride_v_blk, stride_o_tok, stride_o_h, stride_bt,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, USE_TMA: tl.constexpr,
                    TILED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    head = tl.program_id(1)
    if TILED:  # BLOCK_M == PREFILL_TILE_M: the tile is one q-block
        batch = tl.load(q_tiles + tl.program_id(0))
        if batch < 0:
            return
        start_m = tl.load(q_tiles + stride_tiles + tl.program_id(0)) // BLOCK_M
        q_start, seqlen_q = sequence_span(cu_seqlens_q, batch)
    else:
        # Highest q-blocks first: under causal masking they carry the most work, so they should not straggle.
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
        batch = tl.program_id(2)
        q_start, seqlen_q = sequence_span(cu_seqlens_q, batch)
        if start_m * BLOCK_M >= seqlen_q:
            return
    k_start, seqlen_k = sequence_span(cu_seqlens_k, batch)
    kv_head = head // group_size

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_h + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    if PAGED:
        k_base = k_ptr + kv_head * stride_k_h
        v_base = v_ptr + kv_head * stride_v_h
    else:
        k_base = k_ptr + k_start.to(tl.int64) * stride_k_tok + kv_head * stride_k_h
        v_base = v_ptr + k_start.to(tl.int64) * stride_v_tok + kv_head * stride_v_h
    block_table_row = block_table + batch.to(tl.int64) * stride_bt

    causal_offset = seqlen_k - seqlen_q
    unmasked_end, hi = query_block_keys(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    col = kv_head * HEAD_DIM
    acc, l_i, m_i = _attend_kv_range(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_start, col,
                                     block_table_row, offs_m, offs_d, 0, unmasked_end, seqlen_k, causal_offset,
                                     qk_scale, stride_k_tok, stride_v_tok, stride_k_blk, stride_v_blk,
                                     BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, PAGE_SIZE, PAGED, USE_TMA, False,
                                     IS_CAUSAL, DOT_PRECISION)
    acc, l_i, m_i = _attend_kv_range(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, k_start, col,
                                     block_table_row, offs_m, offs_d, unmasked_end, hi, seqlen_k, causal_offset,
                                     qk_scale, stride_k_tok, stride_v_tok, stride_k_blk, stride_v_blk,
                                     BLOCK_N, HEAD_DIM, HEAD_DIM_PADDED, PAGE_SIZE, PAGED, USE_TMA, True,
                                     IS_CAUSAL, DOT_PRECISION)

    # Rows that saw no key: out = 0, lse = -inf.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + head.to(tl.int64) * total_q + q_rows, lse, mask=m_ok)


_LAUNCHES = CompiledLaunches(_prefill_kernel)


def _next_pow2(n: int) -> int:  # triton.next_power_of_2 is a constexpr function: microseconds a call on this path
    return 1 << max(n - 1, 0).bit_length()


def flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       block_table=None, out=None, q_tiles=None):
    """Packed varlen forward. q [total_q, H, d]; k/v [total_k, H_k, d], or paged caches
    [num_blocks, block_size, H_k, d] with block_table. Returns (out like q, lse [H, total_q] float32).
    out: written in place when given. q_tiles (multi_row_tiles on the device): only the rows of those tiles
    are computed; the rows (and lse) of one-row sequences are left as they are. Inputs are assumed validated by
    kernels.interface. Unpaged whole batches of long sequences go to kernels.hopper_prefill on Hopper
    (kernels.configs.hopper_pays)."""
    total_q, nheads, head_dim = q.shape
    unpaged_whole = block_table is None and q_tiles is None
    if unpaged_whole and softmax_scale > 0 and hopper_pays("forward", head_dim, causal, max_seqlen_q) and \
            hopper.supported(q, k, v):  # the warp-specialized Gluon kernel, on sm_90
        return hopper_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              out=out)
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    paged, tiled = block_table is not None, q_tiles is not None
    if paged:
        strides_k = (k.stride(1), k.stride(2), k.stride(0))  # token, head, cache block
        strides_v = (v.stride(1), v.stride(2), v.stride(0))
        stride_bt, page_size = block_table.stride(0), k.shape[1]
    else:
        strides_k, strides_v = (k.stride(0), k.stride(1), 0), (v.stride(0), v.stride(1), 0)
        stride_bt, page_size = 0, 16
        block_table = cu_seqlens_k  # never read; any int32 tensor pointer will do
    tiles, stride_tiles = (q_tiles, q_tiles.stride(0)) if tiled else (cu_seqlens_q, 0)
    use_tma = not paged and tma_pays(head_dim, max_seqlen_k, "forward") and tma_ok(k, v)
    ints = (_next_pow2(max_seqlen_q), nheads // k.shape[-2], q.stride(0), q.stride(1), *strides_k,
            *strides_v, out.stride(0), out.stride(1), stride_bt)  # seqlen_bucket, group_size, strides
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, _next_pow2(head_dim)),
                      IS_CAUSAL=bool(causal), PAGED=paged, PAGE_SIZE=page_size, USE_TMA=use_tma, TILED=tiled,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    # total_q and stride_tiles are not specialized on (only typed: i32 below 2**31)
    key = (q.get_device(), q.dtype, ints, total_q < 2**31, stride_tiles < 2**31,
           aligned(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, tiles), *constexprs.values())
    config = _LAUNCHES.config(key)
    desc_k = desc_v = None
    if use_tma:  # a known config gets its tile now; a new key's tile is set by the configs' pre-hook
        rows = config.kwargs["BLOCK_N"] if config is not None else 16
        desc_k, desc_v = row_descriptor(k, rows), row_descriptor(v, rows)

    def grid(meta):
        if tiled:
            return tiles.shape[1], nheads, 1
        return -(-max_seqlen_q // meta["BLOCK_M"]), nheads, batch

    args = (q, k, v, desc_k if use_tma else k, desc_v if use_tma else v, out, lse, cu_seqlens_q, cu_seqlens_k,
            block_table, tiles, stride_tiles, softmax_scale * math.log2(math.e), total_q, *ints)
    _LAUNCHES.launch(key, grid, args, constexprs)
    return out, lse
