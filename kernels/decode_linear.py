"""Linear layers of decode steps (up to MAX_ROWS token rows): y = x W^T (+ bias), with the SwiGLU gate in the
epilogue and the LoRA updates of the rows' adapter slots added, in one kernel (with adapters, after one launch of
their shrinks).

At a few rows a projection does almost no math: its time is streaming W from HBM once, plus the launch. Each
program streams a BLOCK_N-row slice of W over all of K, or over a range of K whose float32 partial sums the next
kernel adds up (`partials`: cuBLAS splits the down projection's K too, but adds a reduce kernel); what would be
launches of their own rides in the same program:
- the bias;
- SILU_MUL: W holds gate rows [0, N) then up rows [N, 2N) (the fused gate-up weight); a program computes both
  slices of its columns and writes silu(gate) * up;
- LoRA: the expand t B^T of the program's columns, for the tiles of kernels/lora.py (one adapter slot and its
  rows; up to MAX_ROWS rows a slot's rows are one tile, and a step has at most as many tiles as rows) side by
  side in one dot; a row keeps its own tile's columns. The shrinks t = x A^T come from the RMSNorm that produced
  x (q/k/v, gate-up: `shrunk`) or from kernels.lora.lora_shrink, launched just before (o, down): each row's once.
  (Recomputing them in every program of this kernel, as an earlier version did, cost more than the projection
  itself: gate-up at 1 row 21 us against 8, at 16 rows 56.) Which rows use which slot (the tiles, written before
  the step) and the tiles' B are read before the wait on the kernel before. Up to three projections of one input
  share the weight (q, k and v as one fused weight): the columns of projection p are [N_0 + .. + N_{p-1}, + N_p),
  each with its own A and B in the slots.

The model runs it up to MAX_ROWS rows; the kernel takes up to KERNEL_ROWS, for benchmarks/step_profile.py to time it
against cuBLAS (and against cuBLAS + kernels/lora.py with adapters) at 64 rows before a step of that size uses it.

Math in float32; the base projection and each LoRA intermediate rounded to the output dtype as the unfused layers
round them. The reference is decode_linear_ref.
"""
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_launch_dependents, gdc_wait, pdl_launch
from kernels.lora import BLOCK_M as TILE_ROWS
from kernels.lora import lora_shrink, used_tiles

MAX_ROWS = 16  # tl.dot's smallest M: the model's steps of more rows go to cuBLAS
KERNEL_ROWS = 64  # the kernel itself takes up to this many rows (benchmarks/step_profile.py times it against cuBLAS)


@triton.jit
def _decode_linear_kernel(X, W, BIAS, Y, stride_x, stride_w, stride_y, M, N, K, K_SPLIT,
                          LW, stride_lw, TILES, T, stride_t, N0, N1, B0, B1, B2,
                          HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NUM_TILES: tl.constexpr,
                          TILES_PADDED: tl.constexpr, TILE_ROWS: tl.constexpr, RANK: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    w_rows = W + n[:, None].to(tl.int64) * stride_w
    # The first weight tile is read before waiting on the previous kernel (weights are never written by a step).
    k = k_lo + tl.arange(0, BLOCK_K)
    k_ok = k[None, :] < k_hi
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
    if SILU_MUL:
        w_up = tl.load(w_rows + N * stride_w + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
    if NUM_TILES > 0:
        # LoRA, as one dot over the tiles side by side: column c of the wide intermediate is rank c % RANK of tile
        # c // RANK, and a row keeps only its own tile's columns. Which projection this program's columns belong to
        # (a program never straddles two: the launcher's BLOCK_N divides N0 and N1; SILU_MUL: gate is projection 0
        # and up projection 1, over the same columns), the rows' tiles and the tiles' B (slots are written before
        # the step) are read before the wait; only the first K split adds the update.
        proj, b_at, n_local = 0, B0, n
        if not SILU_MUL:
            if n_start >= N0 + N1:
                proj, b_at, n_local = 2, B2, n - N0 - N1
            elif n_start >= N0:
                proj, b_at, n_local = 1, B1, n - N0
        c = tl.arange(0, TILES_PADDED * RANK)
        tiles = tl.where(tl.program_id(1) == 0, NUM_TILES, 0)  # (masks of one comparison: the interpreter does not
        # take a scalar and a tensor combined with &)
        c_slot = tl.load(TILES + (c // RANK) * (1 + TILE_ROWS), mask=c // RANK < tiles, other=-1)
        b_rows = LW + tl.maximum(c_slot, 0).to(tl.int64)[:, None] * stride_lw + (c % RANK)[:, None]
        b_ok = (c_slot >= 0)[:, None] & n_ok[None, :]
        b = tl.load(b_rows + b_at + n_local[None, :] * RANK, mask=b_ok, other=0.0)
        if SILU_MUL:
            b_up = tl.load(b_rows + B1 + n_local[None, :] * RANK, mask=b_ok, other=0.0)
        row_tile = tl.full((BLOCK_M,), -1, tl.int32)
        for j in tl.static_range(NUM_TILES):  # each row's tile, from the tiles' row lists (-1 pads them)
            rows = tl.load(TILES + j * (1 + TILE_ROWS) + 1 + tl.arange(0, TILE_ROWS))
            row_tile = tl.where(tl.sum((rows[None, :] == m[:, None]).to(tl.int32), 1) > 0, j, row_tile)
        own = (row_tile[:, None] == (c // RANK)[None, :]) & (c // RANK < tiles)[None, :] & m_ok[:, None]
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if NUM_TILES > 0:  # the rows' shrinks (kernels.lora.lora_shrink, the kernel before), each in its tile's columns
        t_cols = T + m[:, None] * stride_t + (c % RANK)[None, :]
        t = tl.load(t_cols + proj * RANK, mask=own, other=0.0)
        if SILU_MUL:
            t_up = tl.load(t_cols + RANK, mask=own, other=0.0)
    x = tl.load(X + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k[None, :] < k_hi
        x = tl.load(X + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_rows + N * stride_w + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
            acc_up += tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    dtype = X.dtype.element_ty
    if SPLIT_K == 1:
        acc = acc.to(dtype).to(tl.float32)
        acc_up = acc_up.to(dtype).to(tl.float32)
    if NUM_TILES > 0:
        acc += tl.dot(t, b, input_precision=DOT_PRECISION)
        if SILU_MUL:  # the projections' outputs are rounded before the gate, as in the unfused layer
            acc_up += tl.dot(t_up, b_up, input_precision=DOT_PRECISION)
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
# whose consumer adds partial sums take them; gate-up needs whole sums for its gate. The sweep times one projection's
# calls chained; the step (--sections graphs) decides: on an H200 (2f7b295) configurations 7-22% faster in the sweep
# (more K splits, each program's whole slice before its wait) made the step 6-8% slower (benchmarks/results).
def _config(n: int, k: int, silu_mul: bool, partials: bool) -> tuple[int, int, int, int, int]:
    if silu_mul:
        return 32, (128 if k < 2048 else 256), 4, 3, 1
    if partials:
        return 32, 256, 4, 3, 4
    return (16, 512, 4, 3, 1) if k < 2048 else (32, 256, 4, 4, 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                  lora: tuple | None = None, partials: bool = False, config=None,
                  shrunk: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= KERNEL_ROWS, K] -> x weight^T (+ bias) [M, N] (x and weight with unit column strides: the weight may be
    the first K columns of a wider one, service/model/lora.py's); silu_mul: weight [2N, K] holds gate then up, the
    result is silu(x gate^T) * (x up^T) [M, N].

    lora: (slot weights [slots, size], scales [slots], tiles [num_tiles, 1 + TILE_ROWS] (kernels.lora.lora_tiles:
    rows < M), rank, [(N_p, A offset, B offset)] per projection (up to three, their N_p summing to N; with
    silu_mul: gate's and up's, N_p = N)) adds each tiled row's adapter update to each projection's columns.

    partials (not with silu_mul): float32 partial sums [S, M, N] over S ranges of K (S = 1 where splitting does
    not pay), for a consumer that adds them up (kernels.elementwise.add_rms_norm_, apply_rope_).

    shrunk: the rows' LoRA shrinks, already computed by the kernel that produced x (kernels.elementwise's norms,
    [M, projections * rank]), instead of a lora_shrink launch."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if rows > KERNEL_ROWS or x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(f"decode_linear needs x [<= {KERNEL_ROWS}, K] and a weight [N, K], both with unit column "
                         f"stride, got {tuple(x.shape)}, {tuple(weight.shape)}")
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
    num_tiles = 0 if lora is None else used_tiles(tiles, rows, lw.shape[0])
    t = y
    if num_tiles:  # each row's shrinks once, in a kernel of their own, rather than in every program of this one
        t = shrunk if shrunk is not None else lora_shrink(x, lw, scales, tiles, rank, [p[1] for p in parts],
                                                          num_tiles)
    parts = list(parts) + [(0, 0, 0)] * (3 - len(parts))
    if rows:
        _decode_linear_kernel[(triton.cdiv(n, block_n), splits)](
            x, weight, bias if bias is not None else weight, y, x.stride(0), weight.stride(0), n, rows, n, k, k_split,
            lw, lw.stride(0), tiles, t, t.stride(0), parts[0][0], parts[1][0], *(p[2] for p in parts),
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NUM_TILES=num_tiles,
            TILES_PADDED=triton.next_power_of_2(max(num_tiles, 2)), TILE_ROWS=TILE_ROWS, RANK=rank,
            BLOCK_M=max(MAX_ROWS, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits,
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
