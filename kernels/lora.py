"""Batched LoRA for serving: many adapters in one flat batch of token rows, each row's adapter chosen by an index.

Adapters live in slots: one buffer [slots, size] holds, at fixed offsets of each slot's row, every projection's
low-rank pair A [R, K] and B [N, R] (zero-padded to the slots' rank R), and scales [slots] each slot's
alpha / rank. For a projection y = x W^T (x [T, K], y [T, N]) lora_add_ adds, for the rows of slot s,
scale_s * (x A_s^T) B_s^T to y in place, in two launches for the projections of one input (q, k and v; gate and
up): the shrinks x A^T ([rows, R] per projection, each computed once, as float32 partial sums over ranges of K)
into a small buffer, then the expands, which add those up, scale them and add t B^T.

Rows are handed to the kernel in tiles of BLOCK_M rows of one slot (lora_tiles, built on the host from each
row's slot): a tile of a decode step gathers the rows of every sequence that uses that adapter, a tile of a
prompt covers its consecutive rows. Rows with no adapter are in no tile: they cost nothing but the host's index.
The tile count is fixed by the batch size (rows / BLOCK_M + slots, see max_tiles), so a CUDA graph captures two
launches per input (eight per layer) and replays them for any mix of adapters; unused tiles return at once.

A shrink program owns one tile, one projection and up to K_SPLIT of K; an expand program one tile and a chunk of
the output columns. (Until 2026-11-28 one program did both, each recomputing its tile's shrink for its chunk:
that doubled a LoRA step's cost over the projections'.) Decode steps of up to kernels.decode_linear.MAX_ROWS rows
take lora_shrink (a program per row and a few ranks, with CUDA cores: no 16-row tile for one row) and add the
expand inside their projection's kernel. Up to ROW_SHRINK_MAX_ROWS rows the shrinks of the projections that read an
RMSNorm's output come from that norm's kernel instead (_shrink_chunk, kernels/elementwise.py): lora_add_ takes them
as `shrunk` and only expands. Up to UPDATE_IN_NORM_MAX_ROWS rows o's whole update comes from the residual add that
reads o's output (_update_pair, _with_update): no launch of o's own for it. With SHRINKS_IN_MERGE, a decode step of
17-64 rows takes o's shrinks from the attention's merge of its splits (kernels.decode.decode_attention_shrinks).

Columns: past kernels.decode_linear.MAX_ROWS and up to COLUMNS_MAX_ROWS rows no expand runs at all. Each
projection group's weight carries every slot's B as extra columns (service/model/lora.py lays them out: projection
p's B of slot s at columns K + (p * slots + s) * R, zeros in the other projections' rows), and the shrinks are
written beside the input in the same order, each row's in its own slot's columns and zeros in the others' (the
norms' and lora_shrink's `columns`): one GEMM over [x | shrinks] then adds every row's update, for the cost of
reading projections * slots * R more columns of each weight row, and one launch for o (down's shrinks come from the
launch that computes its input, the SwiGLU gate: lora_shrink's `up`).
"""
import numpy as np
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_launch_dependents, gdc_wait, pdl_launch, zeroed_scratch

BLOCK_M = 16  # rows per tile: tl.dot's smallest
# Up to this many rows, the RMSNorm before a projection group computes the rows' shrinks for it (_shrink_chunk: a
# launch less), as the attention's merge does o's (SHRINKS_IN_MERGE); each row reads its slot's A alone there. At
# 256 (H200, 5be2526) LoRA graphs of 256 rows took 0.92-0.98x as long (8 adapters on 13 rows 1.659 ms against 1.809,
# on all rows 1.920 against 1.959), but served with 5% of 64 streams' requests on adapters (lora.py --served, whose
# steps of 65-256 rows are mixed ones: a prompt and the decodes) that phase read 33,445 tok/s against 42,109 at 64
# (fe35c41 and 9c378ed, one day; the phases without adapters 45,435 and 50,156).
ROW_SHRINK_MAX_ROWS = 64
# Past kernels.decode_linear.MAX_ROWS rows and up to this many, the GEMM of a projection group adds its rows' LoRA
# updates, in the columns layout (module doc); 0 turns that off. Past ROW_SHRINK_MAX_ROWS no norm computes shrinks
# and every group takes a lora_shrink launch (COLUMNS_SHRINK_LAUNCH), which reads each row's A alone. At 256 rows
# that beat lora_add_'s launches after the GEMMs in every run since c28a8ee (benchmarks/lora.py's variants; H200,
# a9b45da, the LoRA graph of 256 rows: 8 adapters on all rows 1.974 ms against 2.037, on 13 rows 1.819 against
# 1.993; 1 adapter 1.953 against 1.986).
COLUMNS_MAX_ROWS = 256
# Whether groups whose input comes with no shrinks (o and down; any past ROW_SHRINK_MAX_ROWS) take the columns too,
# their shrinks from one lora_shrink launch each (over all of K per row), or lora_add_'s two launches after their
# GEMM.
COLUMNS_SHRINK_LAUNCH = True
# Up to this many rows (at most ROW_SHRINK_MAX_ROWS; tensor parallelism off), o's LoRA updates are added by the
# residual add that reads o's output (kernels.elementwise.add_rms_norm_shrinks' `update`: its programs of a row with
# a slot read the attention's output row and o's A and B), not by a shrink launch and decode_linear's expands (or,
# past its rows, o's GEMM over the slots' columns). H200, 528261f, Qwen2.5-0.5B shape, LoRA graphs of 8 adapters
# over all rows captured both ways: batch 1 0.802 ms against 0.824 with o's own launches; batch 64 1.327 against
# 1.310 (each row's four programs of the add read o's A and B again: 57 KB each; 1.03x again at feb929f).
UPDATE_IN_NORM_MAX_ROWS = 16
# Past UPDATE_IN_NORM_MAX_ROWS and up to ROW_SHRINK_MAX_ROWS rows, whether a decode step's o shrinks come from the
# attention's merge of its splits (kernels.decode.decode_attention_shrinks: the merge writes [output | shrinks] in the
# columns layout, as the norms do for q/k/v and gate-up) rather than from a lora_shrink launch after it. H200, d0b29bb,
# Qwen2.5-0.5B shape, LoRA graphs of batch 64 captured both ways: 3 adapter rows 1.244 ms against 1.267 with o's own
# shrink launch, all rows on 8 adapters 1.300 against 1.306, 1 adapter 1.277 against 1.279 (benchmarks/lora.py).
SHRINKS_IN_MERGE = True
# From this many rows (0: never), the columns layout's shrinks that neither a norm nor the merge computes come from
# tiles of one slot's rows that share each read of their slot's A (_tile_columns_kernel; per row, a program reads its
# slot's A alone: 84 MB from L2 a layer at 256 rows over 8 adapters for the Qwen2.5-0.5B shape). q/k/v's and gate-up's
# norms and down's SwiGLU gate then write their result into the columns tensor and a launch after each adds the
# shrinks (columns_shrinks_); o's lora_shrink copies its input as it goes. LoRA decode graphs (H200, 5a499f0,
# benchmarks/lora.py's variants): 256 rows 0.94-0.95x with every row on an adapter, 0.98x on 13 of 256; 64 rows
# unchanged past 64, 1.07-1.08x from 17 (a slot's few rows share too little of A's reads to pay the sums' atomics).
# Tried and dropped (ef39113): q/k/v's and gate-up's tiles as programs of their norm's own launch, each normalizing
# its rows again (two launches a layer less): 1.01-1.02x the 256-row graphs (H200), the second pass over K costing
# more than the launches saved.
TILE_SHRINK_MIN_ROWS = 65
# Up to this K (a power of two), a tile program of _tile_columns_kernel takes all of K: one dot, its result final,
# where programs over K chunks add float32 sums atomically and the last to arrive takes them (three dependent trips
# to memory more). 0: chunks always.
TILE_WHOLE_K = 1024
# A's elements a norm's shrink program holds (_shrink_chunk): its ranks per program are this over K (rounded up to
# a power of two). 8192 is 64 registers a thread at 4 warps, 8 ranks a program at K 896 (six programs a row for
# q/k/v). 16384 read the same in LoRA graphs of 64 and 256 rows (H200, feb929f: within 1%).
SHRINK_CHUNK_ELEMENTS = 8192
MIN_RANK = 16  # the slots' rank is a power of two of at least this (tl.dot's smallest inner size)


def slot_rank(max_rank: int) -> int:
    """The rank the slots are padded to for adapters of rank up to max_rank."""
    return max(MIN_RANK, triton.next_power_of_2(max_rank))


def max_tiles(rows: int, slots: int) -> int:
    """Tiles a batch of `rows` rows over `slots` adapters can need: each slot's rows fill whole tiles but its last."""
    return -(-rows // BLOCK_M) + slots


def used_tiles(tiles: torch.Tensor, rows: int, slots: int) -> int:
    """How many of the first tiles a step of `rows` rows over `slots` slots can use (lora_tiles puts them first):
    each holds one row at least; up to BLOCK_M rows a slot's rows are one tile."""
    return min(tiles.shape[0], rows, slots if rows <= BLOCK_M else max_tiles(rows, slots))


def tiled_columns(rows: int) -> bool:
    """Whether a step of `rows` rows takes the columns layout's shrinks from tiles (TILE_SHRINK_MIN_ROWS)."""
    return bool(TILE_SHRINK_MIN_ROWS) and rows >= TILE_SHRINK_MIN_ROWS


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
def _tile_rows(TILES, j, BLOCK_M: tl.constexpr):
    """Tile j of lora_tiles' table: its slot (-1: an empty tile), its rows (int64, 0 for padding) and which of them
    are rows. The tiles are written before the step: kernels read them before their wait."""
    tile = TILES + j * (BLOCK_M + 1)
    slot = tl.load(tile)
    rows = tl.load(tile + 1 + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    return slot, tl.where(valid, rows, 0).to(tl.int64), valid


@triton.jit
def _tile_shrink_kernel(X, W, TILES, T, stride_x, stride_w, stride_split, stride_t, K, K_SPLIT, A0, A1, A2,
                        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, p, s): float32 partial sums over K range s of the tile's rows of x A_p^T, at columns
    [p * RANK, + RANK) of T[s] (a long K in several programs: one would stream down's 4864 alone)."""
    part = tl.program_id(1)
    a_at = tl.where(part == 0, A0, tl.where(part == 1, A1, A2))
    slot, rows, valid = _tile_rows(TILES, tl.program_id(0), BLOCK_M)  # before the wait, as the slots are read
    r = tl.arange(0, RANK)
    a_rows = W + tl.maximum(slot, 0).to(tl.int64) * stride_w + a_at + r[None, :] * K
    if PDL:  # kernels/configs.py: launched while the projection before it finishes, as the decode path's kernels
        gdc_wait()
        gdc_launch_dependents()
    if slot >= 0:
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        t = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k[None, :] < k_hi),
                        other=0.0)
            a = tl.load(a_rows + k[:, None], mask=k[:, None] < k_hi, other=0.0)
            t += tl.dot(x, a, input_precision=DOT_PRECISION)
        out = T + tl.program_id(2) * stride_split + rows[:, None] * stride_t + part * RANK + r[None, :]
        tl.store(out, t, mask=valid[:, None])


@triton.jit
def _expand_kernel(T, W, SCALES, TILES, Y0, Y1, Y2, stride_split, stride_t, stride_w, stride_y0, stride_y1,
                   stride_y2, N0, N1, N2, B0, B1, B2, SPLITS: tl.constexpr, RANK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (tile, chunk): y += t B^T for the tile's rows over one chunk of the outputs' columns."""
    # Which output this program writes: the column chunks of Y0, then Y1's, then Y2's.
    chunk = tl.program_id(1)
    part, y, n_out, b_at, stride_y = 0, Y0, N0, B0, stride_y0
    if chunk >= tl.cdiv(N0, N_CHUNK):
        chunk -= tl.cdiv(N0, N_CHUNK)
        part, y, n_out, b_at, stride_y = 1, Y1, N1, B1, stride_y1
        if chunk >= tl.cdiv(N1, N_CHUNK):
            chunk -= tl.cdiv(N1, N_CHUNK)
            part, y, n_out, b_at, stride_y = 2, Y2, N2, B2, stride_y2
    slot, rows, valid = _tile_rows(TILES, tl.program_id(0), BLOCK_M)
    r = tl.arange(0, RANK)
    weights = W + tl.maximum(slot, 0).to(tl.int64) * stride_w + b_at
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if slot >= 0:
        t_at = T + rows[:, None] * stride_t + part * RANK + r[None, :]
        t = tl.load(t_at, mask=valid[:, None], other=0.0)
        if SPLITS > 0:  # float32 partial sums of the shrink, added in a fixed order; SPLITS = 0: scaled and rounded
            for s in tl.static_range(1, SPLITS):
                t += tl.load(t_at + s * stride_split, mask=valid[:, None], other=0.0)
            # Scaled and rounded to the activations' dtype, as a dense LoRA layer's intermediate is.
            t = (t * tl.load(SCALES + slot)).to(Y0.dtype.element_ty)
        for n0 in range(chunk * N_CHUNK, tl.minimum(n_out, (chunk + 1) * N_CHUNK), BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            b = tl.load(weights + n[None, :] * RANK + r[:, None], mask=n[None, :] < n_out, other=0.0)
            ok = valid[:, None] & (n[None, :] < n_out)
            y_ptr = y + rows[:, None] * stride_y + n[None, :]
            out = tl.load(y_ptr, mask=ok, other=0.0).to(tl.float32) + tl.dot(t, b, input_precision=DOT_PRECISION)
            tl.store(y_ptr, out.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _row_slot(TILES, row, NUM_TILES: tl.constexpr, TILES_PADDED: tl.constexpr, BLOCK_M: tl.constexpr):
    """The slot of token row `row` (-1: none), from the tiles' row lists."""
    j = tl.arange(0, TILES_PADDED)
    used = j < NUM_TILES
    listed = tl.load(TILES + j[:, None] * (BLOCK_M + 1) + 1 + tl.arange(0, BLOCK_M)[None, :], mask=used[:, None],
                     other=-1)
    slots = tl.load(TILES + j * (BLOCK_M + 1), mask=used, other=-1)
    return tl.max(tl.where(tl.sum((listed == row).to(tl.int32), 1) > 0, slots, -1), 0)


@triton.jit
def _shrink_chunk(W, stride_w, SCALES, TILES, row, chunk, cols, K, A0, A1, A2, NUM_TILES: tl.constexpr,
                  TILES_PADDED: tl.constexpr, TILE_ROWS: tl.constexpr, RANK: tl.constexpr, RANK_CHUNK: tl.constexpr,
                  SLOTS: tl.constexpr):
    """For a kernel whose programs (row, chunk) each hold one whole row of a projection group's input (an RMSNorm's
    output): the part of the row's shrinks program `chunk` computes, RANK_CHUNK ranks of one projection, read
    before its wait (the slots and the tiles are written before the step). Returns (the row's slot, -1: none; its
    scale; A's rows [RANK_CHUNK, K] at columns cols, zeros without a slot; their columns in T, slot 0's in the
    columns layout, SLOTS > 0). _shrink_store ends it. (One program per row reading all of A took a dozen round
    trips to memory one after another: 11 us a norm.)"""
    slot = _row_slot(TILES, row, NUM_TILES, TILES_PADDED, TILE_ROWS)
    part = chunk // (RANK // RANK_CHUNK)
    r = (chunk % (RANK // RANK_CHUNK)) * RANK_CHUNK + tl.arange(0, RANK_CHUNK)
    # Offsets in the slots are multiples of the rank (slot_rank: 16 or more), which lets A's rows load as vectors
    a_at = tl.multiple_of(tl.where(part == 0, A0, tl.where(part == 1, A1, A2)), 16)
    a = tl.zeros((RANK_CHUNK, cols.shape[0]), W.dtype.element_ty)
    if slot >= 0:  # (a branch, not a mask: the mask of a bound known divisible lets the loads be vectors)
        w = W + slot.to(tl.int64) * stride_w + a_at
        a = tl.load(w + r[:, None] * K + cols[None, :], mask=cols[None, :] < K, other=0.0)
    t_cols = part * RANK + r
    if SLOTS > 0:  # the columns layout: each projection's columns hold every slot's ranks
        t_cols = part * (SLOTS * RANK) + r
    return slot, tl.load(SCALES + tl.maximum(slot, 0)), a, t_cols


@triton.jit
def _update_pair(W, stride_w, slot, A_AT, B_AT, K, cols, n_cols, RANK: tl.constexpr, BLOCK_K: tl.constexpr):
    """For a kernel that reads a row of a projection's output (at columns cols of n_cols) and adds the LoRA update
    of it itself (kernels.elementwise's residual add after o): that projection's A [RANK, K] and B [n_cols, RANK] in
    the row's slot, zeros without a slot, to read before the wait (the B of a row of 896 is 28 KB: read after the
    wait, it was a round trip to memory more in the step's path)."""
    w = W + tl.maximum(slot, 0).to(tl.int64) * stride_w
    r = tl.arange(0, RANK)
    k = tl.arange(0, BLOCK_K)
    a = tl.load(w + tl.multiple_of(A_AT, 16) + r[:, None] * K + k[None, :],
                mask=k[None, :] < tl.where(slot >= 0, K, 0), other=0.0)
    b = tl.load(w + tl.multiple_of(B_AT, 16) + cols[:, None] * RANK + r[None, :],
                mask=cols[:, None] < tl.where(slot >= 0, n_cols, 0), other=0.0)
    return a, b


@triton.jit
def _with_update(y, a, b, X, row, stride_x, K, slot, scale, BLOCK_K: tl.constexpr):
    """y, a row of a projection's output (float32, rounded as the layer rounds it), plus the update of the row's
    slot: scale * (x A^T) B^T for the row of the projection's input X [rows, K] and the A and B _update_pair read,
    the intermediate and the sum rounded to X's dtype as lora_add_ref rounds them. A row of no slot reads nothing
    and keeps y."""
    dtype = X.dtype.element_ty
    k = tl.arange(0, BLOCK_K)
    x = tl.load(X + row * stride_x + k, mask=k < tl.where(slot >= 0, K, 0), other=0.0).to(tl.float32)
    t = (tl.sum(a.to(tl.float32) * x[None, :], 1) * scale).to(dtype).to(tl.float32)
    return (y + tl.sum(b.to(tl.float32) * t[None, :], 1)).to(dtype).to(tl.float32)


@triton.jit
def _shrink_store(y, slot, scale, a, t_cols, T, row, stride_t, RANK: tl.constexpr, SLOTS: tl.constexpr,
                  SLOTS_PADDED: tl.constexpr):
    """scale * y A^T for the chunk _shrink_chunk read (y: the row, float32, rounded as stored), rounded to T's dtype
    as a dense LoRA layer's intermediate is, into the row's columns of T; nothing for a row of no slot. SLOTS > 0:
    the columns layout (module doc), the other slots' columns (all, for a row of no slot) set to zero."""
    if SLOTS > 0:
        t = tl.sum(a.to(tl.float32) * y[None, :], 1) * scale  # zeros without a slot: A reads as zeros
        _store_columns(T + row * stride_t, t_cols, t, slot, RANK, SLOTS, SLOTS_PADDED)
    elif slot >= 0:
        t = tl.sum(a.to(tl.float32) * y[None, :], 1) * scale
        tl.store(T + row * stride_t + t_cols, t.to(T.dtype.element_ty))


@triton.jit
def _store_columns(t_row, t_cols, t, slot, RANK: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PADDED: tl.constexpr):
    """A row's shrink values t (float32, at slot 0's columns t_cols of the columns layout) into its slot's columns
    of the row t_row, rounded; zeros into the same columns of every other slot."""
    s = tl.arange(0, SLOTS_PADDED)[:, None]
    values = tl.where(s == slot, t[None, :], 0.0)
    tl.store(t_row + s * RANK + t_cols[None, :], values.to(t_row.dtype.element_ty), mask=s < SLOTS)


def _shrinks_tensor(like: torch.Tensor, projections: int, weights: torch.Tensor, rank: int,
                    columns: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """What a shrink launch over rows [rows, K] like `like` writes: t [rows, projections * rank], or in the columns
    layout (module doc) [rows, K + projections * slots * rank]; the view of it the shrinks go to; the layout's
    constexprs (SLOTS = 0: compact)."""
    rows, k = like.shape
    slots = weights.shape[0] if columns else 0
    t = torch.empty(rows, (k if columns else 0) + projections * max(slots, 1) * rank, dtype=like.dtype,
                    device=like.device)
    return t, (t[:, k:] if columns else t), dict(SLOTS=slots, SLOTS_PADDED=triton.next_power_of_2(max(slots, 2)))


def shrink_chunks_args(like: torch.Tensor, lora: tuple | None, columns: bool = False,
                       tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int, dict]:
    """The launch of a kernel whose programs (row, chunk) normalize rows [rows, K] like `like` into a new tensor and
    run _shrink_chunk on them: (that tensor, T, chunks per row, its arguments) for lora = (slot weights, scales,
    tiles, rank, A offsets of the group's projections), or (the tensor, None, 1, arguments that turn it off).
    columns: the columns layout (module doc): T is [rows, K + projections * slots * rank], its first K columns the
    normalized rows (the tensor returned first is that view of it), the others the shrinks. tiled: a caller that
    runs tiled_shrinks_after_norm after its launch, which then adds the shrinks where they come from tiles
    (tiled_columns): the kernel only writes its rows into T."""
    rows, k = like.shape
    if lora is None:
        out = torch.empty_like(like)
        return out, None, 1, _no_shrinks(out)
    weights, scales, tiles, rank, a_offsets = lora
    t, shrinks, layout = _shrinks_tensor(like, len(a_offsets), weights, rank, columns)
    out = t[:, :k] if columns else torch.empty_like(like)
    if columns and tiled and tiled_columns(rows):
        return out, t, 1, _no_shrinks(out)
    num_tiles = used_tiles(tiles, rows, weights.shape[0])
    offsets = list(a_offsets) + [0] * (3 - len(a_offsets))
    rank_chunk = max(1, min(rank, SHRINK_CHUNK_ELEMENTS // triton.next_power_of_2(k)))
    return out, t, len(a_offsets) * rank // rank_chunk, dict(
        LW=weights, stride_lw=weights.stride(0), SCALES=scales, TILES=tiles, T=shrinks, stride_t=t.stride(0),
        A0=offsets[0], A1=offsets[1], A2=offsets[2], SHRINKS=True, NUM_TILES=num_tiles,
        TILES_PADDED=triton.next_power_of_2(max(num_tiles, 2)), TILE_ROWS=BLOCK_M, RANK=rank, RANK_CHUNK=rank_chunk,
        **layout)


def _no_shrinks(out: torch.Tensor) -> dict:
    """shrink_chunks_args' arguments of a norm that computes no shrinks."""
    return dict(LW=out, stride_lw=0, SCALES=out, TILES=out, T=out, stride_t=0, A0=0, A1=0, A2=0, SHRINKS=False,
                NUM_TILES=1, TILES_PADDED=2, TILE_ROWS=BLOCK_M, RANK=16, RANK_CHUNK=1, SLOTS=0, SLOTS_PADDED=2)


def tiled_shrinks_after_norm(t: torch.Tensor | None, k: int, lora: tuple | None, args: dict) -> None:
    """After a norm launched with shrink_chunks_args(like, lora, columns, tiled=True)'s T `t` and arguments `args`:
    where those left the shrinks to tiles (a T, and no shrinks in the norm), t's shrink columns (columns_shrinks_)."""
    if t is not None and not args["SHRINKS"]:
        weights, scales, tiles, rank, a_offsets = lora
        columns_shrinks_(t, k, weights, scales, tiles, rank, a_offsets,
                         used_tiles(tiles, t.shape[0], weights.shape[0]))


@triton.jit
def _input_block(X, UP, row, stride_x, stride_up, k, mask, SILU: tl.constexpr):
    """A block of a row of the shrink's input: X's; SILU: the SwiGLU gate silu(X) * UP of the gate and up rows
    there, rounded to X's dtype as kernels.elementwise.silu_mul rounds it."""
    x = tl.load(X + row * stride_x + k, mask=mask, other=0.0)
    if SILU:
        gate = x.to(tl.float32)
        up = tl.load(UP + row * stride_up + k, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty)
    return x


@triton.jit
def _shrink_kernel(X, UP, W, SCALES, TILES, T, XO, stride_x, stride_up, stride_w, stride_t, K, A0, A1, A2,
                   NUM_TILES: tl.constexpr, TILES_PADDED: tl.constexpr, RANK: tl.constexpr, RANK_BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PADDED: tl.constexpr,
                   SILU: tl.constexpr, PDL: tl.constexpr):
    row, part, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    a_at = tl.where(part == 0, A0, tl.where(part == 1, A1, A2))
    r = block * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    # The row's slot, its scale and the first K block of A are read before the wait: the tiles and the slots are
    # written before the step, never by the kernel before this one.
    slot = _row_slot(TILES, row, NUM_TILES, TILES_PADDED, BLOCK_M)
    # A row of no slot reads no A (a mask of one comparison: the interpreter does not take a scalar and a tensor
    # combined with &). In the columns layout (SLOTS > 0) the row's programs of projection 0 copy it to XO, T's
    # row, each the K blocks b with b % blocks == its block of ranks; a row of no slot has nothing else to do
    # and visits only those (one program copying a row of down's 4864 took five round trips to memory in a row).
    blocks = RANK // RANK_BLOCK
    a_end = tl.where(slot >= 0, K, 0)
    copies = part == 0
    no_slot = (slot < 0).to(tl.int32)
    k_start = no_slot * block * BLOCK_K
    k_step = BLOCK_K * (1 + no_slot * (blocks - 1))
    k_end = tl.where(copies, K, a_end) if SLOTS > 0 else a_end
    a_rows = W + tl.maximum(slot, 0).to(tl.int64) * stride_w + a_at + r[:, None] * K
    k = k_start + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + k[None, :], mask=k[None, :] < a_end, other=0.0)
    scale = tl.load(SCALES + tl.maximum(slot, 0))
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = _input_block(X, UP, row, stride_x, stride_up, k, k < k_end, SILU)
    if SLOTS > 0:
        if copies:
            tl.store(XO + row * stride_t + k, x, mask=k < tl.where((k_start // BLOCK_K) % blocks == block, K, 0))
    acc = a.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(k_start + k_step, k_end, k_step):  # K past one block (BLOCK_K is all of it up to 8192)
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + k[None, :], mask=k[None, :] < a_end, other=0.0)
        x = _input_block(X, UP, row, stride_x, stride_up, k, k < k_end, SILU)
        if SLOTS > 0:
            if copies:
                tl.store(XO + row * stride_t + k, x, mask=k < tl.where((k0 // BLOCK_K) % blocks == block, K, 0))
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    # Scaled and rounded to the activations' dtype, as a dense LoRA layer's intermediate is.
    t = tl.sum(acc, 1) * scale
    if SLOTS > 0:
        _store_columns(T + row * stride_t, part * (SLOTS * RANK) + r, t, slot, RANK, SLOTS, SLOTS_PADDED)
    else:
        tl.store(T + row * stride_t + part * RANK + r, t.to(T.dtype.element_ty),
                 mask=r < tl.where(slot >= 0, RANK, 0))


def lora_shrink(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, tiles: torch.Tensor, rank: int,
                a_offsets: list[int], num_tiles: int, columns: bool = False, up: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The shrinks of a few rows (a decode step's), each computed once: t [T, P * rank] in x's dtype, for each row
    of a slot s (listed in the first num_tiles of tiles) and each projection p (A_s at a_offsets[p] of the slot's
    row of weights, up to three): scale_s * x A_s^T at columns [p * rank, + rank). A row in no tile is left unset.
    Each program reads one row's A over all of K for a few of its ranks with CUDA cores (one row of x is no
    matrix for tl.dot), up to 8192 values of A: one round trip to memory, issued before the wait.
    columns: the columns layout (module doc), t [T, K + P * slots * rank] = [x | shrinks], every row set.
    up: x is the gate and up the up projection of a SwiGLU MLP (rows of equal shape, column slices of the fused
    gate-up output): the shrinks are those of silu(x) * up, which the columns layout also holds (the launch of
    kernels.elementwise.silu_mul saved)."""
    rows, k = x.shape
    t, shrinks, layout = _shrinks_tensor(x, len(a_offsets), weights, rank, columns)
    if rows == 0 or num_tiles == 0:
        if columns:  # no row has a slot
            if up is not None:  # rounded once, as the kernel rounds it
                x = (x.float() * torch.sigmoid(x.float()) * up.float()).to(x.dtype)
            t[:, :k], t[:, k:] = x, 0
        return t
    if columns and tiled_columns(rows):
        _tile_columns(x, up, weights, scales, tiles, rank, a_offsets, num_tiles, t, copy=True)
        return t
    # Up to a tile of rows all of K is one block, each program a rank or a few, its A loads issued before the wait.
    # More rows share the launch better with K in blocks and several ranks a program. Up to 64 rows: blocks of 2048,
    # eight ranks, 8 warps (H200, bf16, 8 slots, rank 16, columns layout, 64 rows of which 3 or all on adapters:
    # down's SwiGLU and shrinks 3.1 / 3.6 us, against 3.7 / 4.0 with blocks of 1024 and four ranks at 4 warps, and 11
    # with all of K a block; o's 1.3 / 1.4 either way). Past 64 (the columns up to 256 rows)
    # blocks of 1024 and 4096 values of A a program (four ranks from K 1024) at 4 warps, which read 7.3 us against
    # 17.1 with all of K a block at 256 rows; its graph of 256 rows took 5% longer with the 64-row blocks (13699ca)
    # where it had been 2-3% faster than the shipped one.
    if BLOCK_M < rows <= 64:
        block_k, rank_block, warps = min(triton.next_power_of_2(k), 2048), min(rank, 8), 8
    else:
        block_k, warps = min(triton.next_power_of_2(k), 8192 if rows <= BLOCK_M else 1024), 4
        rank_block = max(1, min(rank, 4096 // block_k))
    offsets = list(a_offsets) + [0] * (3 - len(a_offsets))
    _shrink_kernel[(rows, len(a_offsets), rank // rank_block)](
        x, x if up is None else up, weights, scales, tiles, shrinks, t, x.stride(0),
        x.stride(0) if up is None else up.stride(0), weights.stride(0), t.stride(0), k, *offsets,
        NUM_TILES=num_tiles, TILES_PADDED=triton.next_power_of_2(max(num_tiles, 2)), RANK=rank,
        RANK_BLOCK=rank_block, BLOCK_M=BLOCK_M, BLOCK_K=block_k, SILU=up is not None, num_warps=warps, **layout,
        **pdl_launch(x.device))
    return t


@triton.jit
def _tile_columns_kernel(X, UP, W, SCALES, TILES, T, SUMS, COUNTS, stride_x, stride_up, stride_w, stride_t, ROWS, K,
                         A0, A1, A2, NUM_TILES: tl.constexpr, TILES_PADDED: tl.constexpr, PARTS: tl.constexpr,
                         CHUNKS: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         COPY_ROWS: tl.constexpr, COPY_K: tl.constexpr, SLOTS: tl.constexpr,
                         SHRINK_COLS_PADDED: tl.constexpr, COPY: tl.constexpr,
                         SILU: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """lora_shrink's columns layout (T: [rows, K + PARTS * SLOTS * RANK]) from tiles of one slot's rows.
    The first NUM_TILES * PARTS * CHUNKS programs (tile, p, c): the tile's rows times its slot's A of projection p
    over K chunk c, one tl.dot whose A read the tile's rows share, added into float32 sums SUMS [rows, PARTS * RANK]
    (a chunk per program: one program streaming down's 4864 of K alone took 26 us a launch at 0878105). The last
    chunk of a (tile, p) to arrive scales and rounds the sums into the rows' p columns of every slot (zeros but
    their own) and puts the sums and its counter in COUNTS back to zero; with one chunk (CHUNKS = 1) the program
    stores its own dot so, touching neither. The others (a block of COPY_ROWS rows and
    COPY_K of K): COPY, the input (SILU: silu(X) * UP) into T's first K columns (else X is those columns, written by
    the launch before); in the first K block, zeros into all shrink columns of the rows of no slot (in no tile)."""
    pid = tl.program_id(0)
    if pid < NUM_TILES * PARTS * CHUNKS:
        j, part, chunk = pid // (PARTS * CHUNKS), (pid // CHUNKS) % PARTS, pid % CHUNKS
        slot, rows, valid = _tile_rows(TILES, j, BLOCK_M)  # the tiles and the slots: read before the wait
        r = tl.arange(0, RANK)
        k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        a_at = tl.where(part == 0, A0, tl.where(part == 1, A1, A2))
        a = tl.load(W + tl.maximum(slot, 0).to(tl.int64) * stride_w + a_at + r[None, :] * K + k[:, None],
                    mask=k[:, None] < tl.where(slot >= 0, K, 0), other=0.0)
        scale = tl.load(SCALES + tl.maximum(slot, 0))
        if PDL:  # (the sums and counters are touched after the wait: the launch before has left them zero)
            gdc_wait()
            gdc_launch_dependents()
        if slot >= 0:
            x = _input_block(X, UP, rows[:, None], stride_x, stride_up, k[None, :], valid[:, None] & (k[None, :] < K),
                             SILU)
            shrunk = tl.dot(x, a, input_precision=DOT_PRECISION)
            if CHUNKS == 1:  # all of K in this program: its sums are the tile's (no atomics, no counter)
                _store_tile_columns(T, rows, valid, shrunk * scale, slot, part, stride_t, K, RANK, SLOTS)
            else:
                sums = SUMS + rows[:, None] * (PARTS * RANK) + part * RANK + r[None, :]
                tl.atomic_add(sums, shrunk, mask=valid[:, None], sem="relaxed")
                # Every thread's sums are added before the count (a release at GPU scope); the last chunk to count
                # acquires them all, reading past L1.
                tl.debug_barrier()
                counter = COUNTS + j * PARTS + part
                if tl.atomic_add(counter, 1, sem="acq_rel") == CHUNKS - 1:
                    t = tl.load(sums, mask=valid[:, None], other=0.0, cache_modifier=".cg") * scale
                    _store_tile_columns(T, rows, valid, t, slot, part, stride_t, K, RANK, SLOTS)
                    tl.store(sums, tl.zeros((BLOCK_M, RANK), tl.float32), mask=valid[:, None])
                    tl.store(counter, 0)
    else:
        block = pid - NUM_TILES * PARTS * CHUNKS
        k_blocks = tl.cdiv(K, COPY_K)
        copy_rows = (block // k_blocks) * COPY_ROWS + tl.arange(0, COPY_ROWS)
        copy_k = (block % k_blocks) * COPY_K + tl.arange(0, COPY_K)
        in_batch = copy_rows < ROWS
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        copy_rows = copy_rows.to(tl.int64)
        if COPY:
            inside = in_batch[:, None] & (copy_k[None, :] < K)
            copied = _input_block(X, UP, copy_rows[:, None], stride_x, stride_up, copy_k[None, :], inside, SILU)
            tl.store(T + copy_rows[:, None] * stride_t + copy_k[None, :], copied, mask=inside)
        if block % k_blocks == 0:
            # Which of the rows some tile lists: every tile's row list at once, compared with the block's rows.
            entry = tl.arange(0, TILES_PADDED * BLOCK_M)
            used = entry < NUM_TILES * BLOCK_M
            listed = tl.load(TILES + (entry // BLOCK_M) * (BLOCK_M + 1) + 1 + entry % BLOCK_M, mask=used, other=-1)
            slots = tl.load(TILES + (entry // BLOCK_M) * (BLOCK_M + 1), mask=used, other=-1)
            listed = tl.where(slots >= 0, listed, -1)
            no_slot = tl.sum((listed[None, :] == copy_rows[:, None]).to(tl.int32), 1) == 0
            c = tl.arange(0, SHRINK_COLS_PADDED)
            tl.store(T + copy_rows[:, None] * stride_t + K + c[None, :],
                     tl.zeros((COPY_ROWS, SHRINK_COLS_PADDED), T.dtype.element_ty),
                     mask=(in_batch & no_slot)[:, None] & (c[None, :] < PARTS * SLOTS * RANK))


@triton.jit
def _store_tile_columns(T, rows, valid, t, slot, part, stride_t, K, RANK: tl.constexpr, SLOTS: tl.constexpr):
    """A tile's scaled shrinks t [BLOCK_M, RANK] (float32) of projection `part`, rounded to the activations' dtype
    as a dense LoRA layer's intermediate is, into its rows' columns of `slot` in T; zeros into every other slot's."""
    at = T + rows[:, None] * stride_t + K + part * (SLOTS * RANK) + tl.arange(0, RANK)[None, :]
    for s in tl.static_range(SLOTS):  # (2D stores: t may come from a dot, in the MMA layout)
        tl.store(at + s * RANK, tl.where(s == slot, t, 0.0).to(T.dtype.element_ty), mask=valid[:, None])


def _tile_columns(x, up, weights, scales, tiles, rank, a_offsets, num_tiles, t, copy: bool) -> None:
    """The columns layout's shrinks of t from tiles of one slot's rows (_tile_columns_kernel); copy: x (silu(x) * up
    with up) copied into t's first columns too, else x is those columns already."""
    rows, k = x.shape
    parts, copy_rows = len(a_offsets), 16
    # One K block a copy program without the copy: its rows' zeros only. K chunks of 256 (4 programs a tile for
    # q/k/v's 896, 19 for down's 4864: the fewest of a 24-shape sweep within 0.1 us of the best, H200, 5be2526),
    # or all of K one chunk up to TILE_WHOLE_K.
    copy_k = 512 if copy else triton.next_power_of_2(k)
    block_k = max(16, triton.next_power_of_2(k))
    if block_k > TILE_WHOLE_K:
        block_k = min(256, block_k)
    chunks = triton.cdiv(k, block_k)
    sums = zeroed_scratch("lora_tile_sums", x.device, rows * parts * rank, torch.float32)
    counts = zeroed_scratch("lora_tile_counts", x.device, num_tiles * parts, torch.int32)
    offsets = list(a_offsets) + [0] * (3 - len(a_offsets))
    slots = weights.shape[0]
    grid = num_tiles * parts * chunks + triton.cdiv(rows, copy_rows) * triton.cdiv(k, copy_k)
    _tile_columns_kernel[(grid,)](
        x, x if up is None else up, weights, scales, tiles, t, sums, counts, x.stride(0),
        x.stride(0) if up is None else up.stride(0), weights.stride(0), t.stride(0), rows, k, *offsets,
        NUM_TILES=num_tiles, TILES_PADDED=triton.next_power_of_2(max(num_tiles, 2)), PARTS=parts, CHUNKS=chunks,
        RANK=rank, BLOCK_M=BLOCK_M, BLOCK_K=block_k, COPY_ROWS=copy_rows, COPY_K=copy_k, SLOTS=slots,
        SHRINK_COLS_PADDED=triton.next_power_of_2(parts * slots * rank), COPY=copy, SILU=up is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, **pdl_launch(x.device))


def columns_shrinks_(t: torch.Tensor, k: int, weights: torch.Tensor, scales: torch.Tensor, tiles: torch.Tensor,
                     rank: int, a_offsets: list[int], num_tiles: int) -> torch.Tensor:
    """t = [x | shrinks] in the columns layout, x (its first k columns) written by the launch before (a norm, the
    SwiGLU gate): its shrink columns, in place, from tiles of one slot's rows (TILE_SHRINK_MIN_ROWS). Returns t."""
    if t.shape[0] and num_tiles:
        _tile_columns(t[:, :k], None, weights, scales, tiles, rank, a_offsets, num_tiles, t, copy=False)
    else:
        t[:, k:] = 0
    return t


def lora_add_(x: torch.Tensor, outputs: list[tuple[torch.Tensor, int, int]], weights: torch.Tensor,
              scales: torch.Tensor, tiles: torch.Tensor, rank: int, config: tuple | None = None,
              shrunk: torch.Tensor | None = None) -> None:
    """For up to three projections of one input x [T, K] (q, k and v, say): y [T, N] += scale_s * (x A_s^T) B_s^T
    for the rows of each slot s listed in tiles (lora_tiles, on the device), in place, in two launches (the
    shrinks, then the expands). outputs: (y, offset of A, offset of B) per projection, A [rank, K] and B [N, rank]
    at those offsets of each slot's row of weights [slots, size] (scales [slots]); y may be a column slice of a
    wider tensor. config: (N_CHUNK, BLOCK_K, num_stages) instead of CONFIG. shrunk: the shrinks, already computed
    (scaled and rounded, [T, projections * rank], as kernels.elementwise's norms give them): the expands only."""
    (rows, k), ys = x.shape, [y for y, _, _ in outputs]
    if x.stride(1) != 1 or weights.stride(1) != 1 or any(y.stride(1) != 1 for y in ys) or not 1 <= len(ys) <= 3:
        raise ValueError("lora_add_ needs one to three outputs, all with unit column strides")
    if rows == 0 or tiles.shape[0] == 0:
        return
    padded = outputs + [(ys[0][:, :0], 0, 0)] * (3 - len(outputs))
    n_chunk, block_k, stages = config or CONFIG
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 exact, as the model's own matmuls
    if shrunk is None:
        block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        k_split = triton.cdiv(K_SPLIT, block_k) * block_k
        splits = triton.cdiv(k, k_split)
        t = torch.empty(splits, rows, len(outputs) * rank, dtype=torch.float32, device=x.device)
        _tile_shrink_kernel[(tiles.shape[0], len(outputs), splits)](
            x, weights, tiles, t, x.stride(0), weights.stride(0), t.stride(0), t.stride(1), k, k_split,
            *(a for _, a, _ in padded), RANK=rank, BLOCK_M=BLOCK_M, BLOCK_K=block_k, DOT_PRECISION=precision,
            num_warps=4, num_stages=stages, **pdl_launch(x.device))
    else:
        splits, t = 0, shrunk[None]
    chunks = sum(triton.cdiv(y.shape[1], n_chunk) for y in ys)
    _expand_kernel[(tiles.shape[0], chunks)](
        t, weights, scales, tiles, *(y for y, _, _ in padded), t.stride(0), t.stride(1), weights.stride(0),
        *(y.stride(0) for y, _, _ in padded), *(y.shape[1] for y, _, _ in padded), *(b for _, _, b in padded),
        SPLITS=splits, RANK=rank, BLOCK_M=BLOCK_M, BLOCK_N=64, N_CHUNK=n_chunk, DOT_PRECISION=precision, num_warps=4,
        num_stages=stages, **pdl_launch(x.device))


# (N_CHUNK, BLOCK_K, num_stages) of lora_add_. Timed with the slots' weights read from HBM (benchmarks/
# step_profile.py --sections lora, Qwen2.5-0.5B shape, 64 and 256 rows over 8 adapters, H200, 2026-11-28):
# 64-column chunks (the most programs: no shrink is recomputed per chunk) and 256-long K tiles were best, or within
# 0.1 us of it (o at 64 rows), for every projection group at both row counts.
CONFIG = (64, 256, 3)
K_SPLIT = 1024  # K per shrink program (a multiple of BLOCK_K): a longer K takes several, summed by the expand


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
