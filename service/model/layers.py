"""Building blocks of the decoder: RMSNorm, rotary position embedding, SwiGLU MLP, and the fused projections.

Their elementwise math runs eagerly as a handful of small kernels each; a decode step of a small model is bound
by those launches, not by bytes, so on CUDA inference (no autograd) each runs as one Triton kernel of
kernels/elementwise.py instead. Training and the CPU keep the eager path, which is also the kernels' reference.

Fused projections (inference on CUDA, once `fuse` ran): projections of one input share one weight tensor (q, k and
v; gate and up), the modules' own weights being views of its rows, so checkpoints, adapters and training still see
the modules. Up to kernels.decode_linear.MAX_ROWS token rows (decode steps) run kernels/decode_linear.py: one
launch per fused weight with the bias, the SwiGLU gate and the rows' LoRA expands inside (their shrinks in the
RMSNorm before q/k/v and gate-up, RMSNorm.add, or in a launch before o and down, kernels.lora.lora_shrink); more
rows run one cuBLAS GEMM per fused weight. Up to kernels.lora.COLUMNS_MAX_ROWS rows that GEMM also adds the slots'
updates: the weight carries every slot's B beside it and the input its rows' shrinks (the slots' columns,
service.model.lora.slot_columns; from the norm for q/k/v and gate-up, from one lora_shrink launch for o, and for
down from the launch that computes the SwiGLU gate); past them kernels.lora.lora_add_ adds them after the GEMM.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

from service.model.lora import add_slot_updates, eager_adapters_active, slot_columns, slot_columns_input, slot_lora
from service.model.parallel import SINGLE, TensorParallel, all_reduce


def _use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and not torch.is_grad_enabled()


def _train_kernels(x: torch.Tensor) -> bool:
    # training on CUDA: the fused forward + backward kernels of kernels/training.py
    return x.is_cuda and torch.is_grad_enabled()


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
        if _train_kernels(x) and not self.weight.requires_grad:
            from kernels.training import rms_norm
            return rms_norm(x, self.weight, self.eps)
        if _use_kernels(x):
            from kernels.elementwise import rms_norm
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)

    def add(self, x, residual, fused: bool = False, shrinks: tuple | None = None, update: tuple | None = None):
        """The residual stream's step: residual + x (x None: the stream's first value is residual alone), and its
        norm; returns (norm, new residual, shrinks). fused: one kernel, the residual updated in place; x may then be
        a projection's partial sums (service.model.layers.fused_projection), and, given `shrinks`
        (service.model.lora.slot_shrinks) and at most kernels.lora.ROW_SHRINK_MAX_ROWS rows, the kernel also
        computes the LoRA shrinks of the projections that read the norm (else None; the new residual is then a new
        tensor), in the slots' columns layout where slot_shrinks says so (past those rows, where the columns' shrinks
        come from tiles, kernels.lora.tiled_columns, a launch after it adds them); and adds to x the LoRA updates of the
        projection that produced it where `update` (service.model.lora.slot_update_in_norm) names its input."""
        if fused:
            from kernels.elementwise import add_rms_norm_, add_rms_norm_shrinks, rms_norm_shrinks
            from kernels.lora import ROW_SHRINK_MAX_ROWS, tiled_columns

            rows = residual.shape[0]
            if shrinks is not None and rows > ROW_SHRINK_MAX_ROWS and not (shrinks[-1] and tiled_columns(rows)):
                shrinks = None  # (in the columns layout from tiles, the norm writes into them: kernels.lora)
            if update is not None and (shrinks is None or x is None):
                raise ValueError("a projection's LoRA update is added by a residual add that computes shrinks")
            if shrinks is None:
                norm = self(residual) if x is None else add_rms_norm_(x, residual, self.weight, self.eps)
                return norm, residual, None
            *shrinks, columns = shrinks
            if x is None:
                norm, shrunk = rms_norm_shrinks(residual, self.weight, self.eps, shrinks, columns)
                return norm, residual, shrunk
            return add_rms_norm_shrinks(x, residual, self.weight, self.eps, shrinks, columns, update)
        if x is not None:
            residual = residual + x
        return self(residual), residual, None


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

    def forward(self, positions, q, k, store=None):
        """q/k [..., tokens, heads, head_dim] with positions [..., tokens]. Inference on CUDA rotates q and k in
        place (they are fresh projections). store (v, k_cache, v_cache, slot_mapping): also writes the rotated k
        and v into the paged cache (kvcache.store), in the same kernel on CUDA, where q, k and v may also be a
        projection's float32 partial sums (kernels.elementwise.apply_rope_). Returns the rotated (q, k)."""
        if _train_kernels(q) and store is None and self.head_dim & (self.head_dim - 1) == 0:
            from kernels.training import apply_rope
            return apply_rope(q, k, positions, self.cos_sin)
        if _use_kernels(q) and (q.dim() == 3 or store is not None) and self.head_dim & (self.head_dim - 1) == 0:
            from kernels.elementwise import apply_rope_
            return apply_rope_(q, k, positions, self.cos_sin, store=store)
        q, k = apply_rope_ref(q, k, positions, self.cos_sin)
        if store is not None:
            from service.model.attention import store_kv
            store_kv(k, *store)
        return q, k


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

    def fuse(self, lora_columns: int = 0) -> None:
        """One [2 * intermediate, hidden] weight, gate's rows then up's (the modules' weights become its views);
        lora_columns: LoRA slots' columns beside it and beside down's (fuse_linears)."""
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj, lora_columns=lora_columns)[0]
        if lora_columns:
            fuse_linears(self.down_proj, lora_columns=lora_columns)

    def forward(self, x, shrunk=None):
        """shrunk: the LoRA shrinks of gate and up, computed by the norm before (RMSNorm.add), on the fused path."""
        if fused_inference(self, "gate_up_weight", x):
            return self._forward_fused(x, shrunk)
        gate, up = self.gate_proj(x), self.up_proj(x)
        add_slot_updates(x, (self.gate_proj, gate), (self.up_proj, up))
        if _train_kernels(gate):
            from kernels.training import silu_mul as train_silu_mul
            hidden = train_silu_mul(gate, up)
        elif _use_kernels(gate):
            from kernels.elementwise import silu_mul
            hidden = silu_mul(gate, up)
        else:
            hidden = silu_mul_ref(gate, up)
        down = self.down_proj(hidden)
        add_slot_updates(hidden, (self.down_proj, down))  # before the all-reduce: this rank's share of the sum
        return all_reduce(down, self.tp)

    def _forward_fused(self, x, shrunk=None):
        """The fused projections. Where down takes the slots' columns, the SwiGLU's launch also writes down's
        shrinks beside its result (fused_projection's `feeds`)."""
        hidden = fused_projection(x, self.gate_up_weight, None, (self.gate_proj, self.up_proj), silu=True,
                                  shrunk=shrunk, feeds=(self.down_proj,))
        n = self.down_proj.in_features
        # One rank: the residual add that follows sums the down projection's partial sums (kernels/elementwise.py)
        down = fused_projection(hidden[:, :n], self.down_proj.weight, None, (self.down_proj,),
                                partials=self.tp.size == 1, shrunk=hidden if hidden.shape[1] > n else None)
        return all_reduce(down, self.tp)


def fused_inference(module: nn.Module, weight: str, x: torch.Tensor) -> bool:
    """Whether this forward runs the module's fused projections: inference on CUDA, once the module fused them
    (`weight` set), unless adapters apply through the modules' forward hooks (dense ones, training)."""
    return getattr(module, weight, None) is not None and _use_kernels(x) and not eager_adapters_active()


def fuse_linears(*linears: nn.Linear, lora_columns: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the linears' rows in order; each linear's parameters become views of it.
    lora_columns > 0: that weight is the first K columns of a wider one with lora_columns more per linear, where
    service.model.lora.LoRASlots puts its slots' B (kernels.lora's columns layout; zeros at first, carried over
    from the wider weight the linears already had); each linear's `_lora_columns` is (that wider weight, the
    linear's first row there, its first column of slots' B)."""
    k, rows = linears[0].in_features, sum(linear.out_features for linear in linears)
    before = getattr(linears[0], "_lora_columns", None)
    with torch.no_grad():
        wide = linears[0].weight.new_zeros(rows, k + len(linears) * lora_columns)
        wide[:, :k] = torch.cat([linear.weight for linear in linears])
        if lora_columns and before is not None and before[0].shape == wide.shape:
            wide[:, k:] = before[0][:, k:]
        bias = torch.cat([linear.bias for linear in linears]) if linears[0].bias is not None else None
    at = 0
    for p, linear in enumerate(linears):
        n = linear.out_features
        linear.weight = nn.Parameter(wide[at:at + n, :k], requires_grad=linear.weight.requires_grad)
        linear._lora_columns = (wide, at, k + p * lora_columns) if lora_columns else None
        if bias is not None:
            linear.bias = nn.Parameter(bias[at:at + n], requires_grad=linear.bias.requires_grad)
        at += n
    return wide[:, :k], bias


def fused_projection(x, weight, bias, linears, silu: bool = False, partials: bool = False, shrunk=None, feeds=(),
                     lora: bool = True):
    """Inference on CUDA: the projections `linears` of input x [rows, in], whose weights are the rows of the fused
    `weight` (fuse_linears), with the LoRA updates of the rows' slots; silu: linears are gate and up, and the
    result is the SwiGLU gate silu(gate) * up. partials: the result may come as float32 partial sums [splits, rows,
    out] (kernels.decode_linear), for a consumer that adds them up (RMSNorm.add). shrunk: the rows' LoRA shrinks,
    already computed by the norm that produced x (RMSNorm.add); where the rows take the slots' columns
    (service.model.lora.slot_columns), [x | shrinks] in their layout. feeds: with silu, the projections that read
    the result (down); where they take the slots' columns, the result is [silu(gate) * up | their shrinks] in that
    layout, from one launch (service.model.lora.slot_columns_input). lora False: the base projections alone (o's,
    whose updates the residual add after it adds: service.model.lora.slot_update_in_norm)."""
    from kernels.decode_linear import MAX_ROWS, decode_linear
    if x.shape[0] <= MAX_ROWS:
        return decode_linear(x, weight, bias, silu_mul=silu, lora=slot_lora(linears) if lora else None,
                             partials=partials, shrunk=shrunk)
    columns = slot_columns(linears, x.shape[0], normed=shrunk is not None) if lora else None
    if columns is not None:  # one GEMM adds every row's update: [x | shrinks] times [weight | slots' B]
        wide = shrunk if shrunk is not None else slot_columns_input(x, linears)
        if wide.shape[1] != columns.shape[1]:
            raise ValueError(f"input of {wide.shape[1]} columns for a weight of {columns.shape[1]}")
        y = F.linear(wide, columns, bias)
    else:
        y = F.linear(x, weight, bias)
    parts = y.split([linear.out_features for linear in linears], dim=1)
    if columns is None and lora:
        add_slot_updates(x, *zip(linears, parts), shrunk=shrunk)
    if silu:
        from kernels.elementwise import silu_mul
        if feeds and slot_columns(feeds, x.shape[0], normed=False) is not None:
            return slot_columns_input(parts[0], feeds, up=parts[1])
        return silu_mul(*parts)
    return y
