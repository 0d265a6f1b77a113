"""Split-KV (FlashDecoding) attention of a few new query tokens over a paged KV cache.

Phase 1: program (batch, kv head, split) attends all query heads of its KV head group (and all seqlen_q rows)
to one chunk of the sequence's keys, so each K/V row is read from HBM once per group. Rows of a KV tile are
gathered through the block table one by one, so a tile may span several cache blocks. With one split it writes
the final output; otherwise it writes a partial output and its log-sum-exp, and phase 2 merges the splits.
Chunks are sized from each sequence's own length on the device, and the split count from shapes alone, so the
launcher never reads a device tensor on the host: it is free of synchronization and can be captured in a CUDA graph.

attend_single_rows runs the same kernels on the one-row sequences of a packed varlen batch (the decodes of a step
that also carries prompt chunks), in place in the step's output, so that the prefill kernel, which would spend a
BLOCK_M-row tile and a pass over the keys per query head on each of them, only computes the multi-row sequences.

Fewer launches for a decode step (kernels.configs switches, off: measured within a few percent, see there):
- merge in the split kernel (DECODE_MERGE_IN_SPLIT): each program counts itself done on its (sequence, KV head)'s
  counter after writing its partials; the last one merges them and puts the counter back to 0, so the counters are
  zero between launches (and graph replays) without a reset kernel;
- decode_attention_rope: the projection's q, k and v of each sequence's new token (float32 partial sums, as
  kernels.elementwise.apply_rope_ takes them) are added up and rotated in the split kernel; the program whose keys
  include the new token writes its K/V into the cache before reading its keys. The RoPE kernel's launch goes.
"""
import math

import torch
import triton
import triton.language as tl

from kernels import configs
from kernels.configs import (
    DECODE_BLOCK_N,
    DECODE_NUM_STAGES,
    DECODE_NUM_WARPS,
    gdc_launch_dependents,
    gdc_wait,
    pdl_launch,
    zeroed_scratch,
)
from kernels.elementwise import _summed, _zero_columns
from kernels.lora import _shrink_chunk, _shrink_store, shrink_chunks_args

LOG2E = 1.4426950408889634


@triton.jit
def _roped(ptr, stride_split, mask, d, cos, sin, HALF: tl.constexpr, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """The head rows at ptr (SPLITS partial sums stride_split apart) rotated by cos/sin, columns d of the head: the
    half-split layout, x1 cos - x2 sin then x2 cos + x1 sin, each half rounded as kernels.elementwise rounds it."""
    x = _summed(ptr + d, stride_split, mask, SPLITS, dtype)
    other = _summed(ptr + (d + HALF) % (2 * HALF), stride_split, mask, SPLITS, dtype)
    return (x * cos + tl.where(d < HALF, -other, other) * sin).to(dtype)


@triton.jit
def _decode_split_kernel(Q, KCache, VCache, CacheSeqlens, BlockTable, QRows, Out, PartialOut, PartialLse,
                         Counters, scale_log2,
                         stride_qb, stride_qs, stride_qh,
                         stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh,
                         stride_btb,
                         stride_ob, stride_os, stride_oh,
                         KNew, VNew, Positions, CosSin, SlotMapping, stride_split, stride_knb, stride_knh,
                         stride_vnb, stride_vnh, stride_cs,
                         GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                         VARLEN_Q: tl.constexpr, ROPE_SPLITS: tl.constexpr, MERGE_IN_SPLIT: tl.constexpr,
                         SPLITS_PADDED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/configs.py
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    nheads_k = tl.num_programs(1)
    seqlen = tl.load(CacheSeqlens + b)
    if VARLEN_Q:  # sequence b's one query row is row QRows[b] of a packed batch; seqlen 0: not ours, leave it
        if seqlen == 0:
            return
        token = tl.load(QRows + b).to(tl.int64)
    else:
        token = b

    # Rows are (head in group, query position); keys this split sees: [start, end).
    rows = tl.arange(0, BLOCK_M)
    g = rows // SEQLEN_Q
    qi = rows % SEQLEN_Q
    row_ok = rows < GROUP * SEQLEN_Q
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PADDED)
    d_ok = d < HEAD_DIM
    chunk = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)
    if ROPE_SPLITS > 0:  # decode_attention_rope: one query row, q/k/v the projection's partial sums
        dtype = KCache.dtype.element_ty
        half: tl.constexpr = HEAD_DIM // 2
        at = tl.load(Positions + b).to(tl.int64) * stride_cs + d[None, :] % half
        cos = tl.load(CosSin + at)
        sin = tl.load(CosSin + at + half)
        q = _roped(Q + token * stride_qb + head[:, None] * stride_qh, stride_split, row_ok[:, None], d[None, :],
                   cos, sin, half, ROPE_SPLITS, dtype)
        slot = tl.load(SlotMapping + b).to(tl.int64)
        if (start <= seqlen - 1) & (seqlen - 1 < end) & (slot >= 0):  # the new token's keys are this program's
            one = tl.zeros([1], tl.int32)[:, None]
            whole = d[None, :] < HEAD_DIM
            k_new = _roped(KNew + token * stride_knb + kv_head * stride_knh + one, stride_split, whole, d[None, :],
                           cos, sin, half, ROPE_SPLITS, dtype)
            v_new = _summed(VNew + token * stride_vnb + kv_head * stride_vnh + d[None, :], stride_split, whole,
                            ROPE_SPLITS, dtype)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(KCache + block * stride_kb + offset * stride_kt + kv_head * stride_kh + d[None, :], k_new)
            tl.store(VCache + block * stride_vb + offset * stride_vt + kv_head * stride_vh + d[None, :], v_new)
            tl.debug_barrier()  # the stores land before this program's threads read the row back
    else:
        q = tl.load(Q + token * stride_qb + qi[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    last_key = seqlen - SEQLEN_Q + qi  # bottom-right causal: row qi sees keys <= last_key

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + cols
        n_ok = n < end
        block = tl.load(BlockTable + b * stride_btb + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        if HEAD_DIM == HEAD_DIM_PADDED:  # no head_dim mask, so loads stay 16-byte vectors
            kv_mask = n_ok[:, None]
        else:
            kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KCache + block[:, None] * stride_kb + offset[:, None] * stride_kt + kv_head * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VCache + block[:, None] * stride_vb + offset[:, None] * stride_vt + kv_head * stride_vh
                    + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = n_ok[None, :]
        if IS_CAUSAL:
            visible = visible & (n[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    out_at = Out + token * stride_ob + qi[:, None] * stride_os + head[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_at, out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        # Partials laid out [batch, nheads, seqlen_q, NUM_SPLITS, (HEAD_DIM)], contiguous.
        part = ((b * nheads_k * GROUP + head) * SEQLEN_Q + qi) * NUM_SPLITS + split
        tl.store(PartialOut + part[:, None] * HEAD_DIM + d[None, :], out, mask=out_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(PartialLse + part, lse, mask=row_ok)
        if MERGE_IN_SPLIT:
            # Every thread's partials are written before the count (a release at GPU scope); the last program to
            # count acquires them all, reading past L1 (other SMs wrote them).
            tl.debug_barrier()
            counter = Counters + b * nheads_k + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                first = part - split
                sp = tl.arange(0, SPLITS_PADDED)
                both = row_ok[:, None] & (sp[None, :] < NUM_SPLITS)
                lses = tl.load(PartialLse + first[:, None] + sp[None, :], mask=both, other=float("-inf"),
                               cache_modifier=".cg")
                parts = tl.load(PartialOut + (first[:, None, None] + sp[None, :, None]) * HEAD_DIM
                                + d[None, None, :], mask=both[:, :, None] & d_ok[None, None, :], other=0.0,
                                cache_modifier=".cg")
                out = _merged(lses, parts)
                tl.store(out_at, out.to(Out.dtype.element_ty), mask=out_mask)
                tl.store(counter, 0)


@triton.jit
def _merged(lse, parts):
    """The splits' partial outputs [..., splits, (d)] weighed by their log2-sum-exps [..., splits]: empty splits
    (-inf) weigh 0, and a row no split saw is 0."""
    m = tl.max(lse, -1)
    w = tl.exp2(lse - tl.expand_dims(tl.where(m == float("-inf"), 0.0, m), -1))
    total = tl.sum(w, -1)
    return tl.sum(parts * tl.expand_dims(w, -1), -2) / tl.expand_dims(tl.where(total > 0.0, total, 1.0), -1)


@triton.jit
def _decode_merge_kernel(PartialOut, PartialLse, Out, CacheSeqlens, QRows, nheads,
                         stride_ob, stride_os, stride_oh,
                         SEQLEN_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PADDED: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, VARLEN_Q: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)  # over batch * nheads * seqlen_q, the partials' order
    qi = row % SEQLEN_Q
    head = (row // SEQLEN_Q) % nheads
    b = row // (SEQLEN_Q * nheads)
    if VARLEN_Q:
        if tl.load(CacheSeqlens + b) == 0:
            return
        token = tl.load(QRows + b).to(tl.int64)
    else:
        token = b
    sp = tl.arange(0, SPLITS_PADDED)
    d = tl.arange(0, HEAD_DIM_PADDED)
    lse = tl.load(PartialLse + row * NUM_SPLITS + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    mask = (sp[:, None] < NUM_SPLITS) & (d[None, :] < HEAD_DIM)
    parts = tl.load(PartialOut + (row * NUM_SPLITS + sp[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = _merged(lse, parts)
    tl.store(Out + token * stride_ob + qi * stride_os + head * stride_oh + d, out.to(Out.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _decode_merge_shrinks_kernel(PartialOut, PartialLse, Out, stride_ob, nheads, LW, stride_lw, SCALES, TILES, T,
                                 stride_t, A0, A1, A2, NUM_SPLITS: tl.constexpr, SPLITS_PADDED: tl.constexpr,
                                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
                                 TILES_PADDED: tl.constexpr, TILE_ROWS: tl.constexpr,
                                 RANK: tl.constexpr, RANK_CHUNK: tl.constexpr, SLOTS: tl.constexpr,
                                 SLOTS_PADDED: tl.constexpr, PDL: tl.constexpr):
    """The merge of one new token per sequence (seqlen_q 1) that also computes the LoRA shrinks of the projection
    reading the output (o's), as kernels.elementwise's norms do for theirs: program (b, chunk) merges all heads of
    sequence b's row (nheads * HEAD_DIM values, one vector), chunk 0 stores it, and each computes one chunk of the
    row's shrinks (kernels.lora._shrink_chunk, A read before the wait); chunks of a row of no slot write zeros."""
    b, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = tl.arange(0, BLOCK)
    width = nheads * HEAD_DIM
    slot, scale, a, t_cols = _shrink_chunk(LW, stride_lw, SCALES, TILES, b, chunk, c, width, A0, A1, A2, NUM_TILES,
                                           TILES_PADDED, TILE_ROWS, RANK, RANK_CHUNK, SLOTS)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if (chunk == 0) | (slot >= 0):
        sp = tl.arange(0, SPLITS_PADDED)
        ok = c < width
        # [splits, the row's values]: partials [batch, nheads, 1, splits, (HEAD_DIM)], contiguous along the row
        at = (b * nheads + c // HEAD_DIM)[None, :] * NUM_SPLITS + sp[:, None]
        mask = ok[None, :] & (sp[:, None] < NUM_SPLITS)
        lse = tl.load(PartialLse + at, mask=mask, other=float("-inf"))
        parts = tl.load(PartialOut + at * HEAD_DIM + (c % HEAD_DIM)[None, :], mask=mask, other=0.0)
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[None, :])
        total = tl.sum(w, 0)
        y = (tl.sum(parts * w, 0) / tl.where(total > 0.0, total, 1.0)).to(Out.dtype.element_ty)
        if chunk == 0:
            tl.store(Out + b * stride_ob + c, y, mask=ok)
        _shrink_store(y.to(tl.float32), slot, scale, a, t_cols, T, b, stride_t, RANK, SLOTS, SLOTS_PADDED)
    elif SLOTS > 0:
        _zero_columns(T, b, stride_t, t_cols, RANK, RANK_CHUNK, SLOTS, SLOTS_PADDED)


_SM_COUNT = {}
HOST_BLIND_MAX_SPLITS = 16  # the cap when the host does not know the context length (see choose_num_splits)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small count still exercises several splits
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def choose_num_splits(batch: int, nheads_k: int, device: torch.device, max_seqlen: int | None = None,
                      block_n: int = DECODE_BLOCK_N) -> int:
    """The split-KV policy: enough splits for about two programs per SM, each keeping at least two KV tiles to
    amortize its q load and the merge. max_seqlen None: the host does not know the context (a CUDA graph replays
    one split count for every length, and the engine never reads lengths back), so splits follow occupancy alone,
    capped lower because splits past a short context run empty."""
    by_occupancy = -(-2 * sm_count(device) // (batch * nheads_k))
    if max_seqlen is None:
        return max(1, min(by_occupancy, HOST_BLIND_MAX_SPLITS))
    by_length = max(1, max_seqlen // (2 * block_n))
    return max(1, min(by_occupancy, by_length, 64))


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, num_splits):
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [batch, seqlen_q, nheads, head_dim] and k/v caches [num_blocks, block_size, "
                         f"nheads_k, head_dim], got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    batch, seqlen_q, nheads, head_dim = q.shape
    _, block_size, nheads_k, head_dim_k = k_cache.shape
    if head_dim_k != head_dim or head_dim > 256 or head_dim < 1:
        raise ValueError(f"head_dim must match between q and the cache and be <= 256, got {head_dim}, {head_dim_k}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q and the caches must share one of fp16/bf16/fp32, got {q.dtype}, {k_cache.dtype}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be int32 [batch={batch}]")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be int32 [batch={batch}, max_blocks]")
    if not (q.device == k_cache.device == v_cache.device == cache_seqlens.device == block_table.device):
        raise ValueError("all tensors must be on one device")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_table.stride(1) != 1:
        raise ValueError("q, the caches and block_table need a unit-stride last dimension")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0, got {num_splits}")


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True,
                            num_splits=0):
    """q [batch, seqlen_q, nheads, head_dim], the last seqlen_q tokens of each cached sequence; paged caches
    [num_blocks, block_size, nheads_k, head_dim]; cache_seqlens int32 [batch]; block_table int32
    [batch, max_blocks]. num_splits=0 picks a split count from the shapes (the block table's width bounds the
    context); any num_splits keeps the call free of host synchronization. Returns out like q."""
    _validate(q, k_cache, v_cache, cache_seqlens, block_table, num_splits)
    out = torch.empty_like(q)
    if q.shape[0] and q.shape[1]:
        _launch(q, k_cache, v_cache, cache_seqlens, block_table, out, None, softmax_scale, causal, num_splits)
    return out


def attend_single_rows(q, k_cache, v_cache, q_rows, cache_seqlens, block_table, out, softmax_scale, num_splits):
    """The one-row sequences of a packed varlen batch, in place: for each sequence b with cache_seqlens[b] > 0,
    row q_rows[b] of q [total_q, nheads, head_dim] (its newest token, the last of its cache_seqlens[b] cached
    keys) attends all its keys, into the same row of out. Rows of sequences with cache_seqlens[b] == 0 are left
    as they are. q_rows: int32 [>= batch], e.g. cu_seqlens_q. Inputs are assumed valid (the engine's runner
    builds them); num_splits > 0, fixed, so the call can be captured in a CUDA graph."""
    if cache_seqlens.shape[0]:
        _launch(q.unsqueeze(1), k_cache, v_cache, cache_seqlens, block_table, out.unsqueeze(1), q_rows,
                softmax_scale, True, num_splits)


def decode_attention_rope(q, k, v, positions, cos_sin, slot_mapping, k_cache, v_cache, cache_seqlens, block_table,
                          softmax_scale, num_splits):
    """A decode step's attention with its rotary embedding and cache write in the same launch: q [batch, heads, d],
    k and v [batch, heads_k, d] of each sequence's new token, unrotated, or float32 partial sums [splits, ...] of
    them (kernels.decode_linear partials, strided alike over the splits); positions, cos_sin and slot_mapping as
    kernels.elementwise.apply_rope_ takes them. Writes rotated k and v into each token's cache slot (-1: none), which
    is the last of its sequence's cache_seqlens[b] keys, and returns the attention output [batch, heads, d] of the
    caches' dtype. num_splits as flash_attn_with_kvcache takes it."""
    *splits, batch, heads, head_dim = q.shape
    several = bool(splits) and splits[0] > 1  # a single split's stride over splits is arbitrary: not read then
    if (head_dim & (head_dim - 1) or head_dim < 16 or num_splits < 0 or any(t.stride(-1) != 1 for t in (q, k, v))
            or several and not q.stride(0) == k.stride(0) == v.stride(0)):
        raise ValueError(f"need a power-of-two head_dim >= 16 with unit stride, partial sums strided alike and "
                         f"num_splits >= 0, got {tuple(q.shape)}, {k.stride()}, {v.stride()}, {num_splits}")
    first = (lambda t: t[0]) if splits else (lambda t: t)
    out = torch.empty(batch, 1, heads, head_dim, dtype=k_cache.dtype, device=q.device)
    if batch:
        _launch(first(q).unsqueeze(1), k_cache, v_cache, cache_seqlens, block_table, out, None, softmax_scale, True,
                num_splits, rope=(first(k), first(v), positions, cos_sin, slot_mapping,
                                  q.stride(0) if several else 0, splits[0] if splits else 1))
    return out.squeeze(1)


def decode_attention_shrinks(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits,
                             shrinks) -> torch.Tensor:
    """flash_attn_with_kvcache of one new token per sequence, q [batch, heads, d], whose merge also computes the LoRA
    shrinks of the projection that reads the output (o's; shrinks: (slot weights, scales, tiles, rank, [A offset]),
    as kernels.elementwise.rms_norm_shrinks takes them), in kernels.lora's columns layout: returns t [batch, heads *
    d + slots * rank], the output in its first heads * d columns (o's shrink launch saved). num_splits > 1: the
    splits' merge is a launch of its own (not kernels.configs.DECODE_MERGE_IN_SPLIT)."""
    batch, heads, head_dim = q.shape
    if num_splits < 2:
        raise ValueError(f"the shrinks come from the splits' merge: num_splits must be > 1, got {num_splits}")
    out, t, chunks, lora = shrink_chunks_args(q.reshape(batch, heads * head_dim), shrinks, columns=True)
    del lora["SHRINKS"]
    if batch:
        _launch(q.unsqueeze(1), k_cache, v_cache, cache_seqlens, block_table, out.unflatten(1, (1, heads, head_dim)),
                None, softmax_scale, True, num_splits, merge_shrinks=(chunks, lora))
    return t


def _launch(q, k_cache, v_cache, cache_seqlens, block_table, out, q_rows, softmax_scale, causal, num_splits,
            rope=None, merge_shrinks=None):
    """q and out [rows, seqlen_q, nheads, head_dim]: row b of sequence b, or row q_rows[b] when given. rope: (k, v,
    positions, cos_sin, slot_mapping, split stride, splits) of decode_attention_rope, q then holding partial sums.
    merge_shrinks: (chunks per row, arguments) of decode_attention_shrinks' merge."""
    batch, seqlen_q, nheads, head_dim = cache_seqlens.shape[0], q.shape[1], q.shape[2], q.shape[3]
    block_size, nheads_k = k_cache.shape[1], k_cache.shape[2]
    group = nheads // nheads_k
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    # Keep a pipeline stage of K+V tiles near 64 KB of shared memory.
    block_n = DECODE_BLOCK_N // (head_dim_padded // 128 if head_dim_padded > 128 else 1)
    block_n = max(16, block_n // 2 if k_cache.dtype == torch.float32 else block_n)
    if num_splits == 0:
        max_seqlen = block_table.shape[1] * block_size
        num_splits = choose_num_splits(batch, nheads_k, q.device, max_seqlen, block_n)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if num_splits > 1:
        partial_out = torch.empty(batch, nheads, seqlen_q, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(batch, nheads, seqlen_q, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = out  # unused
    varlen = q_rows is not None
    q_rows = q_rows if varlen else cache_seqlens  # never read unless varlen
    merge_in_split = configs.DECODE_MERGE_IN_SPLIT and num_splits > 1 and merge_shrinks is None
    counters = zeroed_scratch("decode_split_counters", q.device, batch * nheads_k) if merge_in_split \
        else cache_seqlens
    k_new, v_new, positions, cos_sin, slots, stride_split, rope_splits = rope or (q, q, q_rows, q, q_rows, 0, 0)
    _decode_split_kernel[(batch, nheads_k, num_splits)](
        q, k_cache, v_cache, cache_seqlens, block_table, q_rows, out, partial_out, partial_lse,
        counters, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        k_new, v_new, positions, cos_sin, slots, stride_split, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), cos_sin.stride(0) if rope else 0,
        GROUP=group, SEQLEN_Q=seqlen_q, NUM_SPLITS=num_splits, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded, BLOCK_M=max(16, triton.next_power_of_2(group * seqlen_q)),
        BLOCK_N=block_n, IS_CAUSAL=causal, VARLEN_Q=varlen, ROPE_SPLITS=rope_splits, MERGE_IN_SPLIT=merge_in_split,
        SPLITS_PADDED=triton.next_power_of_2(num_splits), num_warps=DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES, **pdl_launch(q.device),
    )
    if merge_shrinks is not None:
        chunks, lora = merge_shrinks
        _decode_merge_shrinks_kernel[(batch, chunks)](
            partial_out, partial_lse, out, out.stride(0), nheads, **lora, NUM_SPLITS=num_splits,
            SPLITS_PADDED=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            BLOCK=triton.next_power_of_2(nheads * head_dim), num_warps=4, **pdl_launch(q.device))
    elif num_splits > 1 and not merge_in_split:
        _decode_merge_kernel[(batch * nheads * seqlen_q,)](
            partial_out, partial_lse, out, cache_seqlens, q_rows, nheads,
            out.stride(0), out.stride(1), out.stride(2),
            SEQLEN_Q=seqlen_q, NUM_SPLITS=num_splits, SPLITS_PADDED=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), VARLEN_Q=varlen, num_warps=4,
            **pdl_launch(q.device),
        )
