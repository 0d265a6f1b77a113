"""Linear layers of decode steps (up to MAX_ROWS token rows): y = x W^T (+ bias), with the SwiGLU gate in the
epilogue and the LoRA updates of the rows' adapter slots added, in one kernel.

At a few rows a projection does almost no math: its time is streaming W from HBM once, plus the launch. Each
program streams a BLOCK_N-row slice of W over all of K, or over a range of K whose float32 partial sums the next
kernel adds up (`partials`: cuBLAS splits the down projection's K too, but adds a reduce kernel); what would be
launches of their own rides in the same program:
- the bias;
- SILU_MUL: W holds gate rows [0, N) then up rows [N, 2N) (the fused gate-up weight); a program computes both
  slices of its columns and writes silu(gate) * up;
- LoRA: for each tile of kernels/lora.py (one adapter slot and its rows; at most MAX_ROWS rows, so a slot's rows
  are one tile, and a step has at most as many tiles as rows), the shrink t = x A^T rides in the weight's loop,
  each K tile of x times that tile of A (recomputed by every program: A has `rank` rows and stays in L2, far
  cheaper than a launch, and the loop's weight loads hide it), then the expand t B^T of the program's columns.
  Which rows use which slot (the tiles, written before the step) is read before the wait on the kernel before. Up
  to three projections of one input share the weight (q, k and v as one fused weight): the columns of projection
  p are [N_0 + .. + N_{p-1}, + N_p), each with its own A and B in the slots.

Math in float32; the base projection and each LoRA intermediate rounded to the output dtype as the unfused layers
round them. The reference is decode_linear_ref.
"""
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_launch_dependents, gdc_wait, pdl_launch
from kernels.lora import BLOCK_M as TILE_ROWS

MAX_ROWS = 16  # tl.dot's smallest M; larger batches go to cuBLAS


@triton.jit
def _tile(j, slots, tile_ids, row_slot):
    """Tile j's slot (-1: unused) and which rows are its own (a slot's rows are one tile: those of that slot)."""
    slot = tl.sum(tl.where(tile_ids == j, slots, 0), 0)
    return slot, row_slot == tl.where(slot >= 0, slot, -2)


@triton.jit
def _lora_shrink(t, x, weights, a_at, k, a_ok, K, mine, RANK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """t plus x's rows in `mine` ([BLOCK_M, BLOCK_K], columns k) times those columns of A [RANK, K] at weights + a_at,
    transposed: one K tile of the shrink x A^T."""
    r = tl.arange(0, RANK)
    a = tl.load(weights + a_at + r[None, :] * K + k[:, None], mask=a_ok, other=0.0)
    return t + tl.dot(tl.where(mine[:, None], x, 0.0), a, input_precision=DOT_PRECISION)


@triton.jit
def _lora_expand(t, mine, weights, b_at, n_local, n_ok, RANK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """t's rows in `mine` ([BLOCK_M, RANK], scaled and rounded) times this program's columns of B [N_p, RANK] at
    weights + b_at."""
    r = tl.arange(0, RANK)
    b = tl.load(weights + b_at + n_local[None, :] * RANK + r[:, None], mask=n_ok[None, :], other=0.0)
    return tl.dot(tl.where(mine[:, None], t, 0.0), b, input_precision=DOT_PRECISION)


@triton.jit
def _shrink_tiles(t, t_up, x, slots, tile_ids, row_slot, LW, stride_lw, a_at, A1, k, k_hi, K,
                  NUM_TILES: tl.constexpr, RANK: tl.constexpr, SILU_MUL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K tile of every tile's shrinks (gate's and up's with SILU_MUL): the rows of different tiles are disjoint,
    so each shrink adds into one t. Without tiles, nothing is compiled: a projection without LoRA passes any tensor
    as LW (a loop of no iterations would still be compiled, and a float32 LW would not type-check against x)."""
    if NUM_TILES > 0:
        for j in range(NUM_TILES):
            slot, mine = _tile(j, slots, tile_ids, row_slot)
            weights = LW + tl.maximum(slot, 0).to(tl.int64) * stride_lw
            a_ok = k[:, None] < tl.where(slot >= 0, k_hi, 0)  # no A to read for an unused tile
            t = _lora_shrink(t, x, weights, a_at, k, a_ok, K, mine, RANK, DOT_PRECISION)
            if SILU_MUL:
                t_up = _lora_shrink(t_up, x, weights, A1, k, a_ok, K, mine, RANK, DOT_PRECISION)
    return t, t_up


@triton.jit
def _decode_linear_kernel(X, W, BIAS, Y, stride_x, stride_y, M, N, K, K_SPLIT,
                          LW, stride_lw, SCALES, TILES, N0, N1, A0, A1, A2, B0, B1, B2,
                          HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NUM_TILES: tl.constexpr,
                          TILES_PADDED: tl.constexpr,
                          TILE_ROWS: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    n_start = tl.program_id(0) * BLOCK_N
    n = n_start + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    n_ok = n < N
    # SPLIT_K > 1: program (n, s) sums K range s and writes float32 partial sums, which the consumer adds up
    # (kernels.elementwise.add_rms_norm_): more programs stream the weight of a tall projection (down's K of 4864
    # over only 896 columns), with no reduction kernel.
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    w_rows = W + n[:, None].to(tl.int64) * K
    # The first weight tile is read before waiting on the previous kernel (weights are never written by a step).
    k = k_lo + tl.arange(0, BLOCK_K)
    k_ok = k[None, :] < k_hi
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
    if SILU_MUL:
        w_up = tl.load(w_rows + N * K + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
    # LoRA: the projection of this program's columns (a program never straddles two: the launcher's BLOCK_N divides
    # N0 and N1; SILU_MUL: gate is projection 0 and up projection 1, over the same columns), each row's slot and
    # scale; the tiles and the slots are written before the step, so they are read before the wait.
    a_at, b_at, n_local = A0, B0, n
    if not SILU_MUL:
        if n_start >= N0 + N1:
            a_at, b_at, n_local = A2, B2, n - N0 - N1
        elif n_start >= N0:
            a_at, b_at, n_local = A1, B1, n - N0
    tile_ids = tl.arange(0, TILES_PADDED)
    slots = tl.load(TILES + tile_ids * (1 + TILE_ROWS), mask=tile_ids < NUM_TILES, other=-1)
    row_slot = tl.full((BLOCK_M,), -1, tl.int32)
    for j in tl.static_range(NUM_TILES):  # each row's slot, from the tiles' row lists (-1 pads them)
        rows = tl.load(TILES + j * (1 + TILE_ROWS) + 1 + tl.arange(0, TILE_ROWS))
        mine = tl.sum((rows[None, :] == m[:, None]).to(tl.int32), 1) > 0
        row_slot = tl.where(mine, tl.sum(tl.where(tile_ids == j, slots, 0), 0), row_slot)
    t = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)  # the shrinks x A^T: gate's (or the projection's) and up's
    t_up = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(X + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    t, t_up = _shrink_tiles(t, t_up, x, slots, tile_ids, row_slot, LW, stride_lw, a_at, A1, k, k_hi, K, NUM_TILES,
                            RANK, SILU_MUL, DOT_PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k[None, :] < k_hi
        x = tl.load(X + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_rows + N * K + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
            acc_up += tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
        t, t_up = _shrink_tiles(t, t_up, x, slots, tile_ids, row_slot, LW, stride_lw, a_at, A1, k, k_hi, K,
                                NUM_TILES, RANK, SILU_MUL, DOT_PRECISION)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    dtype = X.dtype.element_ty
    if SPLIT_K == 1:
        acc = acc.to(dtype).to(tl.float32)
        acc_up = acc_up.to(dtype).to(tl.float32)

    if NUM_TILES > 0:
        # Each row's intermediate scaled by its slot's alpha / rank and rounded, as the unfused layers round it.
        row_scale = tl.load(SCALES + row_slot, mask=row_slot >= 0, other=0.0)
        t = (t * row_scale[:, None]).to(dtype)
        t_up = (t_up * row_scale[:, None]).to(dtype)
        for j in tl.static_range(NUM_TILES):
            slot, mine = _tile(j, slots, tile_ids, row_slot)
            weights = LW + tl.maximum(slot, 0).to(tl.int64) * stride_lw
            b_ok = n < tl.where(slot >= 0, N, 0)
            acc += _lora_expand(t, mine, weights, b_at, n_local, b_ok, RANK, DOT_PRECISION)
            if SILU_MUL:
                acc_up += _lora_expand(t_up, mine, weights, B1, n_local, b_ok, RANK, DOT_PRECISION)
        if SILU_MUL:  # the projections' outputs are rounded before the gate, as in the unfused layer
            acc = acc.to(dtype).to(tl.float32)
            acc_up = acc_up.to(dtype).to(tl.float32)
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    out = Y + tl.program_id(1) * M * N + m[:, None] * stride_y + n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages, K splits), measured on the H100 for the Qwen2.5-0.5B and Llama-3.2-1B
# shapes at 1 and 16 rows with each call reading its weight from HBM, as in a decode step (benchmarks/step_profile.py
# --sections linear). A projection of a few MB is bound by latency more than by bytes: splitting K gives it more
# programs in flight (o of Qwen2.5-0.5B: 1.7 us in 4 splits, 2.8 whole; down: 5.2 against 6.9), so projections
# whose consumer adds partial sums take them; gate-up needs whole sums for its gate.
def _config(n: int, k: int, silu_mul: bool, partials: bool) -> tuple[int, int, int, int, int]:
    if silu_mul:
        return 32, (128 if k < 2048 else 256), 4, 3, 1
    if partials:
        return 32, 256, 4, 3, 4
    return (16, 512, 4, 3, 1) if k < 2048 else (32, 256, 4, 4, 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                  lora: tuple | None = None, partials: bool = False, config=None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (unit column stride) -> x weight^T (+ bias) [M, N]; silu_mul: weight [2N, K] holds
    gate then up, the result is silu(x gate^T) * (x up^T) [M, N].

    lora: (slot weights [slots, size], scales [slots], tiles [num_tiles, 1 + TILE_ROWS] (kernels.lora.lora_tiles:
    rows < M), rank, [(N_p, A offset, B offset)] per projection (up to three, their N_p summing to N; with
    silu_mul: gate's and up's, N_p = N)) adds each tiled row's adapter update to each projection's columns.

    partials (not with silu_mul): float32 partial sums [S, M, N] over S ranges of K (S = 1 where splitting does
    not pay), for a consumer that adds them up (kernels.elementwise.add_rms_norm_, apply_rope_)."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if rows > MAX_ROWS or x.stride(1) != 1 or not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError(f"decode_linear needs x [<= {MAX_ROWS}, K] with unit column stride and a contiguous "
                         f"weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if partials and silu_mul:
        raise ValueError("the SwiGLU gate needs whole sums: no partials with silu_mul")
    block_n, block_k, warps, stages, splits = config or _config(n, k, silu_mul, partials)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    splits = min(splits, triton.cdiv(k, block_k))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    if partials:
        y = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if lora is None:
        lw, scales, tiles, rank, parts = y, y, y, 16, [(n, 0, 0)]
    else:
        lw, scales, tiles, rank, parts = lora
        while not silu_mul and block_n > 16 and any(p[0] % block_n for p in parts[:-1]):
            block_n //= 2  # projections whose widths the configured tile does not divide
        straddles = not silu_mul and any(p[0] % block_n for p in parts[:-1])
        if sum(p[0] for p in parts) != n * (2 if silu_mul else 1) or straddles:
            raise ValueError(f"LoRA projections {[p[0] for p in parts]} must tile the {n} columns by {block_n}")
    parts = list(parts) + [(0, 0, 0)] * (3 - len(parts))
    # Used tiles come first and a slot's rows (<= MAX_ROWS) are one tile: no more tiles than rows are read.
    num_tiles = 0 if lora is None else min(tiles.shape[0], rows)
    if rows:
        _decode_linear_kernel[(triton.cdiv(n, block_n), splits)](
            x, weight, bias if bias is not None else weight, y, x.stride(0), n, rows, n, k, k_split,
            lw, lw.stride(0), scales, tiles, parts[0][0], parts[1][0], *(p[1] for p in parts), *(p[2] for p in parts),
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NUM_TILES=num_tiles,
            TILES_PADDED=triton.next_power_of_2(max(num_tiles, 2)), TILE_ROWS=TILE_ROWS, RANK=rank,
            BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
            **pdl_launch(x.device))
    return y


def decode_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                      lora: tuple | None = None, row_slots: torch.Tensor | None = None) -> torch.Tensor:
    """decode_linear in PyTorch, the layers' own order of roundings: the projection(s) rounded, each row's LoRA
    update added (kernels.lora.lora_add_ref, from each row's slot in row_slots, -1: none), then the gate."""
    from kernels.lora import lora_add_ref

    y = (x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)).to(x.dtype)
    if lora is not None:
        lw, scales, _, rank, parts = lora
        outputs, at = [], 0
        for cols, a_at, b_at in parts:
            outputs.append((y[:, at:at + cols], a_at, b_at))
            at += cols
        lora_add_ref(x, outputs, lw, scales, row_slots, rank)
    if silu_mul:
        gate, up = y.float().chunk(2, dim=1)
        y = (gate * torch.sigmoid(gate) * up).to(x.dtype)
    return y
