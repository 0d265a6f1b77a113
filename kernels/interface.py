"""Public attention API mirroring flash-attn: validation, layout reshaping and autograd."""
import math
import os

import torch

from kernels.prefill import flash_attn_forward

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table):
    tensors = [q, k, v, cu_seqlens_q, cu_seqlens_k] + ([block_table] if block_table is not None else [])
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("q, k, v, cu_seqlens and block_table must be torch tensors")
    if len({t.get_device() for t in tensors}) != 1:  # an int per tensor (-1: CPU): cheaper than t.device
        raise ValueError(f"all inputs must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if not q.is_cuda and not _INTERPRET:
        raise ValueError(f"inputs must be CUDA tensors (got {q.device}); CPU needs TRITON_INTERPRET=1")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    kv_rank = 4 if block_table is not None else 3
    if q.dim() != 3 or k.dim() != kv_rank or v.dim() != kv_rank:
        raise ValueError(f"expected q of rank 3 and k/v of rank {kv_rank}, got {q.dim()}, {k.dim()}, {v.dim()}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    head_dim, nheads, nheads_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim or not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must match between q and k/v and be in 1..256, got {head_dim}, {k.shape[-1]}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
    if block_table is not None:
        batch = cu_seqlens_q.numel() - 1
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be int32 [batch={batch}, max_blocks], got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        block_size = k.shape[1]
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"paged block_size must be a power of two >= 16, got {block_size}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v must be contiguous in the head_dim axis")


class _FlashAttnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                block_table, deterministic):
        out, lse = flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, block_table)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, block_table is not None)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from kernels.backward import flash_attn_backward  # written separately; import only when needed

        max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, paged = ctx.args
        if paged:
            raise RuntimeError("backward through a paged KV cache is not supported")
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = flash_attn_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                         deterministic=deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, return_lse=False, block_table=None, deterministic=False):
    """Packed attention: q [total_q, H, d]; k/v [total_k, H_k, d] (or paged [num_blocks, block_size, H_k, d]
    with block_table int32 [batch, max_blocks]); cu_seqlens int32 [batch + 1]. Causal is bottom-right aligned.
    Returns out like q, plus lse [H, total_q] float32 (natural log) when return_lse."""
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(scale), bool(causal),
            block_table)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttnVarlen.apply(*args, deterministic)
    else:  # inference: no autograd node, whose bookkeeping costs more host time than the launch itself
        out, lse = flash_attn_forward(*args)
    return (out, lse) if return_lse else out


_STEPS: dict[tuple, torch.Tensor] = {}
_STEPS_KEPT = 64


def _steps(batch: int, seqlen: int, device) -> torch.Tensor:
    """cu_seqlens of `batch` sequences of `seqlen` tokens, kept per shape: a launch per call was host time.
    Kept tensors are never dropped (a captured CUDA graph may read one), so only the first _STEPS_KEPT shapes
    are kept, and none made while a graph is captured (they would live in the graph's memory pool)."""
    key = (batch, seqlen, device)
    cu = _STEPS.get(key)
    if cu is None:
        with torch.inference_mode(False):  # an inference tensor could not be saved for a later backward
            cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device) if seqlen else \
                torch.zeros(batch + 1, dtype=torch.int32, device=device)
        if len(_STEPS) < _STEPS_KEPT and not (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
            _STEPS[key] = cu
    return cu


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, deterministic=False):
    """Fixed-length attention: q [B, Sq, H, d], k/v [B, Sk, H_k, d]. Returns out like q, plus
    lse [B, H, Sq] float32 when return_lse."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise ValueError("flash_attn_func expects q, k, v as 4-D tensors [batch, seqlen, nheads, head_dim]")
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    cu_seqlens_q = _steps(batch, seqlen_q, q.device)
    cu_seqlens_k = cu_seqlens_q if seqlen_k == seqlen_q else _steps(batch, seqlen_k, q.device)
    out, lse = flash_attn_varlen_func(q.reshape(batch * seqlen_q, nheads, -1),
                                      k.reshape(batch * seqlen_k, *k.shape[2:]),
                                      v.reshape(batch * seqlen_k, *v.shape[2:]),
                                      cu_seqlens_q, cu_seqlens_k,
                                      seqlen_q, seqlen_k, softmax_scale, causal, True, deterministic=deterministic)
    out = out.view(batch, seqlen_q, nheads, -1)
    if not return_lse:
        return out
    return out, lse.view(nheads, batch, seqlen_q).transpose(0, 1)
