"""What the Gluon kernels for Hopper (hopper_prefill, hopper_backward) share: Triton 3.6's Gluon imports, the check
that inputs suit those kernels, and their TMA descriptors.

Gluon's API moves between Triton releases, so the kernels are pinned to 3.6 (the GPU machines' version) and
`supported` says False on any other. The imports are guarded: CI's newest Triton without a GPU imports this module
too, and where Gluon is missing the kernels are never defined (GLUON_ERROR says why).
"""
import functools

import torch
import triton

from kernels.tma import tma_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_ERROR = None
except ImportError as exc:  # the interpreter-only CI, or a Triton without Gluon
    GLUON_ERROR = exc
    gluon = gl = async_copy = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None

GLUON_VERSION = "3.6."
HEAD_DIMS = (64, 128)

__all__ = ["GLUON_ERROR", "TensorDescriptor", "async_copy", "fence_async_shared", "gl", "gluon", "mbarrier",
           "rows_descriptor", "supported", "tma", "warpgroup_mma", "warpgroup_mma_wait"]


def supported(q, k, v, *like_q) -> bool:
    """Whether the Gluon kernels handle these inputs: sm_90 CUDA, Triton 3.6's Gluon, packed (not paged) 16-bit
    q [total_q, H, d] and k/v [total_k, H_k, d] of one dtype (and tensors shaped like q: dO), d in HEAD_DIMS,
    H % H_k == 0, rows the copy engine can address (kernels.tma.tma_ok)."""
    if GLUON_ERROR is not None or not triton.__version__.startswith(GLUON_VERSION):
        return False
    tensors = (q, k, v, *like_q)
    if not all(t.is_cuda for t in tensors) or not _is_sm90(q.get_device()):
        return False
    if any(t.dim() != 3 or t.dtype != q.dtype for t in tensors) or any(t.shape != q.shape for t in like_q):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in HEAD_DIMS:
        return False
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or q.shape[1] % k.shape[1]:
        return False
    return tma_ok(*tensors)


@functools.cache
def _is_sm90(device: int) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def rows_descriptor(t, block_rows):
    """t [tokens, heads, d] as a [tokens, heads * d] matrix in [block_rows, d] tiles, swizzled for wgmma."""
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [block_rows, t.shape[2]],
                            _tile_layout(block_rows, t.shape[2], t.dtype))


@functools.cache
def _tile_layout(block_rows, d, dtype):
    """Building the layout is most of a descriptor's host time (about 8 us of 10)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
