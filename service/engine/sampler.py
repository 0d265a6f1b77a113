"""Batched sampling on the device: one call turns a step's logits into next tokens (and logprobs), left on the
device for the next step's inputs, with their copy to the host started at once. `Sampled.fetch()` waits for that
copy: the one host synchronization of a step."""
from dataclasses import dataclass

import torch

from service.protocol import SamplingParams

LOGPROB_FLOOR = -9999.0  # what a masked token's -inf logprob is reported as (JSON has no -inf), as vLLM does


@dataclass
class Sampled:
    token_ids: torch.Tensor  # [rows] int64, on the device
    _host: list[torch.Tensor]  # [tokens, logprob of each, top-k ids, top-k logprobs] being copied to the host
    _ready: torch.cuda.Event | None
    top_logprobs: list[int]  # per row: how many top logprobs it asked for

    def fetch(self) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]] | None] | None]:
        """(token ids, logprobs of the sampled tokens or None, top logprobs per row or None), once copied."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host[0].tolist()
        if len(self._host) == 1:
            return tokens, None, None
        chosen = self._host[1].tolist()
        if len(self._host) == 2:
            return tokens, chosen, None
        ids, values = self._host[2].tolist(), self._host[3].tolist()
        tops = [list(zip(ids[i][:k], values[i][:k])) if k else None for i, k in enumerate(self.top_logprobs)]
        return tokens, chosen, tops


def on_device(data, device, dtype=None) -> torch.Tensor:
    """A small per-row tensor on the device without waiting: torch.tensor(data, device=cuda) copies from pageable
    memory and synchronizes the stream, which would wait for the step in flight and end the overlap."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def _apply_repetition_penalty(logits, penalties, seen: list[list[int]]):
    """Penalize every token already in a row's prompt or output: positive logits divided, negative multiplied."""
    rows = [i for i, p in enumerate(penalties) if p != 1.0]
    if not rows:
        return logits
    width = max(len(seen[i]) for i in rows)
    # Pad with a row's own first token: duplicates compute and scatter the same value.
    ids = on_device([seen[i] + [seen[i][0]] * (width - len(seen[i])) for i in rows], logits.device)
    row_idx = on_device(rows, logits.device)
    sub = logits[row_idx]
    vals = sub.gather(1, ids)
    p = on_device([penalties[i] for i in rows], logits.device, logits.dtype)[:, None]
    logits[row_idx] = sub.scatter(1, ids, torch.where(vals > 0, vals / p, vals * p))
    return logits


def _apply_output_penalties(logits, params: list[SamplingParams], seen: list[list[int]], prompt_lens: list[int]):
    """OpenAI's penalties on the tokens generated so far (seen past the prompt): frequency_penalty times each
    token's count, plus presence_penalty once for every token that occurred, subtracted from the logits."""
    rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return logits
    outputs = {i: seen[i][prompt_lens[i]:] for i in rows}
    device = logits.device
    width = max(1, max(len(outputs[i]) for i in rows))
    ids = on_device([outputs[i] + [0] * (width - len(outputs[i])) for i in rows], device)
    lengths = on_device([len(outputs[i]) for i in rows], device)
    valid = (torch.arange(width, device=device)[None, :] < lengths[:, None]).to(logits.dtype)
    counts = torch.zeros(len(rows), logits.shape[-1], device=device, dtype=logits.dtype).scatter_add_(1, ids, valid)
    frequency = on_device([params[i].frequency_penalty for i in rows], device, logits.dtype)[:, None]
    presence = on_device([params[i].presence_penalty for i in rows], device, logits.dtype)[:, None]
    index = on_device(rows, device)
    logits[index] = logits[index] - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def _add_at(logits, entries: list[tuple[int, int, float]]) -> None:
    """logits[row, token] += value for each (row, token, value), in one device operation."""
    rows, tokens, values = zip(*entries)
    device = logits.device
    logits.index_put_((on_device(rows, device), on_device(tokens, device)),
                      on_device(values, device, logits.dtype), accumulate=True)


def _apply_token_masks(logits, masks: torch.Tensor, rows: list[int]) -> None:
    """Grammars: sets the logits of the tokens each row's mask forbids to -inf. masks: [len(rows), words] int32
    bits (bit j of word w allows token 32 w + j), in pinned memory; ids past the masks are forbidden. On CUDA,
    kernels/token_masks.py."""
    device = logits.device
    words = masks.to(device, non_blocking=True)
    if device.type == "cuda":
        from kernels.token_masks import apply_token_masks_
        every_row = len(rows) == logits.shape[0]  # distinct rows of the batch: all of them, in order
        apply_token_masks_(logits, words, None if every_row else on_device(rows, device))
        return
    index = on_device(rows, device)
    bits = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    if allowed.shape[1] < logits.shape[-1]:
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - allowed.shape[1]), value=False)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


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


def _warp(logits, params: list[SamplingParams], greedy: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k / top-p and min-p on float32 logits: (the logits they leave, their softmax). Greedy rows
    keep their logits (temperature 1, no filter), so their argmax stays the token they take."""
    device = logits.device
    temps = on_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], device)
    logits = logits / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = on_device([p.top_k for p in params], device)
        top_p = on_device([p.top_p for p in params], device)
        filtered = _top_k_top_p(logits, top_k, top_p)
        is_greedy = on_device(greedy, device)[:, None]
        logits = torch.where(is_greedy, logits, filtered)
    probs = logits.softmax(-1)
    if any(p.min_p > 0.0 for p in params):  # never drops a row's most likely token: greedy rows keep theirs
        min_p = on_device([p.min_p for p in params], device)[:, None]
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
        probs = logits.softmax(-1)
    return logits, probs


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution Sampler.__call__ draws a sampled row's token from (no penalties, bans or grammar: rows
    with those are never verified speculatively): logit bias, temperature, top-k / top-p, min-p, softmax."""
    logits = logits.to(torch.float32, copy=True)  # the bias is added in place
    if any(p.logit_bias for p in params):
        _add_at(logits, [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()])
    return _warp(logits, params, [p.greedy for p in params])[1]


def _to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    if not tensors[0].is_cuda:
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (bf16 orders tokens as their float32 values do) and its logprob: the row's maximum minus
    its logsumexp, in float32. The decode graphs compute it too (model_runner). On CUDA, kernels/greedy.py."""
    if logits.is_cuda:
        from kernels.greedy import greedy as greedy_kernels
        return greedy_kernels(logits)
    top, tokens = logits.max(-1)
    return tokens, top.float() - logits.float().logsumexp(-1)


class Sampler:
    def argmax(self, logits: torch.Tensor, logprobs: bool = False,
               computed: tuple[torch.Tensor, torch.Tensor] | None = None) -> Sampled:
        """Greedy rows with nothing to adjust (SamplingParams.argmax_only): the argmax of the logits as they are,
        with, if `logprobs`, each token's logprob (see `greedy`). computed: `greedy(logits)` already (a decode
        graph's)."""
        if computed is None and logprobs:
            computed = greedy(logits)
        if computed is not None:
            tokens = computed[0]
            copies = [tokens, computed[1]] if logprobs else [tokens]
        else:
            tokens = logits.argmax(-1)
            copies = [tokens]
        host, ready = _to_host(copies)
        return Sampled(tokens, host, ready, [0] * len(tokens))

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                 seen_tokens: list[list[int]] | None = None, prompt_lens: list[int] | None = None,
                 banned: list[list[int]] | None = None, masks: tuple[torch.Tensor, list[int]] | None = None) -> Sampled:
        """logits [batch, vocab] (any float dtype) -> one token per row. generators: torch.Generator or None per
        row; seen_tokens: each row's prompt + output tokens and prompt_lens the prompts' lengths, needed only for
        the penalties; banned: per row, tokens that must not be sampled (EOS before min_tokens); masks: the
        grammar-bound rows' allowed tokens as bits, and those rows.

        In vLLM's order: penalties, logit bias, bans, grammar masks, then temperature, top-k / top-p, min-p, and
        the draw."""
        if masks is None and not (banned and any(banned)) and all(p.argmax_only for p in params):
            return self.argmax(logits, any(p.logprobs for p in params))
        logits = logits.float()
        device = logits.device
        if seen_tokens is not None:
            logits = _apply_repetition_penalty(logits, [p.repetition_penalty for p in params], seen_tokens)
            logits = _apply_output_penalties(logits, params, seen_tokens, prompt_lens)
        if any(p.logit_bias for p in params):
            _add_at(logits, [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()])
        if banned and any(banned):
            _add_at(logits, [(i, t, float("-inf")) for i, ids in enumerate(banned) for t in ids])
        if masks is not None:
            _apply_token_masks(logits, *masks)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            logits, probs = _warp(logits, params, greedy)
            # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, batched.
            noise = torch.empty_like(probs).exponential_()
            for i, g in enumerate(generators):
                if g is not None and not greedy[i]:
                    noise[i].exponential_(generator=g)
            sampled = (probs / noise).argmax(-1)
            tokens = torch.where(on_device(greedy, device), logits.argmax(-1), sampled)
        top_counts = [p.top_logprobs for p in params]
        copies = [tokens]
        if any(p.logprobs or p.top_logprobs > 0 for p in params):
            # Tokens masked by top-k/top-p have logprob -inf, which JSON cannot carry: floor it.
            k = max(top_counts)
            if k > 0:
                logp = logits.log_softmax(-1).clamp_min(LOGPROB_FLOOR)
                top = logp.topk(k, dim=-1)
                copies += [logp.gather(1, tokens[:, None]).squeeze(1), top.indices, top.values]
            else:  # the sampled tokens' alone (every TGI request): no [batch, vocab] log-softmax written
                chosen = logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(-1)
                copies.append(chosen.clamp_min(LOGPROB_FLOOR))
        host, ready = _to_host(copies)
        return Sampled(tokens, host, ready, top_counts)
