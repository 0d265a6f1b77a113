"""Hopper TMA for the kernels' streamed tiles: a host-side tensor descriptor over the [tokens, heads * head_dim]
rows of a q/k/v-shaped tensor, so a kernel fetches one head's [block_rows, head_dim] tile with a single bulk copy
(no per-thread address math, no registers spent on pointers). Rows past the tensor's end read as zeros; rows
past a sequence's end belong to the next sequence and are masked by the kernels as before."""
import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_ok(*tensors) -> bool:
    """Whether the copy engine can read every tensor's rows: 16-bit data, a power-of-two head_dim (a padded tile
    would read the next head), heads packed along a row, 16-byte aligned rows, and a GPU that has the engine
    (sm_90+). CPU tensors qualify: Triton's interpreter emulates the descriptors, so CI runs this path."""
    for t in tensors:
        head_dim = t.shape[-1]
        if t.numel() == 0:  # a descriptor needs at least one row
            return False
        if t.dtype not in (torch.float16, torch.bfloat16) or head_dim < 16 or head_dim & (head_dim - 1):
            return False
        if t.stride(-1) != 1 or t.stride(-2) != head_dim or (t.stride(0) * t.element_size()) % 16 \
                or t.data_ptr() % 16:
            return False
    first = tensors[0]  # the callers' inputs share one device (kernels.interface checks it)
    return not first.is_cuda or _has_copy_engine(first.get_device())


@functools.cache
def _has_copy_engine(device: int) -> bool:  # asked on every launch: the device query costs microseconds
    return torch.cuda.get_device_capability(device)[0] >= 9


def row_descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """Descriptor of t [tokens, heads, head_dim] as a [tokens, heads * head_dim] matrix, [block_rows, head_dim]
    tiles; a tile of head h starts at column h * head_dim."""
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [block_rows, t.shape[2]])
