"""Batched sampling on the device: one call turns a step's logits into next tokens (and logprobs)."""
from dataclasses import dataclass

import torch

from service.engine.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the sampled token, under the processed distribution
    top_logprobs: list[list[tuple[int, float]]] | None


def _apply_repetition_penalty(logits, penalties, seen: list[list[int]]):
    """Penalize every token already in a row's prompt or output: positive logits divided, negative multiplied."""
    rows = [i for i, p in enumerate(penalties) if p != 1.0]
    width = max(len(seen[i]) for i in rows)
    # Pad with a row's own first token: duplicates compute and scatter the same value.
    ids = torch.tensor([seen[i] + [seen[i][0]] * (width - len(seen[i])) for i in rows], device=logits.device)
    row_idx = torch.tensor(rows, device=logits.device)
    sub = logits[row_idx]
    vals = sub.gather(1, ids)
    p = torch.tensor([penalties[i] for i in rows], device=logits.device, dtype=logits.dtype)[:, None]
    logits[row_idx] = sub.scatter(1, ids, torch.where(vals > 0, vals / p, vals * p))
    return logits


def _top_k_top_p(logits, top_k, top_p):
    """Masks tokens outside each row's top-k and nucleus (top-p) to -inf; k = 0 and p = 1 disable."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)
    mask = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
    cum = probs.cumsum(-1)
    mask |= (cum - probs) >= top_p[:, None]  # keep tokens until the mass before them reaches top_p
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                 seen_tokens: list[list[int]]) -> SamplerOutput:
        """logits [batch, vocab] (any float dtype) -> one token per row. generators: torch.Generator or None per
        row; seen_tokens: each row's prompt + output tokens (for the repetition penalty)."""
        logits = logits.float()
        device = logits.device
        if any(p.repetition_penalty != 1.0 for p in params):
            logits = _apply_repetition_penalty(logits, [p.repetition_penalty for p in params], seen_tokens)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
            logits = logits / temps[:, None]
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                top_k = torch.tensor([p.top_k for p in params], device=device)
                top_p = torch.tensor([p.top_p for p in params], device=device)
                filtered = _top_k_top_p(logits, top_k, top_p)
                is_greedy = torch.tensor(greedy, device=device)[:, None]
                logits = torch.where(is_greedy, logits, filtered)
            probs = logits.softmax(-1)
            # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, batched.
            noise = torch.empty_like(probs).exponential_()
            for i, g in enumerate(generators):
                if g is not None and not greedy[i]:
                    noise[i].exponential_(generator=g)
            sampled = (probs / noise).argmax(-1)
            tokens = torch.where(torch.tensor(greedy, device=device), logits.argmax(-1), sampled)
        want_logprobs = any(p.logprobs or p.top_logprobs > 0 for p in params)
        if not want_logprobs:
            return SamplerOutput(tokens.tolist(), None, None)
        # Tokens masked by top-k/top-p have logprob -inf, which JSON cannot carry: report them as -9999 (as vLLM).
        logp = logits.log_softmax(-1).clamp_min(LOGPROB_FLOOR)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        k = max(p.top_logprobs for p in params)
        top = logp.topk(k, dim=-1) if k > 0 else None
        token_list, chosen = tokens.tolist(), chosen.tolist()
        tops = None
        if top is not None:
            values, indices = top.values.tolist(), top.indices.tolist()
            tops = [list(zip(indices[i][:p.top_logprobs], values[i][:p.top_logprobs])) if p.top_logprobs else None
                    for i, p in enumerate(params)]
        return SamplerOutput(token_list, chosen, tops)
