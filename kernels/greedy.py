"""Greedy sampling on the device: each row's argmax over the vocabulary and its logprob, in two small kernels.

PyTorch spends five kernels on it (max, a float32 copy of the logits, logsumexp's max, exp-sum and log, the
difference), and its single-block row reductions take tens of microseconds on one row of a 128k-151k vocabulary: a
twentieth of a batch-1 decode step. Here programs (row, chunk) each reduce BLOCK logits to their maximum, its first
index and the sum of exp(x - maximum); one program per row combines the chunks. The reference is
service.engine.sampler.greedy's PyTorch path.
"""
import torch
import triton
import triton.language as tl

from kernels.configs import gdc_launch_dependents, gdc_wait, pdl_launch

BLOCK = 4096


@triton.jit
def _chunk_kernel(LOGITS, stride_row, V, PART_MAX, PART_ARG, PART_SUM, CHUNKS, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    if PDL:  # kernels/configs.py
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(LOGITS + row.to(tl.int64) * stride_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    first = tl.min(tl.where(x == top, offs, V), 0)  # ties: the lowest index, as torch.max and argmax give
    at = row * CHUNKS + tl.program_id(1)
    tl.store(PART_MAX + at, top)
    tl.store(PART_ARG + at, first)
    tl.store(PART_SUM + at, tl.sum(tl.exp(x - top), 0))


@triton.jit
def _combine_kernel(PART_MAX, PART_ARG, PART_SUM, TOKENS, LOGPROBS, CHUNKS, V, CHUNKS_PADDED: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PADDED)
    ok = c < CHUNKS
    tops = tl.load(PART_MAX + row * CHUNKS + c, mask=ok, other=float("-inf"))
    top = tl.max(tops, 0)
    token = tl.min(tl.where(ok & (tops == top), tl.load(PART_ARG + row * CHUNKS + c, mask=ok, other=V), V), 0)
    total = tl.sum(tl.load(PART_SUM + row * CHUNKS + c, mask=ok, other=0.0) * tl.exp(tops - top), 0)
    tl.store(TOKENS + row, token.to(tl.int64))
    tl.store(LOGPROBS + row, -tl.log(total))  # the maximum minus the logsumexp


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (unit column stride) -> each row's argmax (int64) and its logprob (float32)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("greedy needs logits with unit column stride")
    chunks = triton.cdiv(vocab, BLOCK)
    parts = torch.empty(3, rows, chunks, dtype=torch.float32, device=logits.device)
    args = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        pdl = pdl_launch(logits.device)
        _chunk_kernel[(rows, chunks)](logits, logits.stride(0), vocab, parts[0], args, parts[1], chunks, BLOCK=BLOCK,
                                      num_warps=8, **pdl)
        _combine_kernel[(rows,)](parts[0], args, parts[1], tokens, logprobs, chunks, vocab,
                                 CHUNKS_PADDED=triton.next_power_of_2(chunks), num_warps=1, **pdl)
    return tokens, logprobs
