"""Pure-PyTorch attention references: the ground truth for tests and the CPU path of the service.

Everything here computes in the dtype it is given; tests upcast to float64 first.
"""
import math

import torch


def attention_ref(q, k, v, softmax_scale=None, causal=False):
    """One sequence. q [seqlen_q, nheads, d], k/v [seqlen_k, nheads_k, d] -> (out like q, lse [nheads, seqlen_q]).

    Causal masking is bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q.
    Rows that see no key return out = 0 and lse = -inf.
    """
    seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k, _ = k.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (seqlen_k - seqlen_q), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0.0))
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False):
    """Packed batch: q [total_q, nheads, d], k/v [total_k, nheads_k, d] -> (out, lse [nheads, total_q])."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype, device=q.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        out[qs:qe], lse[:, qs:qe] = attention_ref(q[qs:qe], k[ks:ke], v[ks:ke], softmax_scale, causal)
    return out, lse


def gather_paged_kv(cache, block_table, seqlen):
    """Contiguous [seqlen, nheads_k, d] view of one sequence's rows in a paged cache
    [num_blocks, block_size, nheads_k, d], following its block table row."""
    block_size = cache.shape[1]
    nblocks = (seqlen + block_size - 1) // block_size
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:seqlen]


def paged_attention_ref(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
    """Attention of q [batch, seqlen_q, nheads, d] over a paged KV cache; returns out like q.

    The seqlen_q new tokens are the last ones of each cached sequence (bottom-right causal), as in decode
    and speculative verification.
    """
    out = torch.empty_like(q)
    for b, seqlen in enumerate(cache_seqlens.tolist()):
        k = gather_paged_kv(k_cache, block_table[b], seqlen)
        v = gather_paged_kv(v_cache, block_table[b], seqlen)
        out[b] = attention_ref(q[b], k, v, softmax_scale, causal)[0]
    return out
