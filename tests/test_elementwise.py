"""The decoder's elementwise kernels (kernels/elementwise.py) against the eager layers they replace, on fresh
random inputs with sizes that are not powers of two (hidden 896, intermediate 4864, 14 and 2 heads)."""
import pytest
import torch

from kernels.elementwise import add_rms_norm_, apply_rope_, rms_norm, silu_mul
from service.model.layers import RotaryEmbedding, apply_rope_ref, rms_norm_ref, silu_mul_ref
from tests.helpers import rel_err

DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 896), (5, 14, 64), (1, 80)])
def test_rms_norm_matches_eager(device, dtype, shape):
    x = torch.randn(shape, device=device, dtype=dtype) * 3
    weight = torch.randn(shape[-1], device=device, dtype=dtype)
    assert rel_err(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)) < _tol(dtype)


def test_rms_norm_reads_rows_of_a_strided_view(device):
    wide = torch.randn(9, 1000, device=device)
    x = wide[:, :896]  # rows 1000 apart
    weight = torch.randn(896, device=device)
    assert rel_err(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,heads_k,head_dim", [(14, 2, 64), (4, 4, 128), (3, 1, 32)])
def test_rope_matches_eager_at_random_positions(device, dtype, heads, heads_k, head_dim):
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, None).to(device)
    tokens = 23
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, heads_k, head_dim, device=device, dtype=dtype)
    ref_q, ref_k = apply_rope_ref(q.float(), k.float(), positions, rotary.cos_sin)
    out_q, out_k = apply_rope_(q, k, positions, rotary.cos_sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert rel_err(out_q, ref_q) < _tol(dtype) and rel_err(out_k, ref_k) < _tol(dtype)


def test_rope_refuses_head_dims_that_are_not_powers_of_two(device):
    q = torch.randn(2, 2, 80, device=device)
    with pytest.raises(ValueError, match="power-of-two"):
        apply_rope_(q, q.clone(), torch.zeros(2, dtype=torch.long, device=device), torch.zeros(8, 80, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 4864), (1, 3), (0, 16)])
def test_silu_mul_matches_eager(device, dtype, shape):
    gate, up = (torch.randn(shape, device=device, dtype=dtype) * 4 for _ in range(2))
    out = silu_mul(gate, up)
    assert out.shape == gate.shape
    if gate.numel():
        assert rel_err(out, silu_mul_ref(gate.float(), up.float())) < _tol(dtype)


@pytest.mark.gpu
def test_gpu_bf16_at_real_sizes():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_ref(x.float(), w.float(), 1e-5)) < 1e-2
    rotary = RotaryEmbedding(128, 8192, 5e5, None).to("cuda")
    positions = torch.randint(0, 8192, (2048,), device="cuda")
    q, k = (torch.randn(2048, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8))
    ref_q, ref_k = apply_rope_ref(q.float(), k.float(), positions, rotary.cos_sin)
    apply_rope_(q, k, positions, rotary.cos_sin)
    assert rel_err(q, ref_q) < 1e-2 and rel_err(k, ref_k) < 1e-2
    gate, up = (torch.randn(2048, 14336, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert rel_err(silu_mul(gate, up), silu_mul_ref(gate.float(), up.float())) < 1e-2


def test_silu_mul_reads_the_halves_of_a_fused_projection(device):
    gate_up = torch.randn(5, 2 * 1000, device=device) * 3
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    assert rel_err(silu_mul(gate, up), silu_mul_ref(gate, up)) < 1e-5


def test_silu_mul_writes_into_the_first_columns_of_a_wider_tensor(device):
    """out: the first columns of kernels.lora's columns layout; the columns past them are left as they were."""
    gate_up = torch.randn(5, 2 * 1000, device=device) * 3
    wide = torch.full((5, 1000 + 48), 7.0, device=device)
    assert silu_mul(gate_up[:, :1000], gate_up[:, 1000:], out=wide[:, :1000]).data_ptr() == wide.data_ptr()
    assert rel_err(wide[:, :1000], silu_mul_ref(gate_up[:, :1000], gate_up[:, 1000:])) < 1e-5
    assert (wide[:, 1000:] == 7).all()
    with pytest.raises(ValueError, match="unit column stride"):
        silu_mul(gate_up[:, :1000], gate_up[:, 1000:], out=wide[:, :1000].t().contiguous().t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 896), (1, 80)])
def test_add_rms_norm_matches_add_then_eager_norm(device, dtype, shape):
    x, residual = (torch.randn(shape, device=device, dtype=dtype) * 3 for _ in range(2))
    weight = torch.randn(shape[-1], device=device, dtype=dtype)
    total = residual + x
    out = add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(residual, total)  # the stream is updated in place, rounded as `residual + x` rounds
    assert rel_err(out, rms_norm_ref(total, weight, 1e-6)) < _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_writes_rotated_keys_and_values_into_their_cache_slots(device, dtype):
    from kvcache.store import store_kv_ref
    heads, heads_k, head_dim, tokens, block = 6, 2, 64, 9, 16
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, None).to(device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    qkv = torch.randn(tokens, (heads + 2 * heads_k) * head_dim, device=device, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, heads_k * head_dim, heads_k * head_dim], dim=1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    slots = torch.randperm(4 * block, device=device)[:tokens]
    slots[3] = -1  # a padding row writes nothing
    ref_q, ref_k = apply_rope_ref(q.float(), k.float(), positions, rotary.cos_sin)
    ref_caches = [torch.zeros(4, block, heads_k, head_dim, device=device, dtype=torch.float32) for _ in range(2)]
    store_kv_ref(ref_k, v.float(), *ref_caches, slots)
    caches = [torch.zeros(4, block, heads_k, head_dim, device=device, dtype=dtype) for _ in range(2)]
    k_before = k.clone()
    apply_rope_(q, k, positions, rotary.cos_sin, store=(v, *caches, slots))
    assert rel_err(q, ref_q) < _tol(dtype)
    assert torch.equal(k, k_before)  # rotated into the cache, not in place
    assert rel_err(caches[0], ref_caches[0]) < _tol(dtype) and torch.equal(caches[1], ref_caches[1].to(dtype))


def test_add_rms_norm_adds_up_a_projections_partial_sums(device):
    partials = torch.randn(4, 5, 896, device=device)
    residual = torch.randn(5, 896, device=device, dtype=torch.float16)
    weight = torch.randn(896, device=device, dtype=torch.float16)
    total = residual + partials.sum(0).to(torch.float16)
    out = add_rms_norm_(partials, residual, weight, 1e-6)
    assert rel_err(residual, total) < 1e-3
    assert rel_err(out, rms_norm_ref(total, weight, 1e-6)) < 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,tokens", [(3, 5), (1, 1)])  # one split of one token: views' strides are arbitrary
def test_rope_adds_up_a_projections_partial_sums_into_q_and_the_cache(device, dtype, splits, tokens):
    from kvcache.store import store_kv_ref
    heads, heads_k, head_dim, block = 7, 1, 32, 8
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, None).to(device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    partials = torch.randn(splits, tokens, (heads + 2 * heads_k) * head_dim, device=device)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in partials.split(
        [heads * head_dim, heads_k * head_dim, heads_k * head_dim], dim=-1))
    slots = torch.randperm(3 * block, device=device)[:tokens]
    slots[tokens // 2] = -1 if tokens > 1 else slots[0]
    whole = [t.sum(0).to(dtype).float() for t in (q, k, v)]  # the projection as the layer rounds it
    ref_q, ref_k = apply_rope_ref(whole[0], whole[1], positions, rotary.cos_sin)
    ref_caches = [torch.zeros(3, block, heads_k, head_dim, device=device) for _ in range(2)]
    store_kv_ref(ref_k, whole[2], *ref_caches, slots)
    caches = [torch.zeros(3, block, heads_k, head_dim, device=device, dtype=dtype) for _ in range(2)]
    out_q, _ = apply_rope_(q, k, positions, rotary.cos_sin, store=(v, *caches, slots))
    assert out_q.shape == (tokens, heads, head_dim) and out_q.dtype == dtype
    assert rel_err(out_q, ref_q) < _tol(dtype)
    assert rel_err(caches[0], ref_caches[0]) < _tol(dtype) and torch.equal(caches[1], ref_caches[1].to(dtype))
    with pytest.raises(ValueError, match="need store"):
        apply_rope_(q, k, positions, rotary.cos_sin)
