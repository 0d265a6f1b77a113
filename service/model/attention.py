"""Attention over the paged KV cache, and the choice of backend: our Triton kernels on CUDA, the pure-PyTorch
references of kernels/reference.py elsewhere. The model code is the same for both."""
from dataclasses import dataclass

import torch

from kernels.reference import attention_ref, gather_paged_kv, varlen_attention_ref


@dataclass
class AttentionMetadata:
    """One step's flat batch: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1], the last of its
    seqlens_k[b] cached tokens. decode: every sequence has exactly one query row (the CUDA-graph path)."""
    slot_mapping: torch.Tensor  # [num_tokens] int, cache slot of each new token (-1: padding, not written)
    block_table: torch.Tensor  # [batch, max_blocks] int32
    seqlens_k: torch.Tensor  # [batch] int32
    cu_seqlens_q: torch.Tensor | None = None  # [batch + 1] int32 (prefill/mixed steps)
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    decode: bool = False
    num_splits: int = 0  # decode kernel splits; fixed > 0 inside CUDA graphs
    # Prefill/mixed steps on CUDA: [batch] int32, a one-row sequence's key count (0 for the others). The decode
    # kernel computes those rows and the prefill kernel the rest, the tiles of q_tiles (kernels.prefill
    # multi_row_tiles): a decode among prompt chunks then costs what it costs in a decode step, not a BLOCK_M-row
    # tile per query head. Both set, or neither.
    single_row_seqlens_k: torch.Tensor | None = None
    q_tiles: torch.Tensor | None = None  # [2, tiles] int32


def use_triton(device: torch.device) -> bool:
    return device.type == "cuda"


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k.device):
        from kvcache.store import store_kv as store
    else:
        from kvcache.store import store_kv_ref as store
    store(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """q [tokens, heads, d], k/v [tokens, heads_k, d] of the new tokens (None: already in the cache): writes k/v
    into the cache, then each new token attends (causally) to its sequence's cached prefix and the new tokens up
    to itself."""
    if k is not None:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if use_triton(q.device):
        from kernels import flash_attn_forward, flash_attn_with_kvcache
        from kernels.decode import attend_single_rows
        if meta.decode:
            out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, meta.seqlens_k, meta.block_table,
                                          softmax_scale=scale, causal=True, num_splits=meta.num_splits)
            return out.squeeze(1)
        # The runner built these inputs: the launchers alone, without the public API's checks and autograd.
        out, single = torch.empty_like(q), meta.single_row_seqlens_k
        if single is not None:
            attend_single_rows(q, k_cache, v_cache, meta.cu_seqlens_q, single, meta.block_table, out, scale,
                               meta.num_splits)
        return flash_attn_forward(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                  meta.max_seqlen_k, scale, True, meta.block_table, out=out,
                                  q_tiles=meta.q_tiles)[0]
    cu_q = meta.cu_seqlens_q
    if cu_q is None:
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    seqlens = meta.seqlens_k.tolist()
    keys = [gather_paged_kv(k_cache, meta.block_table[b], n) for b, n in enumerate(seqlens)]
    values = [gather_paged_kv(v_cache, meta.block_table[b], n) for b, n in enumerate(seqlens)]
    cu_k = torch.tensor([0] + seqlens, device=q.device).cumsum(0)
    return varlen_attention_ref(q, torch.cat(keys), torch.cat(values), cu_q, cu_k, scale, causal=True)[0]


def paged_attention_shrinks(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, shrinks: tuple | None):
    """paged_attention of new tokens whose k/v are in the cache, as rows [tokens, heads * d], and the LoRA shrinks
    `shrinks` of the projection that reads them (o's, service.model.lora.slot_merge_shrinks) where the decode
    kernel's merge of its splits computes them (a decode step in splits, the merge a launch of its own): then
    [output | shrinks] in kernels.lora's columns layout as well (kernels.decode.decode_attention_shrinks), else
    None."""
    from kernels import configs
    if (shrinks is not None and meta.decode and use_triton(q.device) and meta.num_splits > 1
            and not configs.DECODE_MERGE_IN_SPLIT):
        from kernels.decode import decode_attention_shrinks
        t = decode_attention_shrinks(q, k_cache, v_cache, meta.seqlens_k, meta.block_table, scale, meta.num_splits,
                                     shrinks)
        return t[:, :q.shape[1] * q.shape[2]], t
    return paged_attention(q, None, None, k_cache, v_cache, meta, scale).reshape(q.shape[0], -1), None


def rope_in_attention(q, meta: AttentionMetadata, head_dim: int) -> bool:
    """Whether a decode step's attention kernel also rotates q and k and writes the new K/V into the cache, saving
    the RoPE kernel's launch (kernels.configs.DECODE_ROPE_IN_ATTENTION, off by default)."""
    from kernels import configs
    return (configs.DECODE_ROPE_IN_ATTENTION and meta.decode and use_triton(q.device) and head_dim >= 16
            and head_dim & (head_dim - 1) == 0)


def decode_attention_rope(q, k, v, positions, cos_sin, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """A decode step's rotation, cache write and attention in one kernel (where rope_in_attention): q/k/v of the new
    tokens, or the projection's float32 partial sums, unrotated (kernels.decode.decode_attention_rope)."""
    from kernels.decode import decode_attention_rope as attend
    return attend(q, k, v, positions, cos_sin, meta.slot_mapping, k_cache, v_cache, meta.seqlens_k, meta.block_table,
                  scale, meta.num_splits)


def dense_attention(q, k, v, scale: float):
    """Training path, differentiable, no cache: q [batch, seq, heads, d], k/v [batch, seq, heads_k, d]."""
    if use_triton(q.device):
        from kernels import flash_attn_func
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    return torch.stack([attention_ref(q[b], k[b], v[b], scale, causal=True)[0] for b in range(q.shape[0])])


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """Training path over packed sequences: q/k/v [tokens, heads(_k), d], cu_seqlens int32 [batch + 1]."""
    if use_triton(q.device):
        from kernels import flash_attn_varlen_func
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      softmax_scale=scale, causal=True)
    return varlen_attention_ref(q, k, v, cu_seqlens, cu_seqlens, scale, causal=True)[0]
