"""Grammar token masks applied to the logits in place: one kernel where PyTorch spends about ten (the bits unpacked
to a [rows, vocab] boolean, its negation, a gather of the bound rows, masked_fill, the scatter back), each a launch
on the host of a step that is host-bound at 64 constrained rows. Programs (row, chunk) read the chunk's mask words
and write -inf over the tokens they forbid; allowed logits are not touched. Launched through kernels.launches: on
Triton's own path every call binds and specializes its arguments again, host time in a host-bound step. The
reference is service.engine.sampler's PyTorch path (_apply_token_masks).
"""
import torch
import triton
import triton.language as tl

from kernels.launches import KernelLaunches

BLOCK = 4096


@triton.jit
def _apply_token_masks_kernel(LOGITS, stride_row, V, MASKS, stride_mask, WORDS, ROWS, BLOCK: tl.constexpr,
                              ALL_ROWS: tl.constexpr):
    i = tl.program_id(0)
    row = i if ALL_ROWS else tl.load(ROWS + i)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word = tokens // 32
    # Ids past the masks' words are forbidden (other=0), as the reference pads them.
    bits = tl.load(MASKS + i.to(tl.int64) * stride_mask + word, mask=word < WORDS, other=0)
    forbidden = ((bits >> (tokens % 32)) & 1) == 0
    tl.store(LOGITS + row.to(tl.int64) * stride_row + tokens, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=forbidden & (tokens < V))


def apply_token_masks_(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None) -> None:
    """logits [batch, vocab] float32 (unit column stride), edited in place; masks [n, words] int32 bits on the
    logits' device (bit j of word w allows token 32 w + j); rows: the n logits rows they bind (int32 or int64 on the
    device), or None for rows 0..n-1."""
    if logits.stride(1) != 1 or masks.stride(1) != 1:
        raise ValueError("apply_token_masks_ needs unit column strides")
    n, vocab = masks.shape[0], logits.shape[1]
    if n == 0:
        return
    _LAUNCHES.launch((n, triton.cdiv(vocab, BLOCK)),
                     (logits, logits.stride(0), vocab, masks, masks.stride(0), masks.shape[1],
                      logits if rows is None else rows), {"BLOCK": BLOCK, "ALL_ROWS": rows is None})


_LAUNCHES = KernelLaunches(_apply_token_masks_kernel)
