"""The training loss: cross-entropy of the LM head's logits summed over the target tokens, without ever holding the
logits of every token at once.

The plain loss, F.cross_entropy(lm_head(hidden).float(), labels), holds [tokens, vocab] logits in the model's
dtype, their float32 copy, the float32 log-softmax autograd saves for the backward, and as many again while the
backward runs: at 16k tokens and Qwen2.5's 151,936-token vocabulary, tens of GiB and a dozen passes over them.
Here the tokens go through in chunks of rows. The LM head is frozen (LoRA never trains it), so the only gradient
wanted is the hidden states', and since the loss is the graph's last node its gradient is one scalar: the forward
computes each chunk's d loss / d hidden = (softmax - onehot) @ W at once, while the chunk's logits are at hand,
and keeps only that [tokens, hidden] tensor, which the backward scales.
"""
import torch
import torch.nn.functional as F

IGNORE = -100  # a label that is no target
CHUNK_ELEMENTS = 1 << 28  # logits per chunk: 1.5 GiB (the model's dtype, bf16, plus their float32 log-softmax)


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain loss (the reference): cross-entropy of hidden @ weight.T in float32 (float64 for a float64
    model), summed over labels != IGNORE."""
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.to(_loss_dtype(logits)), labels, ignore_index=IGNORE, reduction="sum")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """linear_cross_entropy_ref's value and hidden's gradient, chunk_rows tokens at a time (default: CHUNK_ELEMENTS
    logits). hidden [tokens, dim] and weight [vocab, dim] of one dtype, labels [tokens]. A weight that requires a
    gradient (an LM head in training, never LoRA's case) takes the plain loss, which computes it."""
    grad = torch.is_grad_enabled()
    if grad and weight.requires_grad:
        return linear_cross_entropy_ref(hidden, weight, labels)
    if chunk_rows is None:
        chunk_rows = max(128, CHUNK_ELEMENTS // weight.shape[0] // 128 * 128)  # whole tiles of the matmuls
    if grad and hidden.requires_grad:
        return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_rows)
    return _chunks(hidden, weight, labels, chunk_rows, None)


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows):
        grad = torch.empty_like(hidden)
        loss = _chunks(hidden, weight, labels, chunk_rows, grad)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return (grad.to(grad_loss.dtype) * grad_loss).to(grad.dtype), None, None, None  # scaled in the loss dtype


def _chunks(hidden, weight, labels, chunk_rows, grad):
    """The summed loss (float32); with grad ([tokens, dim]) given, also fills it with d loss / d hidden."""
    if grad is not None and hidden.is_cuda and hidden.dtype != torch.float64:
        return _fused_chunks(hidden, weight, labels, chunk_rows, grad)
    loss = torch.zeros((), dtype=_loss_dtype(hidden), device=hidden.device)
    rows = torch.arange(min(chunk_rows, hidden.shape[0]), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_rows):
        stop = min(start + chunk_rows, hidden.shape[0])
        label = labels[start:stop]
        valid = label != IGNORE
        target = torch.where(valid, label, 0)
        logits = hidden[start:stop] @ weight.t()  # in the model's dtype, as the LM head computes them
        log_probs = torch.log_softmax(logits, -1, dtype=_loss_dtype(logits))
        picked = log_probs[rows[:stop - start], target]
        loss -= torch.where(valid, picked, 0).sum()
        if grad is not None:
            # softmax - onehot(target), written over the logits (no longer needed); the target's entry p - 1 comes
            # from the loss's precision (expm1), not from p rounded to the model's dtype first
            probs = torch.exp(log_probs, out=logits)
            del log_probs
            probs[rows[:stop - start], target] = torch.expm1(picked).to(probs.dtype)
            torch.mul(probs @ weight, valid[:, None], out=grad[start:stop])  # no gradient on ignored rows
    return loss


def _fused_chunks(hidden, weight, labels, chunk_rows, grad):
    """_chunks with each chunk's softmax - onehot written over its logits by one kernel (kernels.training), which
    reads them twice and writes them once: no float32 log-probabilities, a third of the passes over the logits."""
    from kernels.training import cross_entropy_grad_

    losses = []
    for start in range(0, hidden.shape[0], chunk_rows):
        stop = min(start + chunk_rows, hidden.shape[0])
        logits = hidden[start:stop] @ weight.t()
        losses.append(cross_entropy_grad_(logits, labels[start:stop], IGNORE))
        torch.mm(logits, weight, out=grad[start:stop])  # rows without a target are zero already
    return torch.cat(losses).sum()
