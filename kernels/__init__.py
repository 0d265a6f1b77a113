"""Triton FlashAttention kernels with flash-attn's public API."""
from kernels.decode import flash_attn_with_kvcache
from kernels.interface import flash_attn_func, flash_attn_varlen_func
from kernels.prefill import flash_attn_forward

# flash_attn_forward is the varlen launcher alone (no input checks, no autograd): for a caller that guarantees
# its inputs, the serving engine, whose prefill step calls it once per layer.
__all__ = ["flash_attn_forward", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
