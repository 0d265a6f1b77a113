"""The training kernels (kernels/training.py), forward and backward, against autograd through the eager layers they
replace, computed in float64 on the same random inputs; sizes that are not powers of two (hidden 896, 14 and 2
heads, odd token counts). On the CPU the Triton kernels run in the interpreter."""
import pytest
import torch

from kernels import training
from tests.helpers import rel_err

DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


def _grads(fn, inputs, grad_out):
    """fn's outputs and the gradients of its inputs for the output gradients grad_out."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_out)
    return [o.detach() for o in outs], [t.grad for t in inputs]


def _check(fn, ref, inputs, grad_out, dtype):
    outs, grads = _grads(fn, inputs, grad_out)
    ref_outs, ref_grads = _grads(ref, [t.double() for t in inputs], [g.double() for g in grad_out])
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert got.dtype == dtype and rel_err(got.double(), want) < _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 896), (5, 3, 64), (1, 80)])
def test_rms_norm_forward_and_backward_match_autograd(device, dtype, shape):
    x = torch.randn(shape, device=device, dtype=dtype) * 3
    weight = torch.randn(shape[-1], device=device, dtype=dtype)
    grad = torch.randn(shape, device=device, dtype=dtype)
    _check(lambda t: training.rms_norm(t, weight, 1e-6), lambda t: training.rms_norm_ref(t, weight.double(), 1e-6),
           [x], [grad], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 4864), (3, 5, 7)])
def test_silu_mul_forward_and_backward_match_autograd(device, dtype, shape):
    gate, up, grad = (torch.randn(shape, device=device, dtype=dtype) * 2 for _ in range(3))
    _check(training.silu_mul, training.silu_mul_ref, [gate, up], [grad], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,heads,heads_k,head_dim", [((23,), 14, 2, 64), ((2, 9), 4, 4, 128), ((5,), 3, 1, 32)])
def test_rope_forward_and_backward_match_autograd(device, dtype, lead, heads, heads_k, head_dim):
    angles = torch.outer(torch.arange(4096.0), 1e6 ** -(torch.arange(0, head_dim, 2) / head_dim))
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(device)
    positions = torch.randint(0, 4096, lead, device=device)
    q, grad_q = (torch.randn(*lead, heads, head_dim, device=device, dtype=dtype) for _ in range(2))
    k, grad_k = (torch.randn(*lead, heads_k, head_dim, device=device, dtype=dtype) for _ in range(2))
    _check(lambda a, b: training.apply_rope(a, b, positions, cos_sin),
           lambda a, b: training.apply_rope_ref(a, b, positions, cos_sin.double()), [q, k], [grad_q, grad_k],
           dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("needs_input_grad", [True, False])
def test_lora_linear_adds_the_update_and_its_gradients(device, dtype, needs_input_grad):
    tokens, n_in, n_out, rank, scale = 37, 96, 40, 5, 2.5
    x = torch.randn(3, tokens, n_in, device=device, dtype=dtype)
    weight = torch.randn(n_out, n_in, device=device, dtype=dtype) / n_in ** 0.5
    a = torch.randn(rank, n_in, device=device, dtype=dtype) / n_in ** 0.5
    b = torch.randn(n_out, rank, device=device, dtype=dtype)
    grad = torch.randn(3, tokens, n_out, device=device, dtype=dtype)
    x64, a64, b64 = (t.double().requires_grad_(True) for t in (x, a, b))
    want = training.lora_linear_ref(x64, x64 @ weight.double().t(), None, a64, b64, scale)
    want.backward(grad.double())

    grad_a = torch.full((rank, n_in), 0.5, device=device)  # accumulates onto what is there
    grad_b = torch.full((n_out, rank), 0.5, device=device)
    xs = x.clone().requires_grad_(needs_input_grad)
    with torch.no_grad():
        out = xs @ weight.t()
    got = training.lora_linear(xs, out, weight, a.requires_grad_(True), b.requires_grad_(True), grad_a, grad_b, scale)
    got.backward(grad)
    assert got.dtype == dtype and rel_err(got.double(), want.detach()) < _tol(dtype)
    assert a.grad is None and b.grad is None
    assert rel_err(grad_a.double() - 0.5, a64.grad) < _tol(dtype)
    assert rel_err(grad_b.double() - 0.5, b64.grad) < _tol(dtype)
    if needs_input_grad:
        assert rel_err(xs.grad.double(), x64.grad) < _tol(dtype)
    else:
        assert xs.grad is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(37, 5001), (3, 101)])
def test_cross_entropy_grad_gives_the_loss_and_softmax_minus_onehot(device, dtype, rows, vocab):
    logits = torch.randn(rows, vocab, device=device, dtype=dtype) * 4
    labels = torch.randint(0, vocab, (rows,), device=device)
    labels[1] = -100
    want_loss, want_grad = training.cross_entropy_grad_ref(logits, labels, -100)
    loss = training.cross_entropy_grad_(logits, labels, -100)
    assert loss.dtype == torch.float32 and rel_err(loss, want_loss) < 1e-5
    assert rel_err(logits, want_grad) < _tol(dtype) and not logits[1].any()
    at = labels.clamp(min=0)[:, None]  # p - 1 at the targets, where rounding p first would lose digits
    assert rel_err(logits.double().gather(1, at), want_grad.gather(1, at)) < _tol(dtype)
