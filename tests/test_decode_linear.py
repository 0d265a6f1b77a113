"""The decode steps' linear kernel (kernels/decode_linear.py) against its PyTorch reference: plain, with bias, with
the SwiGLU gate, and with LoRA tiles of several adapter slots, on fresh random inputs whose sizes are not multiples
of the kernel's blocks."""
import numpy as np
import pytest
import torch

from kernels.decode_linear import decode_linear, decode_linear_ref
from kernels.lora import lora_tiles, max_tiles
from tests.helpers import random_slots, rel_err


def _dtypes(device):
    return [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32, torch.float16]


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("k,n,bias", [(96, 80, True), (200, 64, False)])
def test_plain_and_bias(device, rows, k, n, bias):
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(rows * k)
        x = torch.randn(rows, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
        b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
        out = decode_linear(x, w, b)
        assert out.shape == (rows, n)
        assert rel_err(out, decode_linear_ref(x, w, b)) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_reads_rows_of_a_strided_view_and_a_large_k(device):
    x = torch.randn(3, 2500, device=device)[:, :2300]
    w = torch.randn(40, 2300, device=device) / 48
    assert rel_err(decode_linear(x, w), decode_linear_ref(x, w)) < 1e-5


@pytest.mark.parametrize("silu", [False, True])
def test_reads_a_weight_that_is_the_first_columns_of_a_wider_one(device, silu):
    """The fused weights carry the LoRA slots' columns beside K (service/model/lora.py): rows of K, further apart."""
    x = torch.randn(5, 300, device=device)
    wide = torch.randn(96, 300 + 136, device=device) / 17
    w = wide[:, :300]
    assert rel_err(decode_linear(x, w, silu_mul=silu), decode_linear_ref(x, w.contiguous(), silu_mul=silu)) < 1e-5


@pytest.mark.parametrize("rows,slots", [(1, 1), (7, 3), (16, 8), (40, 2), (64, 8)])
@pytest.mark.parametrize("silu", [False, True])
def test_lora_tiles_of_several_slots(device, rows, slots, silu):
    """Rows spread over `slots` adapters, one row with none; three projections (q, k, v) or gate and up. Past 16
    rows (the kernel takes up to KERNEL_ROWS) a slot's rows fill several tiles."""
    k, rank = 72, 16
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(rows * 10 + slots + silu)
        parts_n = [48, 48] if silu else [64, 32, 32]
        lw, scales, parts = random_slots(parts_n, k, slots, rank, device, dtype, gen)
        x = torch.randn(rows, k, generator=gen).to(device, dtype)
        w = (torch.randn(sum(parts_n), k, generator=gen) / k ** 0.5).to(device, dtype)
        row_slots = np.arange(rows, dtype=np.int32) % slots
        row_slots[rows // 2] = -1 if rows > 1 else row_slots[0]
        tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, 8))).to(device)
        lora = (lw, scales, tiles, rank, parts)
        out = decode_linear(x, w, silu_mul=silu, lora=lora)
        ref = decode_linear_ref(x, w, silu_mul=silu, lora=lora, row_slots=torch.from_numpy(row_slots).to(device))
        plain = decode_linear_ref(x, w, silu_mul=silu)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_err(out, ref) < tol
        assert rel_err(plain, ref) > 10 * tol  # the adapters' updates are not negligible: the test can fail


def test_refuses_projections_that_straddle_a_block(device):
    x, w = torch.randn(2, 32, device=device), torch.randn(72, 32, device=device)
    lw, scales, parts = random_slots([40, 32], 32, 1, 16, device, torch.float32, torch.Generator().manual_seed(0))
    tiles = torch.from_numpy(lora_tiles(np.zeros(2, dtype=np.int32), 2)).to(device)
    with pytest.raises(ValueError, match="tile"):
        decode_linear(x, w, lora=(lw, scales, tiles, 16, parts))


@pytest.mark.parametrize("lora_rows", [0, 3])
def test_partial_sums_over_k_add_up_to_the_projection(device, lora_rows):
    """A projection split over K: the float32 partials sum to the reference, LoRA rows included."""
    rows, k, n, rank = 3, 4200, 48, 16
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16
    lw, scales, parts = random_slots([n], k, 2, rank, device, dtype, gen)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    row_slots = np.array([1, -1, 0][:rows], dtype=np.int32) if lora_rows else np.full(rows, -1, dtype=np.int32)
    tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, 2))).to(device)
    lora = (lw, scales, tiles, rank, parts)
    out = decode_linear(x, w, lora=lora, partials=True)
    assert out.dtype == torch.float32 and out.dim() == 3 and out.shape[0] > 1
    ref = decode_linear_ref(x, w, lora=lora, row_slots=torch.from_numpy(row_slots).to(device))
    assert rel_err(out.sum(0).to(dtype), ref) < 2e-2
