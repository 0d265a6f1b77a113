"""KV-cache storage: per-layer K and V tensors in flash-attn's paged layout, allocated once, and sizing."""
from dataclasses import dataclass, field

import torch


def block_bytes(num_layers: int, block_size: int, nheads_k: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers, K and V."""
    return 2 * num_layers * block_size * nheads_k * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_bytes(budget_bytes: int, num_layers: int, block_size: int, nheads_k: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    num_blocks = int(budget_bytes) // block_bytes(num_layers, block_size, nheads_k, head_dim, dtype)
    if num_blocks <= 0:
        raise ValueError(f"a budget of {budget_bytes} bytes holds no KV-cache block")
    return num_blocks


def gpu_kv_budget(gpu_memory_utilization: float, activation_peak_bytes: int = 0, device="cuda") -> float:
    """Bytes of `gpu_memory_utilization` of the GPU left after what this process already holds (weights) and the
    caller's profiled activation peak; never more than what is free now."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    return min(total * gpu_memory_utilization - torch.cuda.memory_allocated(device) - activation_peak_bytes, free)


def num_blocks_for_gpu(gpu_memory_utilization: float, activation_peak_bytes: int, num_layers: int,
                       block_size: int, nheads_k: int, head_dim: int, dtype: torch.dtype, device="cuda") -> int:
    """Blocks that fit in gpu_kv_budget."""
    return num_blocks_for_bytes(gpu_kv_budget(gpu_memory_utilization, activation_peak_bytes, device), num_layers,
                                block_size, nheads_k, head_dim, dtype)


@dataclass
class KVCache:
    num_layers: int
    num_blocks: int
    block_size: int
    nheads_k: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    k_caches: list = field(init=False)  # per layer [num_blocks, block_size, nheads_k, head_dim]
    v_caches: list = field(init=False)

    def __post_init__(self):
        if min(self.num_layers, self.num_blocks, self.block_size, self.nheads_k, self.head_dim) <= 0:
            raise ValueError("all KV-cache dimensions must be positive")
        # One allocation for everything: no fragmentation, freed as a whole.
        self.storage = torch.zeros(2, self.num_layers, self.num_blocks, self.block_size, self.nheads_k,
                                   self.head_dim, dtype=self.dtype, device=self.device)
        self.k_caches = list(self.storage[0].unbind(0))
        self.v_caches = list(self.storage[1].unbind(0))

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies from BlockManager.append, in every layer."""
        if copies:
            src, dst = (torch.tensor(x, device=self.storage.device) for x in zip(*copies))
            self.storage[:, :, dst] = self.storage[:, :, src]
