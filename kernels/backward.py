"""FlashAttention-2 backward over packed varlen batches (GQA, bottom-right causal).

Three kernels: D = rowsum(dO * O); one program per (K/V block, KV head) accumulates dK, dV over every query
head of its group while streaming Q/dO blocks (P recomputed from lse, exp2 domain); one program per
(Q block, head) accumulates dQ while streaming K/V. No atomics anywhere, so the backward is deterministic
whatever `deterministic` says (the flag is accepted for API compatibility).
"""

import torch
import triton
import triton.language as tl

from kernels import hopper
from kernels.configs import BACKWARD_DKDV, BACKWARD_DQ, hopper_pays, tma_pays
from kernels.hopper_backward import hopper_backward
from kernels.prefill import query_block_keys, sequence_span
from kernels.tma import row_descriptor, tma_ok

LOG2E = 1.4426950408889634


@triton.jit
def _preprocess_kernel(out_ptr, do_ptr, delta_ptr, total_q, stride_o_tok, stride_o_h, stride_do_tok, stride_do_h,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_M: tl.constexpr):
    head = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (rows < total_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_h + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + rows[:, None] * stride_do_tok + head * stride_do_h + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + head.to(tl.int64) * total_q + rows, delta, mask=rows < total_q)


@triton.jit
def _load_rows(base, rows, stride, offs_d, row_ok, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """[len(rows), HEAD_DIM_PADDED] tile; masks only what can be out of range."""
    ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if CHECK_ROWS:
        return tl.load(ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM != HEAD_DIM_PADDED:
        return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _dkdv_q_range(dk, dv, k, v, q_base, do_base, desc_q, desc_do, tma_row, tma_col, lse_base, delta_base, offs_n,
                  offs_d, start_m, end_m, seqlen_q, causal_offset, qk_scale, stride_q_tok, stride_do_tok,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dK, dV of one K/V block over query rows [start_m, end_m) of one head (transposed tiles:
    keys on rows, queries on columns). Rows past the sequence get lse = +inf, so whatever a TMA tile holds there
    (the next sequence, or zeros) contributes nothing."""
    for m0 in range(start_m, end_m, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seqlen_q
        if USE_TMA:
            q = desc_q.load([tma_row + m0, tma_col])
            do = desc_do.load([tma_row + m0, tma_col])
        else:
            q = _load_rows(q_base, offs_m, stride_q_tok, offs_d, m_ok, HEAD_DIM, HEAD_DIM_PADDED, MASKED)
            do = _load_rows(do_base, offs_m, stride_do_tok, offs_d, m_ok, HEAD_DIM, HEAD_DIM_PADDED, MASKED)
        if MASKED:  # +inf lse zeroes P for rows past the sequence and rows that saw no key
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED and IS_CAUSAL:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_offset, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, desc_q, desc_do, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q,
                 cu_seqlens_k,
                 qk_scale, softmax_scale, total_q, group_size,
                 stride_q_tok, stride_q_h, stride_k_tok, stride_k_h, stride_v_tok, stride_v_h,
                 stride_do_tok, stride_do_h, stride_dk_tok, stride_dk_h, stride_dv_tok, stride_dv_h,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    k_start, seqlen_k = sequence_span(cu_seqlens_k, batch)
    if start_n * BLOCK_N >= seqlen_k:
        return
    q_start, seqlen_q = sequence_span(cu_seqlens_q, batch)

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    n_ok = offs_n < seqlen_k
    k_rows = (k_start + offs_n).to(tl.int64)
    k = _load_rows(k_ptr + kv_head * stride_k_h, k_rows, stride_k_tok, offs_d, n_ok, HEAD_DIM, HEAD_DIM_PADDED, True)
    v = _load_rows(v_ptr + kv_head * stride_v_h, k_rows, stride_v_tok, offs_d, n_ok, HEAD_DIM, HEAD_DIM_PADDED, True)

    # Query i sees key j iff i >= j - causal_offset: rows before the block's first key see none of it (skipped),
    # rows from its last key's horizon on see all of it (unmasked); the band in between pays for the mask.
    causal_offset = seqlen_k - seqlen_q
    if IS_CAUSAL:
        lo = tl.minimum(tl.maximum(start_n * BLOCK_N - causal_offset, 0), seqlen_q)
        lo = (lo // BLOCK_M) * BLOCK_M
        full = tl.minimum(tl.maximum((start_n + 1) * BLOCK_N - 1 - causal_offset, lo), seqlen_q)
        band_end = tl.minimum(lo + tl.cdiv(full - lo, BLOCK_M) * BLOCK_M, seqlen_q)
    else:
        lo = 0
        band_end = 0
    unmasked_end = band_end + ((seqlen_q - band_end) // BLOCK_M) * BLOCK_M

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PADDED], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PADDED], dtype=tl.float32)
    q_off = q_start.to(tl.int64)
    for h in range(0, group_size):  # GQA: the K/V head's gradient sums over its query heads
        head = kv_head * group_size + h
        q_base = q_ptr + q_off * stride_q_tok + head * stride_q_h
        do_base = do_ptr + q_off * stride_do_tok + head * stride_do_h
        lse_base = lse_ptr + head.to(tl.int64) * total_q + q_off
        delta_base = delta_ptr + head.to(tl.int64) * total_q + q_off
        col = head * HEAD_DIM
        dk, dv = _dkdv_q_range(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_start, col, lse_base, delta_base,
                               offs_n, offs_d, lo, band_end, seqlen_q, causal_offset, qk_scale, stride_q_tok,
                               stride_do_tok, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, True, IS_CAUSAL, DOT_PRECISION,
                               USE_TMA)
        dk, dv = _dkdv_q_range(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_start, col, lse_base, delta_base,
                               offs_n, offs_d, band_end, unmasked_end, seqlen_q, causal_offset, qk_scale,
                               stride_q_tok, stride_do_tok, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, False, IS_CAUSAL,
                               DOT_PRECISION, USE_TMA)
        dk, dv = _dkdv_q_range(dk, dv, k, v, q_base, do_base, desc_q, desc_do, q_start, col, lse_base, delta_base,
                               offs_n, offs_d, unmasked_end, seqlen_q, seqlen_q, causal_offset, qk_scale,
                               stride_q_tok, stride_do_tok, BLOCK_M, HEAD_DIM, HEAD_DIM_PADDED, True, IS_CAUSAL,
                               DOT_PRECISION, USE_TMA)

    mask = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(dk_ptr + k_rows[:, None] * stride_dk_tok + kv_head * stride_dk_h + offs_d[None, :],
             (dk * softmax_scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + k_rows[:, None] * stride_dv_tok + kv_head * stride_dv_h + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dq_kv_range(dq, q, do, lse, delta, k_base, v_base, desc_k, desc_v, tma_row, tma_col, offs_m, offs_d, start_n,
                 end_n, seqlen_k, causal_offset, qk_scale, stride_k_tok, stride_v_tok, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, MASKED: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    for n0 in range(start_n, end_n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seqlen_k
        if USE_TMA:  # keys past the sequence are masked out of P below, whatever the tile holds there
            k = desc_k.load([tma_row + n0, tma_col])
            v = desc_v.load([tma_row + n0, tma_col])
        else:
            k = _load_rows(k_base, offs_n, stride_k_tok, offs_d, n_ok, HEAD_DIM, HEAD_DIM_PADDED, MASKED)
            v = _load_rows(v_base, offs_n, stride_v_tok, offs_d, n_ok, HEAD_DIM, HEAD_DIM_PADDED, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            visible = n_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, desc_k, desc_v, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q, cu_seqlens_k,
               qk_scale, softmax_scale, total_q, group_size,
               stride_q_tok, stride_q_h, stride_k_tok, stride_k_h, stride_v_tok, stride_v_h,
               stride_do_tok, stride_do_h, stride_dq_tok, stride_dq_h,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest causal blocks first
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q = sequence_span(cu_seqlens_q, batch)
    if start_m * BLOCK_M >= seqlen_q:
        return
    k_start, seqlen_k = sequence_span(cu_seqlens_k, batch)
    kv_head = head // group_size

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    m_ok = offs_m < seqlen_q
    q_rows = (q_start + offs_m).to(tl.int64)
    q = _load_rows(q_ptr + head * stride_q_h, q_rows, stride_q_tok, offs_d, m_ok, HEAD_DIM, HEAD_DIM_PADDED, True)
    do = _load_rows(do_ptr + head * stride_do_h, q_rows, stride_do_tok, offs_d, m_ok, HEAD_DIM, HEAD_DIM_PADDED,
                    True)
    lse = tl.load(lse_ptr + head.to(tl.int64) * total_q + q_rows, mask=m_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # no key seen: P = 0
    delta = tl.load(delta_ptr + head.to(tl.int64) * total_q + q_rows, mask=m_ok, other=0.0)

    k_base = k_ptr + k_start.to(tl.int64) * stride_k_tok + kv_head * stride_k_h
    v_base = v_ptr + k_start.to(tl.int64) * stride_v_tok + kv_head * stride_v_h
    causal_offset = seqlen_k - seqlen_q
    unmasked_end, hi = query_block_keys(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    col = kv_head * HEAD_DIM
    dq = _dq_kv_range(dq, q, do, lse, delta, k_base, v_base, desc_k, desc_v, k_start, col, offs_m, offs_d, 0,
                      unmasked_end, seqlen_k, causal_offset, qk_scale, stride_k_tok, stride_v_tok, BLOCK_N, HEAD_DIM,
                      HEAD_DIM_PADDED, False, IS_CAUSAL, DOT_PRECISION, USE_TMA)
    dq = _dq_kv_range(dq, q, do, lse, delta, k_base, v_base, desc_k, desc_v, k_start, col, offs_m, offs_d,
                      unmasked_end, hi, seqlen_k, causal_offset, qk_scale, stride_k_tok, stride_v_tok, BLOCK_N,
                      HEAD_DIM, HEAD_DIM_PADDED, True, IS_CAUSAL, DOT_PRECISION, USE_TMA)
    tl.store(dq_ptr + q_rows[:, None] * stride_dq_tok + head * stride_dq_h + offs_d[None, :],
             (dq * softmax_scale).to(dq_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


def row_deltas(out, do):
    """delta [H, total_q] = rowsum(dO * O) in float32: the softmax's gradient term of every query row."""
    total_q, nheads, head_dim = out.shape
    delta = torch.empty((nheads, total_q), dtype=torch.float32, device=out.device)
    _preprocess_kernel[(triton.cdiv(total_q, 64), nheads)](
        out, do, delta, total_q, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=64)
    return delta


def _config(table, head_dim_padded):
    return table[min(d for d in table if d >= head_dim_padded)]


def flash_attn_backward(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, deterministic=False):
    """Gradients (dq, dk, dv) of packed varlen attention; shapes and dtypes as q, k, v. lse [H, total_q] is the
    forward's natural-log float32 logsumexp (-inf for rows that see no key). Always deterministic."""
    total_q, nheads, head_dim = q.shape
    nheads_k = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    if total_q == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    do, lse = do.contiguous(), lse.contiguous()
    delta = row_deltas(out, do)
    if softmax_scale > 0 and hopper_pays("backward", head_dim, causal, max(max_seqlen_q, max_seqlen_k)) and \
            hopper.supported(q, k, v, do):  # the warp-specialized Gluon kernels, on sm_90
        return hopper_backward(do, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # every row is written
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    use_tma = tma_pays(head_dim, max(max_seqlen_q, max_seqlen_k), "backward") and tma_ok(q, k, v, do)
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, IS_CAUSAL=bool(causal), DOT_PRECISION=precision,
                  USE_TMA=use_tma)
    qk_scale = softmax_scale * LOG2E
    cfg = _config(BACKWARD_DKDV, head_dim_padded)
    rows = cfg.kwargs["BLOCK_M"]
    desc_q, desc_do = (row_descriptor(q, rows), row_descriptor(do, rows)) if use_tma else (q, do)
    _dkdv_kernel[(triton.cdiv(max_seqlen_k, cfg.kwargs["BLOCK_N"]), nheads_k, batch)](
        q, k, v, do, desc_q, desc_do, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, qk_scale, softmax_scale, total_q,
        nheads // nheads_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        **common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = _config(BACKWARD_DQ, head_dim_padded)
    rows = cfg.kwargs["BLOCK_N"]
    desc_k, desc_v = (row_descriptor(k, rows), row_descriptor(v, rows)) if use_tma else (k, v)
    _dq_kernel[(triton.cdiv(max_seqlen_q, cfg.kwargs["BLOCK_M"]), nheads, batch)](
        q, k, v, do, desc_k, desc_v, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, qk_scale, softmax_scale, total_q,
        nheads // nheads_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        **common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq, dk, dv
