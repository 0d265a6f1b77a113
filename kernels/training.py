"""The decoder's training path with fewer, fused kernels: RMSNorm, SwiGLU's silu(gate) * up and the rotary
embedding, each one Triton kernel forward and one backward (eager autograd runs 5-15 small kernels per call and
pays host time for every one), and a LoRA projection whose update and gradients take one node of autograd.

The base weights are frozen in LoRA training, so no backward here computes a gradient of a norm's weight or a
projection's weight. Math in float32, rounded once per output. The PyTorch references (the *_ref functions, whose
backward autograd gives) compute what the eager layers of service/model/layers.py compute, in the inputs' dtype.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # The normalized row is rounded to the input's dtype before scaling, as the reference implementations do.
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(grad_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    normed = x * rstd
    dnormed = g * w
    # d/dx of x * rstd(x): rstd * (dnormed - normed * mean(dnormed * normed))
    dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, 0) / n_cols))
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)


def rms_norm_ref(x, weight, eps: float):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = _rows(x)
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(rows.shape[1])
        if rows.shape[0]:
            _rms_norm_fwd_kernel[(rows.shape[0],)](rows, weight, out, rstd, rows.shape[1], eps, BLOCK=block,
                                                   num_warps=4 if block <= 4096 else 8)
        ctx.save_for_backward(rows, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        g = _rows(grad)
        dx = torch.empty_like(rows)
        block = triton.next_power_of_2(rows.shape[1])
        if rows.shape[0]:
            _rms_norm_bwd_kernel[(rows.shape[0],)](g, rows, weight, rstd, dx, rows.shape[1], BLOCK=block,
                                                   num_warps=4 if block <= 4096 else 8)
        return dx.view(grad.shape), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim, differentiable in x (the weight is frozen)."""
    return _RMSNorm.apply(x, weight, eps)


def silu_mul_ref(gate, up):
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _silu_mul_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_bwd_kernel(grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    tl.store(dup_ptr + offs, (g * gate * sig).to(dup_ptr.dtype.element_ty), mask=ok)
    # silu'(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
    tl.store(dgate_ptr + offs, (g * up * sig * (1 + gate * (1 - sig))).to(dgate_ptr.dtype.element_ty), mask=ok)


_ELEMENTS = 1024  # elements per program of the elementwise kernels


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        if gate.numel():
            _silu_mul_fwd_kernel[(triton.cdiv(gate.numel(), _ELEMENTS),)](gate, up, out, gate.numel(),
                                                                          BLOCK=_ELEMENTS)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        if gate.numel():
            _silu_mul_bwd_kernel[(triton.cdiv(gate.numel(), _ELEMENTS),)](grad, gate, up, dgate, dup, gate.numel(),
                                                                          BLOCK=_ELEMENTS)
        return dgate, dup


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of one shape, differentiable in both."""
    return _SiluMul.apply(gate, up)


def apply_rope_ref(q, k, positions, cos_sin):
    cos, sin = cos_sin[positions].unsqueeze(-2).to(q.dtype).chunk(2, dim=-1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, n_heads, cos, sin, HALF: tl.constexpr, HEADS: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    ok = heads < n_heads
    at = token * n_heads * 2 * HALF + heads * 2 * HALF + cols
    x1 = tl.load(x_ptr + at, mask=ok).to(tl.float32)
    x2 = tl.load(x_ptr + at + HALF, mask=ok).to(tl.float32)
    tl.store(out_ptr + at, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + at + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr, n_heads, n_heads_k, sign,
                 HALF: tl.constexpr, HEADS: tl.constexpr, HEADS_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + cols)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + cols) * sign  # sign -1: the inverse rotation
    _rotate_heads(q_ptr, q_out_ptr, token, n_heads, cos, sin, HALF, HEADS)
    _rotate_heads(k_ptr, k_out_ptr, token, n_heads_k, cos, sin, HALF, HEADS_K)


def _rotate(q, k, positions, cos_sin, sign: float):
    """Rotations of contiguous q [tokens, heads, d] and k [tokens, heads_k, d] into new tensors."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0]:
        _rope_kernel[(q.shape[0],)](q, k, q_out, k_out, positions, cos_sin, q.shape[1], k.shape[1], sign,
                                    HALF=q.shape[2] // 2, HEADS=triton.next_power_of_2(q.shape[1]),
                                    HEADS_K=triton.next_power_of_2(k.shape[1]))
    return q_out, k_out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, cos_sin):
        shape_q, shape_k = q.shape, k.shape
        q, k = q.reshape(-1, *shape_q[-2:]).contiguous(), k.reshape(-1, *shape_k[-2:]).contiguous()
        positions = positions.reshape(-1).contiguous()
        q_out, k_out = _rotate(q, k, positions, cos_sin, 1.0)
        ctx.save_for_backward(positions, cos_sin)
        return q_out.view(shape_q), k_out.view(shape_k)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        positions, cos_sin = ctx.saved_tensors
        shape_q, shape_k = grad_q.shape, grad_k.shape
        dq, dk = _rotate(grad_q.reshape(-1, *shape_q[-2:]).contiguous(),
                         grad_k.reshape(-1, *shape_k[-2:]).contiguous(), positions, cos_sin, -1.0)  # R^T = R^-1
        return dq.view(shape_q), dk.view(shape_k), None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """q [..., heads, d] and k [..., heads_k, d] rotated by the angles of positions [...] (the half-split layout
    of Hugging Face checkpoints; cos_sin float32 [positions, d], cosines then sines), differentiable in q and k;
    d a power of two."""
    return _Rope.apply(q, k, positions, cos_sin.contiguous())


def lora_linear_ref(x, out, weight, a, b, scale: float) -> torch.Tensor:
    """The projection's output plus its LoRA update, out + scale * (x A^T) B^T, by autograd."""
    return out + (x @ a.t()) @ b.t() * scale


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out, weight, a, b, grad_a, grad_b, scale):
        rows = x.reshape(-1, x.shape[-1])
        xa = rows @ a.t()
        # added in place by the GEMM's epilogue (beta = 1): no scale, add or copy of [tokens, out] of its own
        out.view(-1, out.shape[-1]).addmm_(xa, b.t(), alpha=scale)
        ctx.mark_dirty(out)
        ctx.save_for_backward(rows, xa, weight, a, b)
        ctx.scale, ctx.grads, ctx.shape = scale, (grad_a, grad_b), x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, xa, weight, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gb = g @ b
        grad_a, grad_b = ctx.grads
        grad_b.add_(g.t() @ xa, alpha=ctx.scale)
        grad_a.add_(gb.t() @ rows, alpha=ctx.scale)
        dx = None
        if ctx.needs_input_grad[0]:  # the frozen projection's input gradient and the update's, in one output
            dx = (g @ weight).addmm_(gb, a, alpha=ctx.scale).view(ctx.shape)
        return dx, None, None, None, None, None, None, None


def lora_linear(x, out, weight, a, b, grad_a, grad_b, scale: float) -> torch.Tensor:
    """out (the frozen projection's output x W^T + bias, without autograd history) plus the LoRA update
    scale * (x A^T) B^T, added in place and returned, differentiable in x. A [r, in] and B [out, r] in x's dtype
    must require grad (so that the output does, even where x does not), but get none: their gradients are added
    into grad_a and grad_b (float32, the master weights' .grad), so that no autograd leaf, cast or accumulation
    node runs per projection."""
    return _LoRALinear.apply(x, out, weight, a, b, grad_a, grad_b, scale)


@triton.jit
def _cross_entropy_kernel(logits_ptr, labels_ptr, loss_ptr, stride, n_cols, ignore, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1e30, tl.float32)  # finite: a lane that sees only padding keeps s = 0, not NaN
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):  # online max and sum of exponentials, per lane
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
        m = new_m
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
    valid = label != ignore
    target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    for start in range(0, n_cols, BLOCK):  # softmax - onehot over the logits; 0 on rows without a target
        ok = start + cols < n_cols
        x = tl.load(base + start + cols, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        # the target's p - 1 from the logit itself (expm1), not from p rounded first
        p = tl.where(start + cols == label, tl.exp(target - lse) - 1.0, p)
        tl.store(base + start + cols, tl.where(valid, p, 0.0).to(logits_ptr.dtype.element_ty), mask=ok)


def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, ignore: int) -> torch.Tensor:
    """Cross-entropy of each row of logits [rows, vocab] (float32 [rows]; 0 where labels == ignore), and, in place
    of the logits, its gradient softmax - onehot(label) (zero rows where ignored): one pass to find each row's
    log-sum-exp, one to write."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        _cross_entropy_kernel[(logits.shape[0],)](logits, labels, loss, logits.stride(0), logits.shape[1], ignore,
                                                  BLOCK=2048, num_warps=8)
    return loss


def cross_entropy_grad_ref(logits: torch.Tensor, labels: torch.Tensor, ignore: int):
    """cross_entropy_grad_'s loss and gradient, out of place, in float64."""
    valid = labels != ignore
    log_probs = torch.log_softmax(logits.double(), -1)
    target = torch.where(valid, labels, 0)
    loss = -log_probs.gather(1, target[:, None])[:, 0] * valid
    grad = (log_probs.exp() - torch.nn.functional.one_hot(target, logits.shape[1])) * valid[:, None]
    return loss, grad
