"""Warp-specialized prefill attention forward for Hopper (sm_90a), written in Gluon, FlashAttention-3 style.

A work tile is 2 * BLOCK_M query rows of one head of one sequence. Each program runs three partitions over
its tiles (one tile, or with PERSISTENT a tile every grid-size tiles):
- a loader warp brings each tile's Q, then streams its K and V blocks into a STAGES-deep shared-memory ring
  with TMA. K and V have their own "ready" and "empty" mbarriers, so QK^T can start before V lands and the
  next K is fetched as soon as QK^T is done with the last one;
- two consumer warpgroups, each its own BLOCK_M rows, run the online softmax. Each issues the next block's
  QK^T (async wgmma, both operands in shared memory) and this block's P @ V (P stays in registers as the A
  operand) back to back, then does the next block's softmax while the P @ V is still running. Whole output
  tiles leave through shared memory by TMA (TMA_STORE), a sequence's last partial tile by masked stores;
- with PINGPONG the two consumers take turns issuing their GEMMs (an mbarrier per consumer), so one's
  softmax runs under the other's GEMMs instead of both competing for the tensor cores at the same time.

Semantics match kernels.prefill.flash_attn_forward (packed varlen, GQA, bottom-right causal, out 0 and lse -inf
for rows that see no key, lse [H, total_q] float32 natural log), for 16-bit q/k/v with head_dim 64 or 128.

Pinned to Triton 3.6's Gluon API: kernels.hopper.supported says which inputs and GPUs this runs on.
"""
import functools
import math

import torch
import triton
import triton.language as tl

from kernels.hopper import (
    GLUON_ERROR,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    rows_descriptor,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from kernels.launches import KernelLaunches
from kernels.tma import tma_ok

_LOG2E = math.log2(math.e)
_SMEM_BYTES = 227 * 1024 - 1024  # an sm_90 block's shared memory, less the mbarriers and a margin


def _tile_config(head_dim: int, causal: bool) -> dict:
    """Rows per consumer warpgroup, keys per block, ring depth and the knobs, picked on an H100 (bf16, 16k tokens
    per batch, 16 heads x 128 or 32 x 64). 64 rows per warpgroup keep S (64 x BLOCK_N) and O (64 x head_dim)
    fp32 accumulators in registers together. hd128: 2 stages (Q 32 KiB + 2 x 64 KiB ring + 32 KiB output
    staging); 3 stages were no faster and leave no room for the staging. hd64: ping-pong lost a little
    (causal 8192: 414 against 430 TFLOP/s without), the deeper ring is free."""
    if head_dim == 128:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2, "PINGPONG": True, "PERSISTENT": True,
                "TMA_STORE": True, "TILE_LIST": True, "maxnreg": 168}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 3, "PINGPONG": False, "PERSISTENT": True, "TMA_STORE": True,
            "TILE_LIST": True, "maxnreg": 168}


def _grid_size(num_m_tiles: int, num_tiles: int, causal: bool, ragged: bool, num_sms: int) -> int:
    """Programs for a persistent launch: one per SM, each running tiles p, p + P, p + 2P, ... (P programs).
    Sequences of different lengths (ragged) give tiles of unknown cost, many of them empty: a program per tile
    balances them better (64 sequences of 64..2048 tokens, hd128 causal, three draws: 359 / 324 / 344 TFLOP/s
    against 348 / 312 / 329 persistent). Under causal masking a tile's cost grows with its row block, and program
    p's row positions step by P mod num_m_tiles through a cycle of _row_group's groups: unless each program runs
    at least one full cycle, and the cycle has two groups to pair, some programs draw only the long tiles (hd128
    causal N=16384: 450 TFLOP/s against 595 with a program per tile), so then the launch keeps a program per tile
    and leaves the balancing to the hardware."""
    if num_tiles <= num_sms or ragged:
        return num_tiles
    if causal and num_m_tiles > 1:
        cycle = num_m_tiles // _row_group(num_m_tiles, num_sms)
        if cycle < 2 or num_tiles // num_sms < cycle:
            return num_tiles
    return num_sms


def _row_group(num_m_tiles: int, grid: int) -> int:
    """Program p of a persistent launch only meets the row positions p mod g + k * g of each head, g =
    gcd(grid, num_m_tiles) (4 on 132 SMs at 16..128 row tiles). _tile hands those positions out so that every
    program's positions cost the same under causal masking: g consecutive row blocks form a group, and in every
    odd group the order reverses, so position c takes the c-th longest row block of one group and the c-th
    shortest of the next. With the row blocks straight in position order, program p always drew row blocks of
    one residue mod g, and the residue of the longest ones carried 40 key blocks per cycle against 28 for the
    shortest (N=2048): the launch ended when those programs did."""
    return math.gcd(grid % num_m_tiles, num_m_tiles)


@triton.jit
def _ragged_tiles_kernel(cu_seqlens_q, tile_list, num_batches, num_heads, num_slots, ROWS: tl.constexpr,
                         BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program b lists sequence b's work tiles (n_b row tiles of ROWS rows, each head): entry num_heads * (tiles of
    the sequences before b) + head * n_b + i is (b << 32) | (head << 16) | (n_b - 1 - i), the highest rows of
    each head first. The last program marks the unused entries up to num_slots with -1."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    seqs = offs < num_batches
    lens = tl.load(cu_seqlens_q + offs + 1, mask=seqs, other=0) - tl.load(cu_seqlens_q + offs, mask=seqs, other=0)
    n = (lens + ROWS - 1) // ROWS
    first = num_heads * tl.sum(tl.where(offs < b, n, 0), 0)
    n_b = tl.sum(tl.where(offs == b, n, 0), 0)
    for i0 in range(0, num_heads * n_b, BLOCK_T):
        i = i0 + tl.arange(0, BLOCK_T)
        entry = (b.to(tl.int64) << 32) | ((i // n_b).to(tl.int64) << 16) | (n_b - 1 - i % n_b).to(tl.int64)
        tl.store(tile_list + first + i, entry, mask=i < num_heads * n_b)
    if b == num_batches - 1:
        for i0 in range(first + num_heads * n_b, num_slots, BLOCK_T):
            i = i0 + tl.arange(0, BLOCK_T)
            tl.store(tile_list + i, tl.full([BLOCK_T], -1, tl.int64), mask=i < num_slots)


_RAGGED_LAUNCHES = KernelLaunches(_ragged_tiles_kernel)


def _ragged_tiles(cu_seqlens_q, num_heads: int, total_q: int, rows: int) -> tuple[torch.Tensor, int]:
    """The work tiles of a batch of sequences of different lengths, listed on the device (no host sync): the
    list has a slot for every tile the batch can have (a sequence of L rows has ceil(L / rows) tiles, at most
    total_q / rows + batch in all), so the launch needs no lengths on the host; a program per slot. Launching a
    program per (row tile of the longest sequence, head, sequence) instead, most of them empty for short
    sequences, cost 1.4 us per empty program on an SM (64 sequences of 64..2048 tokens: 16,384 programs for
    8,912 tiles)."""
    batch = cu_seqlens_q.numel() - 1
    slots = num_heads * (triton.cdiv(total_q, rows) + batch)
    tiles = torch.empty(slots, dtype=torch.int64, device=cu_seqlens_q.device)
    _RAGGED_LAUNCHES.launch((batch, 1, 1), (cu_seqlens_q, tiles, batch, num_heads, slots),
                            dict(ROWS=rows, BLOCK_B=triton.next_power_of_2(batch + 1), BLOCK_T=1024))
    return tiles, slots


if GLUON_ERROR is None:

    @gluon.jit
    def _tile(t, sched, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
              TILE_LIST: gl.constexpr):
        """Work tile t: 2 * BLOCK_M query rows from m0 of one (head, sequence). The row blocks of one head vary
        fastest, so the programs running at once share few heads' K/V and find them in L2 (heads fastest
        instead streamed every head's K/V from HBM: N=2048 hd128 causal fell from 443 to 315 TFLOP/s); within a
        head the highest row blocks come first, since under causal masking they carry the most keys.
        n_blocks >= 1 even when no row of the tile sees a key: that block is then fully masked, and the rows
        come out 0 with lse -inf like any other. row_group (see _row_group; 1 keeps the order) pairs long and
        short row blocks for the programs of a persistent causal launch. TILE_LIST: tile t is entry t of
        _ragged_tiles' list instead (the same order, without the empty tiles of short sequences)."""
        cu_seqlens_q, cu_seqlens_k, tile_list, num_heads, num_m_tiles, row_group, _ = sched
        if TILE_LIST:
            entry = gl.load(tile_list + t)
            batch = (gl.maximum(entry, 0) >> 32).to(gl.int32)
            head = ((entry >> 16) & 0xFFFF).to(gl.int32)
            # An unused entry (-1) gets a row past any sequence: the tile is skipped.
            m0 = (entry & 0xFFFF).to(gl.int32) * (2 * BLOCK_M) + (entry < 0).to(gl.int32) * (1 << 30)
        else:
            pos = t % num_m_tiles
            group = pos // row_group
            in_group = pos % row_group
            in_group += (group % 2) * (row_group - 1 - 2 * in_group)  # odd groups in reverse
            m0 = (num_m_tiles - 1 - group * row_group - in_group) * (2 * BLOCK_M)
            head = (t // num_m_tiles) % num_heads
            batch = t // (num_m_tiles * num_heads)
        q_start = gl.load(cu_seqlens_q + batch)
        seqlen_q = gl.load(cu_seqlens_q + batch + 1) - q_start
        k_start = gl.load(cu_seqlens_k + batch)
        seqlen_k = gl.load(cu_seqlens_k + batch + 1) - k_start
        # The keys the tile's last row sees bound the blocks streamed. Consumer 0 (the lower rows) runs the
        # same blocks, at most one of them fully masked for it, which keeps the two consumers' turns in step.
        if IS_CAUSAL:
            last_row = gl.minimum(seqlen_q, m0 + 2 * BLOCK_M) - 1
            hi = gl.maximum(gl.minimum(seqlen_k, last_row + seqlen_k - seqlen_q + 1), 0)
        else:
            hi = seqlen_k
        n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        return m0, head, q_start, seqlen_q, k_start, seqlen_k, n_blocks

    @gluon.jit
    def _loader(descs, bufs, bars, sched, group_size, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, TILE_LIST: gl.constexpr):
        """One warp: per tile, both consumers' Q (once the last tile's is released), then the tile's K/V
        blocks through the ring. Ring slot and phase run on across tiles, like the consumers'."""
        q_desc, k_desc, v_desc = descs
        q_bufs, k_bufs, v_bufs = bufs[0], bufs[1], bufs[2]  # not the output staging
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bars[0], bars[1], bars[2], bars[3], bars[4], bars[5]
        kv_idx = 0
        tile_i = 0
        for t in range(gl.program_id(0), sched[6], gl.num_programs(0)):
            m0, head, q_start, seqlen_q, k_start, seqlen_k, n_blocks = _tile(t, sched, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                                            TILE_LIST)
            if m0 < seqlen_q:
                # A fresh mbarrier counts as having completed the phase before 0: the first lap does not wait.
                for wg in gl.static_range(2):
                    mbarrier.wait(q_empty.index(wg), (tile_i & 1) ^ 1)
                    mbarrier.expect(q_ready.index(wg), q_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(q_desc, [q_start + m0 + wg * BLOCK_M, head * HEAD_DIM],
                                                    q_ready.index(wg), q_bufs.index(wg))
                kv_col = (head // group_size) * HEAD_DIM
                for j in range(n_blocks):
                    stage = kv_idx % STAGES
                    empty_phase = ((kv_idx // STAGES) & 1) ^ 1
                    # K and V slots free up separately (K after QK^T, V after P @ V), so the next K lands sooner.
                    mbarrier.wait(k_empty.index(stage), empty_phase)
                    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [k_start + j * BLOCK_N, kv_col], k_ready.index(stage),
                                                    k_bufs.index(stage))
                    mbarrier.wait(v_empty.index(stage), empty_phase)
                    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(v_desc, [k_start + j * BLOCK_N, kv_col], v_ready.index(stage),
                                                    v_bufs.index(stage))
                    kv_idx += 1
                tile_i += 1

    @gluon.jit
    def _softmax_block(s, m_i, l_i, j, offs_m, mask_from, seqlen_k, causal_offset, qk_scale,
                       BLOCK_N: gl.constexpr, s_layout: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """Online-softmax step over raw scores s of key block j: returns (p, m, l, alpha), m in log2 units of
        the scaled scores. Blocks every row fully sees (before mask_from) skip the masks."""
        if (j + 1) * BLOCK_N > mask_from:
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = gl.expand_dims(offs_n < seqlen_k, 0)
            if IS_CAUSAL:
                visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + causal_offset, 1))
            s = gl.where(visible, s, float("-inf"))
        # The scale is folded into the exponent's FMA: max of the raw scores, scaled once per row (scale > 0).
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0, no NaN
        alpha = gl.exp2(m_i - m_sub)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _take_turn(turn_bars, turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Wait until the other consumer has issued its GEMMs of the last turn; consumer 0 goes first (its
        barrier reads as complete for the phase before 0)."""
        if PINGPONG:
            mbarrier.wait(turn_bars.index(WG), (turn & 1) ^ (1 - WG))

    @gluon.jit
    def _pass_turn(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - WG))

    @gluon.jit
    def _consumer(bufs, bars, o_desc, out_ptr, lse_ptr, sched, qk_scale, total_q, stride_o_tok, stride_o_h,
                  WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, TMA_STORE: gl.constexpr,
                  TILE_LIST: gl.constexpr):
        """One warpgroup: per tile, rows [m0 + WG * BLOCK_M, + BLOCK_M) against the tile's key blocks."""
        q_bufs, k_bufs, v_bufs, o_bufs = bufs
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars = bars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        # P as the register A operand of P @ V: the same thread owns the same elements as in S (no shuffle).
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_bufs.dtype
        q_smem = q_bufs.index(WG)
        o_smem = o_bufs.index(WG)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        kv_idx = 0  # ring position of the tile's block 0
        turn = 0
        tile_i = 0
        for t in range(gl.program_id(0), sched[6], gl.num_programs(0)):
            m0, head, q_start, seqlen_q, _, seqlen_k, n_blocks = _tile(t, sched, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                                      TILE_LIST)
            if m0 < seqlen_q:
                m_start = m0 + WG * BLOCK_M
                causal_offset = seqlen_k - seqlen_q
                if IS_CAUSAL:
                    mask_from = gl.minimum(seqlen_k, gl.maximum(m_start + causal_offset + 1, 0))
                else:
                    mask_from = seqlen_k
                offs_m = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
                l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
                acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

                mbarrier.wait(q_ready.index(WG), tile_i & 1)
                # Block 0: QK^T alone (there is no P @ V to pair it with yet).
                stage = kv_idx % STAGES
                _take_turn(turn_bars, turn, WG, PINGPONG)
                mbarrier.wait(k_ready.index(stage), (kv_idx // STAGES) & 1)
                s = warpgroup_mma(q_smem, k_bufs.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                _pass_turn(turn_bars, WG, PINGPONG)
                s = warpgroup_mma_wait(0, deps=(s, ))
                mbarrier.arrive(k_empty.index(stage))
                p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, 0, offs_m, mask_from, seqlen_k, causal_offset,
                                                    qk_scale, BLOCK_N, s_layout, IS_CAUSAL)
                for j in range(1, n_blocks):
                    prev = stage
                    prev_phase = ((kv_idx + j - 1) // STAGES) & 1
                    stage = (kv_idx + j) % STAGES
                    _take_turn(turn_bars, turn + j, WG, PINGPONG)
                    mbarrier.wait(k_ready.index(stage), ((kv_idx + j) // STAGES) & 1)
                    s = warpgroup_mma(q_smem, k_bufs.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                    mbarrier.wait(v_ready.index(prev), prev_phase)
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
                    _pass_turn(turn_bars, WG, PINGPONG)
                    # wgmma groups retire in order: waiting down to one outstanding retires QK^T, while P @ V
                    # keeps running under this block's softmax.
                    s = warpgroup_mma_wait(1, deps=(s, ))
                    mbarrier.arrive(k_empty.index(stage))
                    p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, j, offs_m, mask_from, seqlen_k, causal_offset,
                                                        qk_scale, BLOCK_N, s_layout, IS_CAUSAL)
                    acc = warpgroup_mma_wait(0, deps=(acc, ))
                    mbarrier.arrive(v_empty.index(prev))
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                # Every QK^T of the tile has retired: the loader may bring the next tile's Q.
                mbarrier.arrive(q_empty.index(WG))
                mbarrier.wait(v_ready.index(stage), ((kv_idx + n_blocks - 1) // STAGES) & 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p_op, v_bufs.index(stage), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(stage))
                kv_idx += n_blocks
                turn += n_blocks
                tile_i += 1

                # Rows that saw no key have l = 0: out 0, lse -inf.
                seen = l_i > 0.0
                l_safe = gl.where(seen, l_i, 1.0)
                lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
                o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout)), 1)
                if (m_start + BLOCK_M <= seqlen_q) & TMA_STORE:
                    # A whole tile goes out through shared memory as one bulk copy, after the last one has
                    # left this buffer.
                    tma.store_wait(0)
                    gl.thread_barrier()
                    o_smem.store(o.to(dtype))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(o_desc, [q_start + m_start, head * HEAD_DIM], o_smem)
                else:  # masked stores: a tile's rows past the sequence belong to the next one
                    offs_mo = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
                    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                    rows = (q_start + offs_mo).to(gl.int64)
                    ptrs = out_ptr + gl.expand_dims(rows * stride_o_tok + head * stride_o_h, 1) + \
                        gl.expand_dims(offs_d, 0)
                    gl.store(ptrs, o.to(dtype), mask=gl.expand_dims(offs_mo < seqlen_q, 1))
                gl.store(lse_ptr + head.to(gl.int64) * total_q + q_start + offs_m, lse, mask=offs_m < seqlen_q)
        tma.store_wait(0)  # shared memory must outlive the last bulk store

    @gluon.jit
    def _hopper_attn_fwd(q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, cu_seqlens_q, cu_seqlens_k, tile_list,
                         qk_scale, total_q, num_heads, num_m_tiles, row_group, num_tiles, group_size, stride_o_tok,
                         stride_o_h, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                         TMA_STORE: gl.constexpr, TILE_LIST: gl.constexpr):
        """Programs stride over the work tiles (persistent when the grid is smaller than the tile count):
        the loader fetches the next tile's Q and first K/V blocks while the consumers finish this one."""
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        # The consumers' output staging: Q's buffer is already refilled for the next tile by then. Without
        # TMA_STORE nothing is staged; Q's buffers stand in for the unused argument.
        if TMA_STORE:
            o_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], o_desc.layout)
        else:
            o_bufs = q_bufs
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
            mbarrier.init(turn_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
            mbarrier.init(v_empty.index(i), count=2)

        bufs = (q_bufs, k_bufs, v_bufs, o_bufs)
        bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars)
        sched = (cu_seqlens_q, cu_seqlens_k, tile_list, num_heads, num_m_tiles, row_group, num_tiles)
        # Default partition (these 4 warps): consumer 0. Workers: consumer 1 (4 warps, all the registers it
        # asks for) and the loader (1 warp, the minimum 24 registers per thread).
        gl.warp_specialize([
            (_consumer, (bufs, bars, o_desc, out_ptr, lse_ptr, sched, qk_scale, total_q, stride_o_tok, stride_o_h, 0,
                         HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, TMA_STORE, TILE_LIST)),
            (_consumer, (bufs, bars, o_desc, out_ptr, lse_ptr, sched, qk_scale, total_q, stride_o_tok, stride_o_h, 1,
                         HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, TMA_STORE, TILE_LIST)),
            (_loader, ((q_desc, k_desc, v_desc), bufs, bars, sched, group_size, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                       IS_CAUSAL, TILE_LIST)),
        ], [4, 1], [240, 24])


_LAUNCHES = KernelLaunches(_hopper_attn_fwd) if GLUON_ERROR is None else None


@functools.cache
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def hopper_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out=None,
                   config=None):
    """Packed varlen forward, same contract as kernels.prefill.flash_attn_forward without paging or q_tiles:
    q [total_q, H, d], k/v [total_k, H_k, d] -> (out like q, lse [H, total_q] float32). Callers check
    kernels.hopper.supported first. config overrides _tile_config (tests of each knob)."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    if not softmax_scale > 0:  # the kernel takes each row's max before scaling
        raise ValueError(f"hopper_forward needs softmax_scale > 0, got {softmax_scale}")
    cfg = dict(_tile_config(head_dim, bool(causal)), **(config or {}))
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    # Output staging (two [BLOCK_M, d] tiles) only where it fits beside Q and the ring, and the copy engine can
    # address out.
    ring_bytes = (2 * block_m + 2 * cfg["STAGES"] * block_n) * head_dim * q.element_size()
    tma_store = cfg["TMA_STORE"] and tma_ok(out) and \
        ring_bytes + 2 * block_m * head_dim * q.element_size() <= _SMEM_BYTES
    num_m_tiles = triton.cdiv(max_seqlen_q, 2 * block_m)
    num_tiles = num_m_tiles * nheads * batch
    ragged = total_q != batch * max_seqlen_q or k.shape[0] != batch * max_seqlen_k
    listed = ragged and cfg["TILE_LIST"]
    tile_list = cu_seqlens_q  # unread unless listed
    if listed:
        tile_list, num_tiles = _ragged_tiles(cu_seqlens_q, nheads, total_q, 2 * block_m)
    grid = _grid_size(num_m_tiles, num_tiles, bool(causal), ragged, _num_sms(q.device)) if cfg["PERSISTENT"] else \
        num_tiles
    grid = min(cfg.get("PROGRAMS") or grid, num_tiles)  # PROGRAMS: tests run persistent programs on small inputs
    row_group = _row_group(num_m_tiles, grid) if causal and grid < num_tiles and not listed else 1
    q_desc = rows_descriptor(q, block_m)
    o_desc = rows_descriptor(out, block_m) if tma_store else q_desc  # unread without TMA_STORE
    _LAUNCHES.launch(
        (grid, 1, 1),
        (q_desc, rows_descriptor(k, block_n), rows_descriptor(v, block_n), o_desc, out, lse, cu_seqlens_q,
         cu_seqlens_k, tile_list, softmax_scale * _LOG2E, total_q, nheads, num_m_tiles, row_group, num_tiles,
         nheads // k.shape[1], out.stride(0), out.stride(1)),
        dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=cfg["STAGES"], IS_CAUSAL=bool(causal),
             PINGPONG=cfg["PINGPONG"], TMA_STORE=tma_store, TILE_LIST=listed),
        num_warps=4, maxnreg=cfg["maxnreg"])
    return out, lse
