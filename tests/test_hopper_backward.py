"""The Gluon warp-specialized Hopper backward (kernels/hopper_backward.py) against float32 autograd through the
reference and against our Triton backward. These need an sm_90 GPU with Triton 3.6; elsewhere
kernels.hopper.supported says False and the tests skip (CI only imports the module)."""
import pytest
import torch

from kernels import backward, hopper, hopper_backward
from kernels.reference import varlen_attention_ref
from tests.helpers import cu_seqlens, rel_err

TOL = 2e-2


def _inputs(lens_q, lens_k, nheads, nheads_k, head_dim, dtype):
    q = torch.randn(sum(lens_q), nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(max(sum(lens_k), 1), nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    return q, k, v, do, cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")


def _check(lens_q, lens_k, nheads, nheads_k, head_dim, causal, dtype=torch.bfloat16, **config):
    q, k, v, do, cu_q, cu_k = _inputs(lens_q, lens_k, nheads, nheads_k, head_dim, dtype)
    if not hopper.supported(q, k, v, do):
        pytest.skip("needs an sm_90 GPU and Triton 3.6")
    scale = head_dim ** -0.5
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    out32, lse = varlen_attention_ref(q32, k32, v32, cu_q, cu_k, scale, causal)
    out32.backward(do.float())
    out, lse = out32.detach().to(dtype), lse.detach()
    args = (do, q, k, v, lse, backward.row_deltas(out, do), cu_q, cu_k, max(lens_q), max(lens_k), scale, causal)
    grads = hopper_backward.hopper_backward(*args, config=config or None)
    for name, g, x in zip("qkv", grads, (q32, k32, v32)):
        assert g.shape == x.shape and g.dtype == dtype
        err = rel_err(g, x.grad)
        assert err < TOL, f"d{name}: rel err {err:.3g}"
    again = hopper_backward.hopper_backward(*args, config=config or None)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "not deterministic"
    return grads, (do, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gqa_ragged(causal, head_dim, dtype):
    # Lengths off the 64/128-row tiles and the key blocks, GQA 4:1.
    lens = [1, 17, 130, 257, 700]
    _check(lens, lens, 8, 2, head_dim, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_q_differs_from_k(causal, head_dim):
    # Chunked prefill (q shorter than k), q longer than k (causal rows that see no key: zero dQ, nothing to
    # dK/dV), an empty k and an empty q.
    lens_q = [5, 100, 300, 64, 200, 7, 0]
    lens_k = [40, 30, 700, 64, 0, 129, 33]
    _check(lens_q, lens_k, 4, 1, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{"STAGES": 3}, {"BLOCK_N_DQ": 64}, {"PAIR_MAJOR": False}])
def test_configs(config):
    # Every knob of the launcher's config at head_dim 128, other than its default (PAIR_MAJOR False: the order
    # head_dim 64 runs).
    lens = [129, 640, 383]
    _check(lens, [n + 50 for n in lens], 4, 2, 128, True, **config)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_matches_triton_backward_real_size(causal, monkeypatch):
    grads, args = _check([2048, 1000], [2048, 1000], 16, 4, 128, causal)
    monkeypatch.setattr(backward, "hopper_pays", lambda *_: False)  # the Triton kernels, not a dispatch to ours
    ref = backward.flash_attn_backward(*args)
    for name, g, r in zip("qkv", grads, ref):
        assert rel_err(g, r) < 1e-2, f"d{name} vs Triton: {rel_err(g, r):.3g}"
