"""Shared test helpers for the kernel tests."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it can never pass."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_slots(parts_n, k, slots, rank, device, dtype, gen):
    """LoRA slot weights [slots, size] holding, per projection of width n, A [rank, k] then B [n, rank]; random
    scales [slots]; each projection's (n, A offset, B offset)."""
    parts, size = [], 0
    for n in parts_n:
        parts.append((n, size, size + rank * k))
        size += rank * (k + n)
    weights = (torch.randn(slots, size, generator=gen) * 0.3).to(device, dtype)
    scales = (torch.rand(slots, generator=gen) + 0.5).to(device)
    return weights, scales, parts


def random_seqlens(batch: int, max_len: int, min_len: int = 1) -> list[int]:
    return torch.randint(min_len, max_len + 1, (batch,)).tolist()


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device)
