"""Warp-specialized attention backward for Hopper (sm_90a), written in Gluon, FlashAttention-3 style.

Two kernels after our Triton preprocess (delta = rowsum(dO * O)), both without atomics, so deterministic:
- dK/dV: one program owns BLOCK_N = 128 keys of one K/V head of one sequence (K, V stay in shared memory) and
  streams the Q / dO tiles (TMA) and their rows' lse / delta (cp.async) for every query head of the GQA group
  through a STAGES-deep ring filled by a loader warp. Two consumer warpgroups each own 64 of the keys (64 rows
  of dK and dV in registers) and per tile compute S^T = K Q^T and dP^T = V dO^T (async wgmma, both operands
  in shared memory), P^T and dS^T in registers, then dV += P^T dO and dK += dS^T Q with P^T / dS^T as the
  register A operand: nothing goes back through shared memory.
- dQ: one program owns 2 x 64 query rows of one head (Q, dO in shared memory), streams K / V blocks of the
  K/V head through a ring, and per block computes S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.

Semantics match kernels.backward.flash_attn_backward (packed varlen, GQA, bottom-right causal, lse [H, total_q]
natural log with -inf for rows that see no key), for 16-bit tensors with head_dim 64 or 128.

Pinned to Triton 3.6's Gluon API: kernels.hopper.supported says which inputs and GPUs this runs on.
"""
import math

import torch
import triton

from kernels.hopper import (
    GLUON_ERROR,
    async_copy,
    gl,
    gluon,
    mbarrier,
    rows_descriptor,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from kernels.launches import KernelLaunches

_LOG2E = math.log2(math.e)
_WG_ROWS = 64  # rows of the fixed operand (keys for dK/dV, queries for dQ) per consumer warpgroup


def _tile_config(head_dim: int, causal: bool) -> dict:
    """BLOCK_M: query rows per streamed tile of the dK/dV kernel; BLOCK_N_DQ: keys per streamed block of the dQ
    kernel; STAGES(_DQ): ring depths; PAIR_MAJOR: program order (see _dkdv_tile). Per consumer thread the dK/dV
    kernel holds dK, dV (2 x 64 x head_dim fp32 over 128 threads) plus S^T, dP^T (2 x 64 x BLOCK_M), which leaves
    room for BLOCK_M = 64 only (128 spills at head_dim 64 too). Measured on an H100 (bf16, 16k tokens): at head_dim
    128 pair-major order gained 2-17% (most at N = 2048), at head_dim 64 it lost 2%; STAGES 3 lost 4-7% causal
    (full: within run-to-run noise, +-5%). dQ kernel at head_dim 128, variants timed interleaved, best of two:
    BLOCK_N_DQ 128 beat 64 at every N (1.5-4% causal, 1-8% full), 3 or 4 stages lost 0-6%, heads-fastest order
    2-30%."""
    if head_dim == 128:
        return {"BLOCK_M": 64, "STAGES": 2, "BLOCK_N_DQ": 128, "STAGES_DQ": 2, "PAIR_MAJOR": True,
                "maxnreg": 168}
    return {"BLOCK_M": 64, "STAGES": 3, "BLOCK_N_DQ": 128, "STAGES_DQ": 2, "PAIR_MAJOR": False,
            "maxnreg": 168}


if GLUON_ERROR is None:

    _ROWS = gl.constexpr(_WG_ROWS)  # jit functions read globals only as constexpr

    # ------------------------------------------------------------------------------------------------ dK / dV

    @gluon.jit
    def _dkdv_tile(cu_seqlens_q, cu_seqlens_k, num_kv_heads, num_batches, BLOCK_M: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, PAIR_MAJOR: gl.constexpr):
        """Program -> (key block, K/V head, sequence) and the query rows [lo, seqlen_q) it streams per head.
        Key blocks start at 0 either way: under causal masking the first blocks see the most queries. PAIR_MAJOR:
        the key blocks of one (K/V head, sequence) are neighbours, so the programs running at once stream the
        same Q/dO rows and share them in L2; otherwise key blocks vary slowest (heavy blocks of every head first,
        but up to every head's Q/dO in flight at once)."""
        t = gl.program_id(0)
        per_n = num_kv_heads * num_batches
        if PAIR_MAJOR:
            n_kv_blocks = gl.num_programs(0) // per_n
            n_blk = t % n_kv_blocks
            kv_head = (t // n_kv_blocks) % num_kv_heads
            batch = t // (n_kv_blocks * num_kv_heads)
        else:
            n_blk = t // per_n
            kv_head = t % num_kv_heads
            batch = (t % per_n) // num_kv_heads
        q_start = gl.load(cu_seqlens_q + batch)
        seqlen_q = gl.load(cu_seqlens_q + batch + 1) - q_start
        k_start = gl.load(cu_seqlens_k + batch)
        seqlen_k = gl.load(cu_seqlens_k + batch + 1) - k_start
        n0 = n_blk * (2 * _ROWS)
        if IS_CAUSAL:  # query i sees key j iff j <= i + seqlen_k - seqlen_q: rows before n0's horizon see nothing
            lo = gl.minimum(gl.maximum(n0 - (seqlen_k - seqlen_q), 0), seqlen_q)
            lo = (lo // BLOCK_M) * BLOCK_M
        else:
            lo = seqlen_q * 0
        n_steps = gl.cdiv(seqlen_q - lo, BLOCK_M)
        return n0, kv_head, q_start, seqlen_q, k_start, seqlen_k, lo, n_steps

    @gluon.jit
    def _dkdv_loader(descs, bufs, bars, lse_ptr, delta_ptr, cu_seqlens_q, cu_seqlens_k, num_kv_heads, num_batches,
                     group_size, total_q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                     IS_CAUSAL: gl.constexpr, PAIR_MAJOR: gl.constexpr):
        """One warp: the program's K, V halves once, then per (head of the group, query block) the Q and dO
        tiles (TMA) and the rows' lse and delta (cp.async: a row's offset need not be 16-byte aligned) through
        the ring. Q, dO and lse/delta have their own ready barriers so S^T can start before dO lands, and the
        consumers never wait on a global load."""
        q_desc, do_desc, k_desc, v_desc = descs
        k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs = bufs
        kv_ready, q_ready, do_ready, stat_ready, empty = bars
        stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        n0, kv_head, q_start, seqlen_q, k_start, seqlen_k, lo, n_steps = _dkdv_tile(
            cu_seqlens_q, cu_seqlens_k, num_kv_heads, num_batches, BLOCK_M, IS_CAUSAL, PAIR_MAJOR)
        if n0 < seqlen_k:
            mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
            for wg in gl.static_range(2):
                tma.async_copy_global_to_shared(k_desc, [k_start + n0 + wg * _ROWS, kv_head * HEAD_DIM],
                                                kv_ready, k_smem.index(wg))
                tma.async_copy_global_to_shared(v_desc, [k_start + n0 + wg * _ROWS, kv_head * HEAD_DIM],
                                                kv_ready, v_smem.index(wg))
            i = 0
            for h in range(group_size):
                head = kv_head * group_size + h
                col = head * HEAD_DIM
                stat_off = head.to(gl.int64) * total_q + q_start
                for s in range(n_steps):
                    stage = i % STAGES
                    # A fresh mbarrier counts as having completed the phase before 0: the first lap does not wait.
                    mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
                    offs_m = lo + s * BLOCK_M + gl.arange(0, BLOCK_M, layout=stat_layout)
                    m_ok = offs_m < seqlen_q  # rows past the sequence land as 0; the consumers mask them
                    async_copy.async_copy_global_to_shared(lse_bufs.index(stage), lse_ptr + stat_off + offs_m, m_ok)
                    async_copy.async_copy_global_to_shared(delta_bufs.index(stage), delta_ptr + stat_off + offs_m,
                                                           m_ok)
                    # Each of the warp's 32 threads arrives once its own copies have landed (count 32).
                    async_copy.mbarrier_arrive(stat_ready.index(stage), increment_count=False)
                    row = q_start + lo + s * BLOCK_M
                    mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(stage), q_bufs.index(stage))
                    mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(stage), do_bufs.index(stage))
                    i += 1

    @gluon.jit
    def _dkdv_scores(k_wg, v_wg, q_s, do_s, q_bar, do_bar, phase, s_zero):
        """Issue one streamed tile's S^T = K Q^T and dP^T = V dO^T as soon as its Q, then its dO, have landed."""
        mbarrier.wait(q_bar, phase)
        s_tok = warpgroup_mma(k_wg, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bar, phase)
        dp_tok = warpgroup_mma(v_wg, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return s_tok, dp_tok

    @gluon.jit
    def _dkdv_probs(s_t, lse_buf, offs_n, m0, seqlen_q, causal_offset, mask_until, qk_scale,
                    s_layout: gl.constexpr, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """P^T of one tile from its finished S^T."""
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        # Rows past the sequence (TMA brought the next one's, or zeros) and rows that saw no key get lse = +inf:
        # P = 0 there, so they add nothing.
        lse = lse_buf.load(gl.SliceLayout(0, s_layout))
        lse = gl.where((offs_m < seqlen_q) & (lse != float("-inf")), lse * 1.4426950408889634, float("inf"))
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        if IS_CAUSAL:  # noqa: SIM102 (a compile-time branch around a runtime one)
            if m0 < mask_until:
                visible = gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + causal_offset, 0)
                p_t = gl.where(visible, p_t, 0.0)
        return p_t

    @gluon.jit
    def _dkdv_update(p_t, dp_t, dk, dv, q_s, do_s, delta_buf, s_layout: gl.constexpr, a_layout: gl.constexpr):
        """Issue dV += P^T dO, compute dS^T under it, issue dK += dS^T Q; both left in flight with their register
        operands (returned: the caller's wait keeps them alive)."""
        dtype: gl.constexpr = q_s.dtype
        p_a = gl.convert_layout(p_t.to(dtype), a_layout)
        dv_tok = warpgroup_mma(p_a, do_s, dv, is_async=True)
        delta = delta_buf.load(gl.SliceLayout(0, s_layout))
        ds_a = gl.convert_layout((p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype), a_layout)
        dk_tok = warpgroup_mma(ds_a, q_s, dk, is_async=True)
        return dv_tok, dk_tok, p_a, ds_a

    @gluon.jit
    def _dkdv_consumer(bufs, bars, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q, cu_seqlens_k, num_kv_heads,
                       num_batches, group_size, qk_scale, softmax_scale, total_q, stride_dk_tok, stride_dk_h,
                       stride_dv_tok, stride_dv_h, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PAIR_MAJOR: gl.constexpr):
        """One warpgroup: keys [n0 + WG * 64, + 64) against every streamed query tile (keys on rows), software-
        pipelined so its GEMMs queue back to back: dV of tile i (dS^T is computed under it), dK of tile i, then
        S^T and dP^T of tile i + 1 (its P^T is computed under dP^T). Each GEMM retires within the iteration that
        issued it: with S^T / dP^T still in flight across the loop's back edge, ptxas serialized every wgmma of
        the kernel (its warning C7514). H100, hd128: dK/dV kernel 8-13% faster causal, 0-4% full."""
        k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs = bufs
        kv_ready, q_ready, do_ready, stat_ready, empty = bars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        # P^T and dS^T as the register A operand: the same thread owns the same elements as in S^T.
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_bufs.dtype
        n0, kv_head, _, seqlen_q, k_start, seqlen_k, lo, n_steps = _dkdv_tile(
            cu_seqlens_q, cu_seqlens_k, num_kv_heads, num_batches, BLOCK_M, IS_CAUSAL, PAIR_MAJOR)
        if n0 < seqlen_k:
            kn0 = n0 + WG * _ROWS
            causal_offset = seqlen_k - seqlen_q
            # Query tiles from m0 >= mask_until see all of this warpgroup's keys (only lse masks their tail).
            mask_until = kn0 + _ROWS - 1 - causal_offset
            offs_n = kn0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
            s_zero = gl.zeros([_ROWS, BLOCK_M], gl.float32, s_layout)
            dk = gl.zeros([_ROWS, HEAD_DIM], gl.float32, acc_layout)
            dv = gl.zeros([_ROWS, HEAD_DIM], gl.float32, acc_layout)
            k_wg = k_smem.index(WG)
            v_wg = v_smem.index(WG)
            n_tiles = group_size * n_steps
            mbarrier.wait(kv_ready, 0)
            if n_tiles > 0:
                s_tok, dp_tok = _dkdv_scores(k_wg, v_wg, q_bufs.index(0), do_bufs.index(0), q_ready.index(0),
                                             do_ready.index(0), 0, s_zero)
                s_t = warpgroup_mma_wait(1, deps=(s_tok, ))
                mbarrier.wait(stat_ready.index(0), 0)
                p_t = _dkdv_probs(s_t, lse_bufs.index(0), offs_n, lo, seqlen_q, causal_offset, mask_until, qk_scale,
                                  s_layout, BLOCK_M, IS_CAUSAL)
                dp_t = warpgroup_mma_wait(0, deps=(dp_tok, ))
                for i in range(n_tiles - 1):  # the last tile is peeled off: no next tile's scores to queue
                    stage = i % STAGES
                    dv_tok, dk_tok, p_a, ds_a = _dkdv_update(p_t, dp_t, dk, dv, q_bufs.index(stage),
                                                             do_bufs.index(stage), delta_bufs.index(stage),
                                                             s_layout, a_layout)
                    dv, p_a = warpgroup_mma_wait(1, deps=(dv_tok, p_a))  # frees P^T's registers for tile i + 1
                    nxt = (i + 1) % STAGES
                    nxt_phase = ((i + 1) // STAGES) & 1
                    s_tok, dp_tok = _dkdv_scores(k_wg, v_wg, q_bufs.index(nxt), do_bufs.index(nxt),
                                                 q_ready.index(nxt), do_ready.index(nxt), nxt_phase, s_zero)
                    dk, s_t, ds_a = warpgroup_mma_wait(1, deps=(dk_tok, s_tok, ds_a))
                    mbarrier.arrive(empty.index(stage))
                    mbarrier.wait(stat_ready.index(nxt), nxt_phase)
                    p_t = _dkdv_probs(s_t, lse_bufs.index(nxt), offs_n, lo + ((i + 1) % n_steps) * BLOCK_M, seqlen_q,
                                      causal_offset, mask_until, qk_scale, s_layout, BLOCK_M, IS_CAUSAL)
                    dp_t = warpgroup_mma_wait(0, deps=(dp_tok, ))
                stage = (n_tiles - 1) % STAGES
                dv_tok, dk_tok, p_a, ds_a = _dkdv_update(p_t, dp_t, dk, dv, q_bufs.index(stage), do_bufs.index(stage),
                                                         delta_bufs.index(stage), s_layout, a_layout)
                dv, dk, p_a, ds_a = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_a, ds_a))
            offs_r = kn0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, acc_layout))
            offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
            rows = gl.expand_dims((k_start + offs_r).to(gl.int64), 1)
            r_ok = gl.expand_dims(offs_r < seqlen_k, 1)
            gl.store(dk_ptr + rows * stride_dk_tok + kv_head * stride_dk_h + gl.expand_dims(offs_d, 0),
                     (dk * softmax_scale).to(dtype), mask=r_ok)
            gl.store(dv_ptr + rows * stride_dv_tok + kv_head * stride_dv_h + gl.expand_dims(offs_d, 0),
                     dv.to(dtype), mask=r_ok)

    @gluon.jit
    def _dkdv_kernel(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q,
                     cu_seqlens_k, qk_scale, softmax_scale, total_q, num_kv_heads, num_batches, group_size,
                     stride_dk_tok, stride_dk_h, stride_dv_tok, stride_dv_h, HEAD_DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PAIR_MAJOR: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # per stage: a plain row
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        stat_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(stat_ready.index(i), count=32)  # one cp.async arrival per loader thread
            mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
        bufs = (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs)
        bars = (kv_ready, q_ready, do_ready, stat_ready, empty)
        # Default partition (these 4 warps): consumer 0; workers: consumer 1 and the loader (1 warp, 24 registers).
        gl.warp_specialize([
            (_dkdv_consumer, (bufs, bars, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q, cu_seqlens_k,
                              num_kv_heads, num_batches, group_size, qk_scale, softmax_scale, total_q, stride_dk_tok,
                              stride_dk_h, stride_dv_tok, stride_dv_h, 0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL,
                              PAIR_MAJOR)),
            (_dkdv_consumer, (bufs, bars, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q, cu_seqlens_k,
                              num_kv_heads, num_batches, group_size, qk_scale, softmax_scale, total_q, stride_dk_tok,
                              stride_dk_h, stride_dv_tok, stride_dv_h, 1, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL,
                              PAIR_MAJOR)),
            (_dkdv_loader, ((q_desc, do_desc, k_desc, v_desc), bufs, bars, lse_ptr, delta_ptr, cu_seqlens_q,
                            cu_seqlens_k, num_kv_heads, num_batches, group_size, total_q, HEAD_DIM, BLOCK_M, STAGES,
                            IS_CAUSAL, PAIR_MAJOR)),
        ], [4, 1], [240, 24])

    # ------------------------------------------------------------------------------------------------ dQ

    @gluon.jit
    def _dq_tile(cu_seqlens_q, cu_seqlens_k, num_heads, num_batches, num_m_tiles, BLOCK_N: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, PAIR_MAJOR: gl.constexpr):
        """Program -> 2 x 64 query rows from m0 of one (head, sequence) and its key blocks. Highest row tiles
        first (the most keys under causal masking). PAIR_MAJOR: the row tiles of one (head, sequence) are
        neighbours and share its K/V in L2; otherwise heads vary fastest (a GQA group shares K/V)."""
        t = gl.program_id(0)
        per_m = num_heads * num_batches
        if PAIR_MAJOR:
            m0 = (num_m_tiles - 1 - t % num_m_tiles) * (2 * _ROWS)
            head = (t // num_m_tiles) % num_heads
            batch = t // (num_m_tiles * num_heads)
        else:
            m0 = (num_m_tiles - 1 - t // per_m) * (2 * _ROWS)
            head = t % num_heads
            batch = (t % per_m) // num_heads
        q_start = gl.load(cu_seqlens_q + batch)
        seqlen_q = gl.load(cu_seqlens_q + batch + 1) - q_start
        k_start = gl.load(cu_seqlens_k + batch)
        seqlen_k = gl.load(cu_seqlens_k + batch + 1) - k_start
        if IS_CAUSAL:  # the keys the tile's last row sees
            last_row = gl.minimum(seqlen_q, m0 + 2 * _ROWS) - 1
            hi = gl.maximum(gl.minimum(seqlen_k, last_row + seqlen_k - seqlen_q + 1), 0)
        else:
            hi = seqlen_k
        n_blocks = gl.cdiv(hi, BLOCK_N)
        return m0, head, q_start, seqlen_q, k_start, seqlen_k, n_blocks

    @gluon.jit
    def _dq_loader(descs, bufs, bars, cu_seqlens_q, cu_seqlens_k, num_heads, num_batches, num_m_tiles, group_size,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   PAIR_MAJOR: gl.constexpr):
        """One warp: both consumers' Q and dO rows once, then the K / V blocks through the ring (K and V with
        their own ready barriers, so S can start before V lands)."""
        q_desc, do_desc, k_desc, v_desc = descs
        q_smem, do_smem, k_bufs, v_bufs = bufs
        qdo_ready, k_ready, v_ready, empty = bars
        m0, head, q_start, seqlen_q, k_start, _, n_blocks = _dq_tile(
            cu_seqlens_q, cu_seqlens_k, num_heads, num_batches, num_m_tiles, BLOCK_N, IS_CAUSAL, PAIR_MAJOR)
        if m0 < seqlen_q:
            mbarrier.expect(qdo_ready, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
            for wg in gl.static_range(2):
                tma.async_copy_global_to_shared(q_desc, [q_start + m0 + wg * _ROWS, head * HEAD_DIM], qdo_ready,
                                                q_smem.index(wg))
                tma.async_copy_global_to_shared(do_desc, [q_start + m0 + wg * _ROWS, head * HEAD_DIM], qdo_ready,
                                                do_smem.index(wg))
            kv_col = (head // group_size) * HEAD_DIM
            for j in range(n_blocks):
                stage = j % STAGES
                mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [k_start + j * BLOCK_N, kv_col], k_ready.index(stage),
                                                k_bufs.index(stage))
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [k_start + j * BLOCK_N, kv_col], v_ready.index(stage),
                                                v_bufs.index(stage))

    @gluon.jit
    def _dq_consumer(bufs, bars, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q, cu_seqlens_k, num_heads, num_batches,
                     num_m_tiles, qk_scale, softmax_scale, total_q, stride_dq_tok, stride_dq_h, WG: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   PAIR_MAJOR: gl.constexpr):
        """One warpgroup: query rows [m0 + WG * 64, + 64) against the tile's key blocks."""
        q_smem, do_smem, k_bufs, v_bufs = bufs
        qdo_ready, k_ready, v_ready, empty = bars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        m0, head, q_start, seqlen_q, _, seqlen_k, n_blocks = _dq_tile(
            cu_seqlens_q, cu_seqlens_k, num_heads, num_batches, num_m_tiles, BLOCK_N, IS_CAUSAL, PAIR_MAJOR)
        if m0 < seqlen_q:
            m_start = m0 + WG * _ROWS
            causal_offset = seqlen_k - seqlen_q
            # Key blocks ending before mask_from are seen whole by every row of this warpgroup.
            if IS_CAUSAL:
                mask_from = gl.minimum(seqlen_k, gl.maximum(m_start + causal_offset + 1, 0))
            else:
                mask_from = seqlen_k
            offs_m = m_start + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
            m_ok = offs_m < seqlen_q
            lse = gl.load(lse_ptr + head.to(gl.int64) * total_q + q_start + offs_m, mask=m_ok, other=float("inf"))
            lse = gl.expand_dims(gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), 1)
            delta = gl.expand_dims(gl.load(delta_ptr + head.to(gl.int64) * total_q + q_start + offs_m, mask=m_ok,
                                           other=0.0), 1)
            s_zero = gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout)
            dq = gl.zeros([_ROWS, HEAD_DIM], gl.float32, acc_layout)
            q_wg = q_smem.index(WG)
            do_wg = do_smem.index(WG)
            mbarrier.wait(qdo_ready, 0)
            for j in range(n_blocks):
                stage = j % STAGES
                phase = (j // STAGES) & 1
                k_s = k_bufs.index(stage)
                mbarrier.wait(k_ready.index(stage), phase)
                s = warpgroup_mma(q_wg, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(stage), phase)
                dp = warpgroup_mma(do_wg, v_bufs.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)
                s = warpgroup_mma_wait(1, deps=(s, ))
                p = gl.exp2(s * qk_scale - lse)
                if (j + 1) * BLOCK_N > mask_from:  # keys past the sequence or past a row's causal horizon
                    offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                    visible = gl.expand_dims(offs_n < seqlen_k, 0)
                    if IS_CAUSAL:
                        visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + causal_offset, 1))
                    p = gl.where(visible, p, 0.0)
                dp = warpgroup_mma_wait(0, deps=(dp, ))
                ds = p * (dp - delta)
                dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_s, dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                mbarrier.arrive(empty.index(stage))
            offs_r = m_start + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, acc_layout))
            offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
            rows = gl.expand_dims((q_start + offs_r).to(gl.int64), 1)
            gl.store(dq_ptr + rows * stride_dq_tok + head * stride_dq_h + gl.expand_dims(offs_d, 0),
                     (dq * softmax_scale).to(dtype), mask=gl.expand_dims(offs_r < seqlen_q, 1))

    @gluon.jit
    def _dq_kernel(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q, cu_seqlens_k, qk_scale,
                   softmax_scale, total_q, num_heads, num_batches, num_m_tiles, group_size, stride_dq_tok,
                   stride_dq_h, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, PAIR_MAJOR: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        qdo_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        bufs = (q_smem, do_smem, k_bufs, v_bufs)
        bars = (qdo_ready, k_ready, v_ready, empty)
        gl.warp_specialize([
            (_dq_consumer, (bufs, bars, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q, cu_seqlens_k, num_heads,
                            num_batches, num_m_tiles, qk_scale, softmax_scale, total_q, stride_dq_tok, stride_dq_h,
                            0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, PAIR_MAJOR)),
            (_dq_consumer, (bufs, bars, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q, cu_seqlens_k, num_heads,
                            num_batches, num_m_tiles, qk_scale, softmax_scale, total_q, stride_dq_tok, stride_dq_h,
                            1, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, PAIR_MAJOR)),
            (_dq_loader, ((q_desc, do_desc, k_desc, v_desc), bufs, bars, cu_seqlens_q, cu_seqlens_k, num_heads,
                          num_batches, num_m_tiles, group_size, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, PAIR_MAJOR)),
        ], [4, 1], [240, 24])


_DKDV_LAUNCHES = KernelLaunches(_dkdv_kernel) if GLUON_ERROR is None else None
_DQ_LAUNCHES = KernelLaunches(_dq_kernel) if GLUON_ERROR is None else None


def hopper_backward(do, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, config=None):
    """Gradients (dq, dk, dv) of packed varlen attention, same contract as kernels.backward.flash_attn_backward
    (deterministic: no atomics), given its delta = rowsum(dO * O) [H, total_q] (kernels.backward.row_deltas) and
    a contiguous dO. Callers check kernels.hopper.supported first. config overrides _tile_config (tests of each
    knob)."""
    total_q, _, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    if total_q == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if not softmax_scale > 0:
        raise ValueError(f"hopper_backward needs softmax_scale > 0, got {softmax_scale}")
    cfg = dict(_tile_config(head_dim, bool(causal)), **(config or {}))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # every row is written
    args = (do, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            bool(causal), cfg)
    _launch_dkdv(dk, dv, *args)
    _launch_dq(dq, *args)
    return dq, dk, dv


def _launch_dkdv(dk, dv, do, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, cfg):
    total_q, nheads, head_dim = q.shape
    nheads_k = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    block_m = cfg["BLOCK_M"]
    n_kv_blocks = triton.cdiv(max_seqlen_k, 2 * _WG_ROWS)
    _DKDV_LAUNCHES.launch(
        (n_kv_blocks * nheads_k * batch, 1, 1),
        (rows_descriptor(q, block_m), rows_descriptor(do, block_m), rows_descriptor(k, _WG_ROWS),
         rows_descriptor(v, _WG_ROWS), lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E,
         softmax_scale, total_q, nheads_k, batch, nheads // nheads_k, dk.stride(0), dk.stride(1), dv.stride(0),
         dv.stride(1)),
        dict(HEAD_DIM=head_dim, BLOCK_M=block_m, STAGES=cfg["STAGES"], IS_CAUSAL=causal,
             PAIR_MAJOR=cfg["PAIR_MAJOR"]), num_warps=4, maxnreg=cfg["maxnreg"])


def _launch_dq(dq, do, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal, cfg):
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    block_n = cfg["BLOCK_N_DQ"]
    num_m_tiles = triton.cdiv(max_seqlen_q, 2 * _WG_ROWS)
    _DQ_LAUNCHES.launch(
        (num_m_tiles * nheads * batch, 1, 1),
        (rows_descriptor(q, _WG_ROWS), rows_descriptor(do, _WG_ROWS), rows_descriptor(k, block_n),
         rows_descriptor(v, block_n), lse, delta, dq, cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E,
         softmax_scale, total_q, nheads, batch, num_m_tiles, nheads // k.shape[1], dq.stride(0), dq.stride(1)),
        dict(HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=cfg["STAGES_DQ"], IS_CAUSAL=causal,
             PAIR_MAJOR=cfg["PAIR_MAJOR"]), num_warps=4, maxnreg=cfg["maxnreg"])
