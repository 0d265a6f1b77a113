"""Writes new K/V rows into their paged-cache slots (slot = block * block_size + offset; -1 skips)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, SlotMapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(SlotMapping + token).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PADDED)
    mask = d < tl.where(slot >= 0, HEAD_DIM, 0)  # slot -1: nothing to write
    k = tl.load(K + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(V + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(KCache + slot * stride_kc_slot + head * stride_kc_h + d, k, mask=mask)
    tl.store(VCache + slot * stride_vc_slot + head * stride_vc_h + d, v, mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping):
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k/v must both be [num_tokens, nheads_k, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("k, v and the caches must share one dtype")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be an int32/int64 vector with one slot per token")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("k/v need a unit-stride last dimension and the caches must be contiguous")


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k/v [num_tokens, nheads_k, head_dim] -> k_cache/v_cache [num_blocks, block_size, nheads_k, head_dim]."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, nheads_k, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, nheads_k)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), num_warps=1,
    )


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """PyTorch version of store_kv (the CPU path)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]
