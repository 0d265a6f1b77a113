"""Batched LoRA for serving: many adapters in one flat batch of token rows, each row's adapter chosen by an index.

Adapters live in slots: one buffer [slots, size] holds, at fixed offsets of each slot's row, every projection's
low-rank pair A [R, K] and B [N, R] (zero-padded to the slots' rank R), and scales [slots] each slot's
alpha / rank. For a projection y = x W^T (x [T, K], y [T, N]) the kernel adds, for the rows of slot s,
scale_s * (x A_s^T) B_s^T to y in place: the shrink (x A^T, [rows, R]) and the expand (t B^T) in one program, t
never leaving registers. Projections of one input (q, k and v; gate and up) share one launch.

Rows are handed to the kernel in tiles of BLOCK_M rows of one slot (lora_tiles, built on the host from each
row's slot): a tile of a decode step gathers the rows of every sequence that uses that adapter, a tile of a
prompt covers its consecutive rows. Rows with no adapter are in no tile: they cost nothing but the host's index.
The tile count is fixed by the batch size (rows / BLOCK_M + slots, see max_tiles), so a CUDA graph captures one
launch per input (four per layer) and replays it for any mix of adapters; unused tiles return at once.

Each program owns one tile and a chunk of the output columns: it computes the tile's t (the shrink, over all of K)
and then walks its columns. Small batches split the columns finely (many programs, a cheap shrink recomputed by
each), large ones coarsely (fewer shrinks per row).
"""
import numpy as np
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_launch_dependents, gdc_wait, pdl_launch

BLOCK_M = 16  # rows per tile: tl.dot's smallest
MIN_RANK = 16  # the slots' rank is a power of two of at least this (tl.dot's smallest inner size)


def slot_rank(max_rank: int) -> int:
    """The rank the slots are padded to for adapters of rank up to max_rank."""
    return max(MIN_RANK, triton.next_power_of_2(max_rank))


def max_tiles(rows: int, slots: int) -> int:
    """Tiles a batch of `rows` rows over `slots` adapters can need: each slot's rows fill whole tiles but its last."""
    return -(-rows // BLOCK_M) + slots


def lora_tiles(row_slots: np.ndarray, num_tiles: int) -> np.ndarray:
    """int32 [num_tiles, 1 + BLOCK_M]: each tile's slot (-1: an empty tile), then its rows (-1: padding). The rows of
    one slot, in order, fill consecutive tiles. row_slots: each row's slot, -1 for none."""
    tiles = np.full((num_tiles, 1 + BLOCK_M), -1, dtype=np.int32)
    rows = np.flatnonzero(row_slots >= 0)
    if not rows.size:
        return tiles
    rows = rows[np.argsort(row_slots[rows], kind="stable")]
    slots = row_slots[rows]
    at = 0
    for start, stop in zip(*_runs(slots)):
        for first in range(start, stop, BLOCK_M):
            chunk = rows[first:min(first + BLOCK_M, stop)]
            tiles[at, 0] = slots[start]
            tiles[at, 1:1 + len(chunk)] = chunk
            at += 1
    return tiles


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and stops of the runs of equal values in a sorted array."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(values)) + 1])
    return starts, np.concatenate([starts[1:], [len(values)]])


@triton.jit
def _lora_kernel(X, W, SCALES, TILES, Y0, Y1, Y2, stride_x, stride_w, stride_y0, stride_y1, stride_y2, K,
                 N0, N1, N2, A0, A1, A2, B0, B1, B2, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/configs.py: launched while the projection before it finishes, as the decode path's kernels
        gdc_wait()
        gdc_launch_dependents()
    # Which output this program writes: the column chunks of Y0, then Y1's, then Y2's.
    chunk = tl.program_id(1)
    y, n_out, a_at, b_at, stride_y = Y0, N0, A0, B0, stride_y0
    if chunk >= tl.cdiv(N0, N_CHUNK):
        chunk -= tl.cdiv(N0, N_CHUNK)
        y, n_out, a_at, b_at, stride_y = Y1, N1, A1, B1, stride_y1
        if chunk >= tl.cdiv(N1, N_CHUNK):
            chunk -= tl.cdiv(N1, N_CHUNK)
            y, n_out, a_at, b_at, stride_y = Y2, N2, A2, B2, stride_y2
    tile = TILES + tl.program_id(0) * (BLOCK_M + 1)
    slot = tl.load(tile)
    if slot >= 0:
        rows = tl.load(tile + 1 + tl.arange(0, BLOCK_M))
        valid = rows >= 0
        rows = tl.where(valid, rows, 0).to(tl.int64)
        weights = W + slot.to(tl.int64) * stride_w
        r = tl.arange(0, RANK)
        # Shrink: t = x A^T over all of K, accumulated in float32.
        t = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
            a = tl.load(weights + a_at + r[None, :] * K + k[:, None], mask=k[:, None] < K, other=0.0)
            t += tl.dot(x, a)
        # Rounded to the activations' dtype, as a dense LoRA layer's intermediate is.
        t = (t * tl.load(SCALES + slot)).to(X.dtype.element_ty)
        # Expand into this program's columns: y += t B^T.
        for n0 in range(chunk * N_CHUNK, tl.minimum(n_out, (chunk + 1) * N_CHUNK), BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            b = tl.load(weights + b_at + n[None, :] * RANK + r[:, None], mask=n[None, :] < n_out, other=0.0)
            ok = valid[:, None] & (n[None, :] < n_out)
            y_ptr = y + rows[:, None] * stride_y + n[None, :]
            out = tl.load(y_ptr, mask=ok, other=0.0).to(tl.float32) + tl.dot(t, b)
            tl.store(y_ptr, out.to(y.dtype.element_ty), mask=ok)


def lora_add_(x: torch.Tensor, outputs: list[tuple[torch.Tensor, int, int]], weights: torch.Tensor,
              scales: torch.Tensor, tiles: torch.Tensor, rank: int, config: tuple | None = None) -> None:
    """For up to three projections of one input x [T, K] (q, k and v, say): y [T, N] += scale_s * (x A_s^T) B_s^T
    for the rows of each slot s listed in tiles (lora_tiles, on the device), in place, in one launch. outputs:
    (y, offset of A, offset of B) per projection, A [rank, K] and B [N, rank] at those offsets of each slot's row
    of weights [slots, size] (scales [slots]); y may be a column slice of a wider tensor. config: (N_CHUNK,
    BLOCK_K, num_stages) instead of _config's."""
    (t, k), ys = x.shape, [y for y, _, _ in outputs]
    if x.stride(1) != 1 or weights.stride(1) != 1 or any(y.stride(1) != 1 for y in ys) or not 1 <= len(ys) <= 3:
        raise ValueError("lora_add_ needs one to three outputs, all with unit column strides")
    if t == 0 or tiles.shape[0] == 0:
        return
    padded = outputs + [(ys[0][:, :0], 0, 0)] * (3 - len(outputs))
    n_chunk, block_k, stages = config or _config(tiles.shape[0], sum(y.shape[1] for y in ys), k)
    chunks = sum(triton.cdiv(y.shape[1], n_chunk) for y in ys)
    _lora_kernel[(tiles.shape[0], chunks)](
        x, weights, scales, tiles, *(y for y, _, _ in padded), x.stride(0), weights.stride(0),
        *(y.stride(0) for y, _, _ in padded), k, *(y.shape[1] for y, _, _ in padded),
        *(a for _, a, _ in padded), *(b for _, _, b in padded), RANK=rank, BLOCK_M=BLOCK_M, BLOCK_N=64,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))), N_CHUNK=n_chunk, num_warps=4, num_stages=stages,
        **pdl_launch(x.device))


def _config(num_tiles: int, n: int, k: int) -> tuple[int, int, int]:
    """(N_CHUNK, BLOCK_K, num_stages) for `num_tiles` tiles, outputs n columns wide in all, and K = k. Timed on the
    H100 with the slots' weights read from HBM (benchmarks/step_profile.py --sections lora, Qwen2.5-0.5B shape, 64
    and 256 rows over 8 adapters): wide chunks for wide outputs (gate-up: 9.3 us against 17.0 for 64 columns at 64
    rows) and for many tiles (fewer shrinks recomputed per row), a long K tile for a long K (down: 10.1 against
    14.6), 128 columns and 128-long K tiles otherwise."""
    return (256 if n >= 4096 or num_tiles > 16 else 128), (512 if k >= 4096 else 128), 3


def lora_add_ref(x: torch.Tensor, outputs: list[tuple[torch.Tensor, int, int]], weights: torch.Tensor,
                 scales: torch.Tensor, row_slots: torch.Tensor, rank: int) -> None:
    """The reference of lora_add_, from each row's slot (-1: none): float32 math, the intermediate rounded to x's
    dtype as the kernel rounds it. Also the CPU path."""
    k = x.shape[1]
    for s in row_slots[row_slots >= 0].unique().tolist():
        rows = (row_slots == s).nonzero().squeeze(1)
        for y, a_at, b_at in outputs:
            a = weights[s, a_at:a_at + rank * k].view(rank, k)
            b = weights[s, b_at:b_at + y.shape[1] * rank].view(y.shape[1], rank)
            t = (x[rows].float() @ a.float().t() * scales[s].float()).to(x.dtype)
            y[rows] = (y[rows].float() + t.float() @ b.float().t()).to(y.dtype)
