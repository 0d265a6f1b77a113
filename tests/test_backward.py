"""FlashAttention backward against float64 autograd of the reference."""
import pytest
import torch

from kernels.backward import flash_attn_backward
from kernels.reference import varlen_attention_ref
from tests.helpers import cu_seqlens, random_seqlens, rel_err


def _grads_ref(q, k, v, do, cu_q, cu_k, scale, causal):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention_ref(q64, k64, v64, cu_q, cu_k, scale, causal)
    out.backward(do.double())
    return out, lse, (q64.grad, k64.grad, v64.grad)


def _check(lens_q, lens_k, nheads, nheads_k, head_dim, causal, dtype, device, tol):
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = torch.randn(sum(lens_q), nheads, head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(lens_k), nheads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn(sum(lens_k), nheads_k, head_dim, device=device, dtype=dtype)
    do = torch.randn_like(q)
    scale = head_dim ** -0.5
    out, lse, grads_ref = _grads_ref(q, k, v, do, cu_q, cu_k, scale, causal)
    grads = flash_attn_backward(do, q, k, v, out.to(dtype).detach(), lse.float().detach(), cu_q, cu_k,
                                max(lens_q), max(lens_k), scale, causal)
    for name, g, ref, x in zip("qkv", grads, grads_ref, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert rel_err(g, ref) < tol, f"d{name}: rel err {rel_err(g, ref):.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads,nheads_k", [(2, 2), (4, 2), (4, 1), (8, 1)])
def test_backward_varlen_gqa(causal, nheads, nheads_k, device):
    lens_q = random_seqlens(3, 40)
    lens_k = [lq + int(torch.randint(0, 9, ())) for lq in lens_q]  # seqlen_k >= seqlen_q, odd lengths
    dtype = torch.float32 if device == "cpu" else torch.float16
    _check(lens_q, lens_k, nheads, nheads_k, 32, causal, dtype, device, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("head_dim", [40, 64, 80])
def test_backward_head_dims(head_dim, device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    _check([19, 33], [19, 37], 2, 1, head_dim, True, dtype, device, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_fp16(causal, device):
    # On the CPU, fp16 with a power-of-two head_dim takes the TMA path (the interpreter takes it wherever it can);
    # the last tiles run past the tensor's end and across into the next sequence.
    _check([23, 17], [30, 17], 4, 2, 32, causal, torch.float16, device, 2e-2)


def test_backward_rows_without_keys(device):
    # seqlen_q > seqlen_k under bottom-right causal: the first rows see no key and must get zero gradient
    # (never NaN); an empty key sequence and an empty query sequence ride along.
    dtype = torch.float32 if device == "cpu" else torch.float16
    _check([21, 5, 0], [9, 0, 7], 2, 2, 32, True, dtype, device, 1e-4 if dtype == torch.float32 else 2e-2)


def test_backward_deterministic(device):
    lens = [37, 50]
    cu = cu_seqlens(lens, device)
    q, k, v, do = (torch.randn(sum(lens), 4, 32, device=device, dtype=torch.float16) for _ in range(4))
    out, lse = varlen_attention_ref(q.float(), k.float(), v.float(), cu, cu, 32 ** -0.5, True)
    args = (do, q, k, v, out.half(), lse, cu, cu, 50, 50, 32 ** -0.5, True)
    first = flash_attn_backward(*args, deterministic=True)
    second = flash_attn_backward(*args, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_backward_through_autograd(device):
    interface = pytest.importorskip("kernels.interface")
    dtype = torch.float32 if device == "cpu" else torch.float16
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    lens_q, lens_k = [13, 30], [20, 30]
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = torch.randn(sum(lens_q), 4, 32, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 32, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 32, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True).backward(do)
    _, _, grads_ref = _grads_ref(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, 32 ** -0.5, True)
    for name, x, ref in zip("qkv", (q, k, v), grads_ref):
        assert rel_err(x.grad, ref) < tol, f"d{name}: rel err {rel_err(x.grad, ref):.3g}"


def test_flash_attn_func_backward(device):
    interface = pytest.importorskip("kernels.interface")
    dtype = torch.float32 if device == "cpu" else torch.float16
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    q = torch.randn(2, 21, 4, 32, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 21, 1, 32, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 21, 1, 32, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    interface.flash_attn_func(q, k, v, causal=True).backward(do)
    cu = cu_seqlens([21, 21], device)
    _, _, grads_ref = _grads_ref(q.detach().flatten(0, 1), k.detach().flatten(0, 1), v.detach().flatten(0, 1),
                                 do.flatten(0, 1), cu, cu, 32 ** -0.5, True)
    for name, x, ref in zip("qkv", (q, k, v), grads_ref):
        assert rel_err(x.grad.flatten(0, 1), ref) < tol, f"d{name}: rel err"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen,head_dim,nheads_k", [(1024, 64, 8), (4096, 128, 2), (2048, 128, 8),
                                                      (1000, 96, 4), (777, 256, 2)])
def test_backward_gpu_bf16(seqlen, head_dim, nheads_k, causal):
    _check([seqlen], [seqlen], 8, nheads_k, head_dim, causal, torch.bfloat16, "cuda", 2e-2)


@pytest.mark.gpu
def test_backward_gpu_varlen_bf16():
    lens_q = random_seqlens(6, 1500, 1)
    lens_k = [lq + int(torch.randint(0, 200, ())) for lq in lens_q]
    _check(lens_q, lens_k, 16, 4, 128, True, torch.bfloat16, "cuda", 2e-2)
