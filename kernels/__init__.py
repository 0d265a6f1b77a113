"""Triton FlashAttention kernels with flash-attn's public API."""
from kernels.decode import flash_attn_with_kvcache
from kernels.interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
