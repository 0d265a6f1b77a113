"""Building blocks of the decoder: RMSNorm, rotary position embedding, SwiGLU MLP.

Their elementwise math runs eagerly as a handful of small kernels each; a decode step of a small model is bound
by those launches, not by bytes, so on CUDA inference (no autograd) each runs as one Triton kernel of
kernels/elementwise.py instead. Training and the CPU keep the eager path, which is also the kernels' reference.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

from service.model.lora import add_slot_updates
from service.model.parallel import SINGLE, TensorParallel, all_reduce


def _use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and not torch.is_grad_enabled()


def rms_norm_ref(x, weight, eps: float):
    # Normalize in float32 and round before scaling, as the reference implementations do.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if _use_kernels(x):
            from kernels.elementwise import rms_norm
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling:  # llama3: long wavelengths slowed by `factor`, short kept, smooth blend in between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, blended))
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed by each token's position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        table = torch.empty(max_positions, head_dim)
        if not table.is_meta:  # loading rebuilds it on the device; on the meta device arange imports torch._dynamo
            table = self._table()
        self.register_buffer("cos_sin", table, persistent=False)

    def _table(self, device=None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]

    def rebuild(self, device) -> None:
        """Recompute the table after the module was materialized from the meta device."""
        self.cos_sin = self._table(device)

    def forward(self, positions, q, k):
        """q/k [..., tokens, heads, head_dim] with positions [..., tokens]. Inference on CUDA rotates q and k in
        place (they are fresh projections)."""
        if _use_kernels(q) and q.dim() == 3 and self.head_dim & (self.head_dim - 1) == 0:
            from kernels.elementwise import apply_rope_
            return apply_rope_(q, k, positions, self.cos_sin)
        return apply_rope_ref(q, k, positions, self.cos_sin)


def apply_rope_ref(q, k, positions, cos_sin):
    cos, sin = cos_sin[positions].unsqueeze(-2).to(q.dtype).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)  # the half-split layout of HF checkpoints
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def silu_mul_ref(gate, up):
    return F.silu(gate) * up


class MLP(nn.Module):
    """intermediate_size: this rank's share of the MLP width under tensor parallelism (its down_proj output is
    then a partial sum, all-reduced)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        add_slot_updates(x, (self.gate_proj, gate), (self.up_proj, up))
        if _use_kernels(gate):
            from kernels.elementwise import silu_mul
            hidden = silu_mul(gate, up)
        else:
            hidden = silu_mul_ref(gate, up)
        down = self.down_proj(hidden)
        add_slot_updates(hidden, (self.down_proj, down))  # before the all-reduce: this rank's share of the sum
        return all_reduce(down, self.tp)
