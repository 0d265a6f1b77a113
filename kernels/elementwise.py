"""The decoder's elementwise work in one kernel each, for inference: RMSNorm, rotary embedding (in place) and the
SwiGLU gate (with, where adapters are served, the LoRA shrinks of the projections that read their results). Eager
PyTorch runs each as several small kernels; a small model's step is bound by launches, and a compiler
(torch.compile) adds seconds to every start and tens of microseconds to every call. Math in float32, rounded once
at the end. The PyTorch references are the eager layers of service/model/layers.py."""
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_launch_dependents, gdc_wait, pdl_launch
from kernels.lora import (
    _shrink_chunk,
    _shrink_store,
    _store_columns,
    _update_pair,
    _with_update,
    columns_shrinks_,
    lora_shrink,
    shrink_chunks_args,
    tiled_columns,
    tiled_shrinks_after_norm,
)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                     LW, stride_lw, SCALES, TILES, T, stride_t, A0, A1, A2, BLOCK: tl.constexpr,
                     SHRINKS: tl.constexpr, NUM_TILES: tl.constexpr, TILES_PADDED: tl.constexpr,
                     TILE_ROWS: tl.constexpr, RANK: tl.constexpr, RANK_CHUNK: tl.constexpr, SLOTS: tl.constexpr,
                     SLOTS_PADDED: tl.constexpr, PDL: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    live = chunk == 0
    if SHRINKS:  # program (row, chunk): a chunk of the row's LoRA shrinks (kernels.lora), A read before the wait
        slot, scale, a, t_cols = _shrink_chunk(LW, stride_lw, SCALES, TILES, row, chunk, cols, n_cols, A0, A1, A2,
                                               NUM_TILES, TILES_PADDED, TILE_ROWS, RANK, RANK_CHUNK, SLOTS)
        live = live | (slot >= 0)  # the other chunks of a row of no slot normalize nothing (below)
    if PDL:  # kernels/configs.py
        gdc_wait()
        gdc_launch_dependents()
    if live:
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        y = _normed_row(x, w_ptr, cols, ok, n_cols, eps, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
        if chunk == 0:
            tl.store(out_ptr + row * stride_out + cols, y, mask=ok)
        if SHRINKS:
            _shrink_store(y.to(tl.float32), slot, scale, a, t_cols, T, row, stride_t, RANK, SLOTS, SLOTS_PADDED)
    elif SLOTS > 0:
        _zero_columns(T, row, stride_t, t_cols, RANK, RANK_CHUNK, SLOTS, SLOTS_PADDED)


@triton.jit
def _zero_columns(T, row, stride_t, t_cols, RANK: tl.constexpr, RANK_CHUNK: tl.constexpr, SLOTS: tl.constexpr,
                  SLOTS_PADDED: tl.constexpr):
    """A program (row, chunk) of a row of no slot in the columns layout: zeros in its chunk's columns of every slot,
    without normalizing the row (chunk 0 does, for the output)."""
    _store_columns(T + row * stride_t, t_cols, tl.zeros((RANK_CHUNK,), tl.float32), -1, RANK, SLOTS, SLOTS_PADDED)


@triton.jit
def _normed_row(x, w_ptr, cols, ok, n_cols, eps, dtype: tl.constexpr):
    """RMSNorm of a float32 row times the weight; the normalized row is rounded to `dtype` before the weight scales
    it, as the reference implementations do."""
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return normed.to(dtype).to(tl.float32) * w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> RMSNorm(x) * weight, like x."""
    return _rms_norm(x, weight, eps, None)[0]


def rms_norm_shrinks(x: torch.Tensor, weight: torch.Tensor, eps: float, shrinks: tuple,
                     columns: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm of x [rows, dim] whose launch also computes the LoRA shrinks of the projections that read the result,
    scaled and rounded (each row's in a few programs that normalize it again, kernels.lora._shrink_chunk: a launch
    less). shrinks: (slot weights, scales, tiles, rank, A offsets of up to three projections). Returns (result,
    t [rows, projections * rank]); columns: t is [result | shrinks] in kernels.lora's columns layout, and the result
    a view of it."""
    return _rms_norm(x, weight, eps, shrinks, columns)


def _rms_norm(x, weight, eps, shrinks, columns=False):
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out, t, chunks, lora = shrink_chunks_args(rows, shrinks, columns, tiled=True)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0], chunks)](rows, weight, out, rows.stride(0), out.stride(0), dim, eps, **lora,
                                                  BLOCK=triton.next_power_of_2(dim),
                                                  num_warps=4 if dim <= 4096 else 8, **pdl_launch(x.device))
    tiled_shrinks_after_norm(t, dim, shrinks, lora)
    return (out if columns else out.view(x.shape)), t


@triton.jit
def _summed(ptr, stride_split, mask, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """A projection's output at ptr in float32: SPLITS > 1 partial sums over ranges of its K (kernels.decode_linear
    partials), stride_split apart, added in a fixed order; rounded to `dtype` as the layer rounds the projection."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        x += tl.load(ptr + s * stride_split, mask=mask, other=0.0).to(tl.float32)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, stride_split, stride_x, stride_res,
                         stride_res_out, stride_out, n_cols, eps, LW, stride_lw, SCALES, TILES, T, stride_t, A0, A1,
                         A2, XU, stride_xu, K_U, U_A, U_B, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         SHRINKS: tl.constexpr, NUM_TILES: tl.constexpr, TILES_PADDED: tl.constexpr,
                         TILE_ROWS: tl.constexpr, RANK: tl.constexpr, RANK_CHUNK: tl.constexpr, SLOTS: tl.constexpr,
                         SLOTS_PADDED: tl.constexpr, UPDATE: tl.constexpr, BLOCK_U: tl.constexpr, PDL: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    live = chunk == 0
    if SHRINKS:  # as in _rms_norm_kernel (the new residual then goes to another tensor: chunks read the old one)
        slot, scale, a, t_cols = _shrink_chunk(LW, stride_lw, SCALES, TILES, row, chunk, cols, n_cols, A0, A1, A2,
                                               NUM_TILES, TILES_PADDED, TILE_ROWS, RANK, RANK_CHUNK, SLOTS)
        live = live | (slot >= 0)
        if UPDATE:  # x's own projection's LoRA update, added here (add_rms_norm_shrinks' `update`): its A and B
            a_u, b_u = _update_pair(LW, stride_lw, slot, U_A, U_B, K_U, cols, n_cols, RANK, BLOCK_U)
    if PDL:  # kernels/configs.py
        gdc_wait()
        gdc_launch_dependents()
    if live:
        ok = cols < n_cols
        dtype = res_ptr.dtype.element_ty
        x = _summed(x_ptr + row * stride_x + cols, stride_split, ok, SPLITS, dtype)
        if UPDATE:
            x = _with_update(x, a_u, b_u, XU, row, stride_xu, K_U, slot, scale, BLOCK_U)
        res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        # The sum is rounded to the stream's dtype and normalized from there, as `residual + x` then RMSNorm would.
        total = (res + x).to(dtype)
        y = _normed_row(total.to(tl.float32), w_ptr, cols, ok, n_cols, eps, out_ptr.dtype.element_ty)
        y = y.to(out_ptr.dtype.element_ty)
        if chunk == 0:
            tl.store(res_out_ptr + row * stride_res_out + cols, total, mask=ok)
            tl.store(out_ptr + row * stride_out + cols, y, mask=ok)
        if SHRINKS:
            _shrink_store(y.to(tl.float32), slot, scale, a, t_cols, T, row, stride_t, RANK, SLOTS, SLOTS_PADDED)
    elif SLOTS > 0:
        _zero_columns(T, row, stride_t, t_cols, RANK, RANK_CHUNK, SLOTS, SLOTS_PADDED)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then RMSNorm(residual) * weight: the decoder's residual add and the next norm in
    one pass. residual [rows, dim]; x like it, or float32 partial sums [splits, rows, dim] of the projection that
    produced it (kernels.decode_linear partials), added up and rounded here."""
    return _add_rms_norm(x, residual, residual, weight, eps, None)[0]


def add_rms_norm_shrinks(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, shrinks: tuple,
                         columns: bool = False, update: tuple | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm_ that also computes the LoRA shrinks `shrinks` (rms_norm_shrinks', with its `columns`) of the
    projections that read the result, and writes the new residual to a new tensor (several programs read each row
    of the old one). Returns (result, new residual, t).

    update: (u [rows, K_u], A offset, B offset): x is the output of a projection of u (o's, of the attention's
    output) still without its LoRA updates, which the kernel adds to x first, each row's slot's (the slots and
    tiles of `shrinks`) scale * (u A^T) B^T rounded as kernels.lora.lora_add_ref rounds it: that projection's
    shrink and expand launches saved."""
    new_residual = torch.empty_like(residual)
    out, t = _add_rms_norm(x, residual, new_residual, weight, eps, shrinks, columns, update)
    return out, new_residual, t


def _add_rms_norm(x, residual, new_residual, weight, eps, shrinks, columns=False, update=None):
    rows, dim = residual.shape
    splits = x.shape[0] if x.dim() == 3 else 1
    if x.shape[-2:] != residual.shape or x.stride(-1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"x and residual must be [rows, dim] with unit column stride, got {tuple(x.shape)}, "
                         f"{tuple(residual.shape)}")
    u, u_a, u_b = update if update is not None else (residual, 0, 0)
    if update is not None and (shrinks is None or u.shape[0] != rows or u.stride(1) != 1):
        raise ValueError(f"an update needs shrinks and its input [{rows}, K] with unit column stride, got "
                         f"{tuple(u.shape)}")
    out, t, chunks, lora = shrink_chunks_args(residual, shrinks, columns, tiled=True)
    if update is not None and not lora["SHRINKS"]:
        raise ValueError("an update is added by a norm that computes the shrinks itself, not by tiles after it")
    if rows:
        # An update's A and B take 16K values each at rank 16 and K 896: eight warps hold them without spilling.
        _add_rms_norm_kernel[(rows, chunks)](
            x, residual, new_residual, weight, out, x.stride(0) if splits > 1 else 0, x.stride(-2), residual.stride(0),
            new_residual.stride(0), out.stride(0), dim, eps, **lora, XU=u, stride_xu=u.stride(0), K_U=u.shape[1],
            U_A=u_a, U_B=u_b, SPLITS=splits, BLOCK=triton.next_power_of_2(dim), UPDATE=update is not None,
            BLOCK_U=triton.next_power_of_2(u.shape[1]) if update is not None else 16,
            num_warps=4 if dim <= 4096 and update is None else 8, **pdl_launch(x.device))
    tiled_shrinks_after_norm(t, dim, shrinks, lora)
    return out, t


@triton.jit
def _rotate_heads(x_row, stride_split, stride_head, n_heads, cos, sin, out_row, stride_out_head,
                  HALF: tl.constexpr, HEADS: tl.constexpr, SPLITS: tl.constexpr):
    """Rotates one token's heads of x (x_row: that token's row, SPLITS partial sums stride_split apart) into out
    (out_row: that token's row there; x's own row rotates in place)."""
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    ok = heads < n_heads
    dtype = out_row.dtype.element_ty
    first = x_row + heads * stride_head + cols
    x1 = _summed(first, stride_split, ok, SPLITS, dtype)
    x2 = _summed(first + HALF, stride_split, ok, SPLITS, dtype)
    out = out_row + heads * stride_out_head + cols
    tl.store(out, (x1 * cos - x2 * sin).to(dtype), mask=ok)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dtype), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, q_out_ptr, stride_split, stride_q_tok, stride_q_head,
                 stride_k_tok, stride_k_head, stride_q_out_tok, stride_q_out_head, stride_cs, n_heads, n_heads_k,
                 v_ptr, stride_v_tok, stride_v_head, slot_ptr, k_cache, v_cache, stride_cache_slot,
                 stride_cache_head, HALF: tl.constexpr, HEADS: tl.constexpr, HEADS_K: tl.constexpr,
                 SPLITS: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/configs.py
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cols)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + cols)
    _rotate_heads(q_ptr + token * stride_q_tok, stride_split, stride_q_head, n_heads, cos, sin,
                  q_out_ptr + token * stride_q_out_tok, stride_q_out_head, HALF, HEADS, SPLITS)
    if STORE:  # k rotated, and v as it is, into the token's paged-cache slot (-1: padding, nothing written)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            _rotate_heads(k_ptr + token * stride_k_tok, stride_split, stride_k_head, n_heads_k, cos, sin,
                          k_cache + slot * stride_cache_slot, stride_cache_head, HALF, HEADS_K, SPLITS)
            heads = tl.arange(0, HEADS_K)[:, None]
            d = tl.arange(0, 2 * HALF)[None, :]
            ok = heads < n_heads_k
            v = _summed(v_ptr + token * stride_v_tok + heads * stride_v_head + d, stride_split, ok, SPLITS,
                        v_cache.dtype.element_ty)
            tl.store(v_cache + slot * stride_cache_slot + heads * stride_cache_head + d, v, mask=ok)
    else:
        k_row = k_ptr + token * stride_k_tok
        _rotate_heads(k_row, stride_split, stride_k_head, n_heads_k, cos, sin, k_row, stride_k_head, HALF, HEADS_K,
                      SPLITS)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, store=None):
    """Rotates q [tokens, heads, head_dim] and k [tokens, heads_k, head_dim] in place (the half-split layout of
    Hugging Face checkpoints) by the angles of each token's position: cos_sin float32 [positions, head_dim], the
    cosines then the sines. head_dim must be a power of two (every Llama-family model's is). Returns (q, k).

    store: (v, k_cache, v_cache, slot_mapping): instead of rotating k in place, writes rotated k and v into each
    token's slot of the paged caches [num_blocks, block_size, heads_k, head_dim] (kvcache.store's layout; slot -1
    writes nothing), saving the store's launch and a pass over k. Then q, k and v may also be float32 partial sums
    [splits, tokens, heads, head_dim] of the q/k/v projection (kernels.decode_linear partials), added up here: the
    rotated q is then a new tensor [tokens, heads, head_dim] of the caches' dtype."""
    *splits, tokens, heads, head_dim = q.shape
    if head_dim & (head_dim - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"need a power-of-two head_dim with unit stride, got {head_dim}")
    v, k_cache, v_cache, slots = store if store is not None else (k, k, k, positions)
    if store is not None and (v.stride(-1) != 1 or not k_cache.is_contiguous() or k_cache.shape != v_cache.shape
                              or k_cache.shape[2:] != k.shape[-2:]):
        raise ValueError("store needs v with unit stride and contiguous caches [blocks, block_size, heads_k, dim]")
    several = bool(splits) and splits[0] > 1  # a view's stride over a single split is arbitrary: not read then
    if splits and (store is None or several and not q.stride(0) == k.stride(0) == v.stride(0)):
        raise ValueError("partial sums q, k, v [splits, tokens, heads, dim] of one projection need store")
    q_out = torch.empty(q.shape[-3:], dtype=k_cache.dtype, device=q.device) if splits else q
    if tokens:
        _rope_kernel[(tokens,)](q, k, positions, cos_sin, q_out, q.stride(0) if several else 0, q.stride(-3),
                                q.stride(-2), k.stride(-3), k.stride(-2), q_out.stride(0), q_out.stride(1),
                                cos_sin.stride(0), heads, k.shape[-2], v, v.stride(-3), v.stride(-2), slots, k_cache,
                                v_cache, k.shape[-2] * head_dim, head_dim, HALF=head_dim // 2,
                                HEADS=triton.next_power_of_2(heads), HEADS_K=triton.next_power_of_2(k.shape[-2]),
                                SPLITS=splits[0] if splits else 1, STORE=store is not None, **pdl_launch(q.device))
    return q_out, k


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + row * stride_gate + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, elementwise, for tensors of one shape [..., n] whose rows may be column slices of wider ones
    (the two halves of the fused gate-up projection's output). out: where to write it, [rows, n] with unit column
    stride (a column slice of a wider tensor: kernels.lora's columns layout)."""
    shape, n = gate.shape, gate.shape[-1]
    gate, up = gate.reshape(-1, n), up.reshape(-1, n)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    if out is not None and (out.shape != gate.shape or out.stride(1) != 1):
        raise ValueError(f"out must be [{gate.shape[0]}, {n}] with unit column stride, got {tuple(out.shape)}")
    result = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    block = 1024
    if result.numel():
        _silu_mul_kernel[(gate.shape[0], triton.cdiv(n, block))](gate, up, result, gate.stride(0), up.stride(0),
                                                                 result.stride(0), n, BLOCK=block)
    return result.view(shape) if out is None else out


def columns_input(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, tiles: torch.Tensor, rank: int,
                  a_offsets: list[int], num_tiles: int, up: torch.Tensor | None = None) -> torch.Tensor:
    """[x | shrinks] in kernels.lora's columns layout for projections whose input no norm produced (o; down, whose
    input silu(x) * up this computes too, up given): one lora_shrink launch; or, where the shrinks come from tiles
    (kernels.lora.tiled_columns) and up is given, silu_mul into the columns and the tiles' launch after it."""
    rows, k = x.shape
    if up is not None and tiled_columns(rows):
        t = x.new_empty(rows, k + len(a_offsets) * weights.shape[0] * rank)
        silu_mul(x, up, out=t[:, :k])
        return columns_shrinks_(t, k, weights, scales, tiles, rank, a_offsets, num_tiles)
    return lora_shrink(x, weights, scales, tiles, rank, a_offsets, num_tiles, columns=True, up=up)
