"""The decoder's elementwise work in one kernel each, for inference: RMSNorm, rotary embedding (in place) and the
SwiGLU gate. Eager PyTorch runs each as several small kernels; a small model's step is bound by launches, and a
compiler (torch.compile) adds seconds to every start and tens of microseconds to every call. Math in float32,
rounded once at the end. The PyTorch references are the eager layers of service/model/layers.py."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # Round the normalized row to the input's dtype before scaling, as the reference implementations do.
    y = normed.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> RMSNorm(x) * weight, like x."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), dim, eps,
                                           BLOCK=triton.next_power_of_2(dim), num_warps=4 if dim <= 4096 else 8)
    return out.view(x.shape)


@triton.jit
def _rotate_heads(x_ptr, stride_tok, stride_head, token, n_heads, cos, sin, HALF: tl.constexpr,
                  HEADS: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    ok = heads < n_heads
    first = x_ptr + token * stride_tok + heads * stride_head + cols
    x1 = tl.load(first, mask=ok).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                 stride_cs, n_heads, n_heads_k, HALF: tl.constexpr, HEADS: tl.constexpr, HEADS_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cols)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + cols)
    _rotate_heads(q_ptr, stride_q_tok, stride_q_head, token, n_heads, cos, sin, HALF, HEADS)
    _rotate_heads(k_ptr, stride_k_tok, stride_k_head, token, n_heads_k, cos, sin, HALF, HEADS_K)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotates q [tokens, heads, head_dim] and k [tokens, heads_k, head_dim] in place (the half-split layout of
    Hugging Face checkpoints) by the angles of each token's position: cos_sin float32 [positions, head_dim], the
    cosines then the sines. head_dim must be a power of two (every Llama-family model's is)."""
    tokens, heads, head_dim = q.shape
    if head_dim & (head_dim - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"need a power-of-two head_dim with unit stride, got {head_dim}")
    if tokens:
        _rope_kernel[(tokens,)](q, k, positions, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                cos_sin.stride(0), heads, k.shape[1], HALF=head_dim // 2,
                                HEADS=triton.next_power_of_2(heads), HEADS_K=triton.next_power_of_2(k.shape[1]))
    return q, k


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise, for contiguous tensors of one shape."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    block = 1024
    if gate.numel():
        _silu_mul_kernel[(triton.cdiv(gate.numel(), block),)](gate, up, out, gate.numel(), BLOCK=block)
    return out
