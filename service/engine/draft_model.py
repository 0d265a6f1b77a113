"""The draft-model proposer (speculative_method draft_model): a smaller model with the target's vocabulary
(speculative_model) drafts each sequence's next tokens greedily, on the target's device and dtype, with a paged KV
cache and a ModelRunner of its own (decode CUDA graphs on CUDA, eager steps on the CPU).

A proposal. The draft keeps, for each sequence, the tokens whose K/V its cache holds, as a Sequence of its own that
its runner reads as the target's reads the target's. It first rolls that back to the longest prefix it shares with
the sequence's tokens: the drafts after it were rejected, their positions are recomputed and their slots
overwritten. It then catches up on the sequence's tokens past that prefix (its whole prompt the first time; after a
verify, the target's token, and the last draft when all were accepted), batched over the proposing sequences in
steps of at most max_num_batched_tokens; the argmax of a sequence's last row is its first draft token. Then it
decodes greedily, one step per further token for all of them together, each sequence leaving at its limit.

Exactness: a greedy draft is a point mass (q = 1 on the draft's argmax), as an n-gram draft is, so the target's
verification (exact match for greedy requests, rejection sampling for sampled ones: service.engine.speculative)
keeps every output token the target's own; the draft only decides how many are accepted.

Bookkeeping: blocks come from a BlockAllocator of the draft's own, without prefix caching (a draft's last block
holds unverified tokens until the next proposal rolls it back), and are freed when the sequence stops running:
`release` from the engine when it finishes or is aborted, and at the next proposal for a preempted one. A sequence
whose tokens and draft do not fit the free blocks proposes nothing; the step goes on without its draft.
"""
import logging
from dataclasses import dataclass, field

import torch

from kvcache import BlockAllocator, block_bytes, gpu_kv_budget
from service.config import Settings
from service.engine.model_runner import ModelRunner, start_runner
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence, Status
from service.model.config import ModelConfig
from service.model.loader import load_model, resolve_model_dir
from service.protocol import SamplingParams

log = logging.getLogger(__name__)
# The draft's own sequences are only ever read for their tokens; their parameters say what the draft does.
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _Draft:
    """The draft's state of one sequence. view.token_ids: the tokens whose K/V its cache holds (all of them computed
    between proposals); table: its blocks, only ever grown, in place (the runner's decode graphs keep a copy on the
    device and sync what was added); verified: how many of view's tokens were the sequence's own at the last
    proposal (a sequence's tokens never change: those match without a look)."""
    view: Sequence
    table: list[int] = field(default_factory=list)
    verified: int = 0


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.block_size, self.max_model_len = runner.block_size, runner.max_model_len
        self.num_blocks = runner.kv_cache.num_blocks
        self.allocator = BlockAllocator(self.num_blocks)
        self.drafts: dict[Sequence, _Draft] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        for seq in [seq for seq in self.drafts if seq.status is not Status.RUNNING]:  # preempted since
            self.release(seq)
        out: list[list[int]] = [[] for _ in seqs]
        proposing = []  # (draft, index in seqs, limit)
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            k = min(k, self.max_model_len - len(seq.token_ids))  # the draft's context may be the shorter
            draft = self._prepare(seq, k) if k > 0 else None
            if draft is not None:
                proposing.append((draft, i, k))
        waiting = proposing
        while waiting:  # catch-up steps: a sequence's last row is sampled in the step that reaches it
            batch, owners, budget, later = ScheduledBatch(), [], self.runner.max_num_batched_tokens, []
            for draft, i, k in waiting:
                n = min(draft.view.num_uncomputed_tokens, budget)
                if n:
                    batch.add(draft.view, n, draft.table)
                    owners.append(i)
                    budget -= n
                if draft.view.num_uncomputed_tokens:
                    later.append((draft, i, k))
            self._step(batch, owners, out)
            waiting = later
        while proposing := [(draft, i, k) for draft, i, k in proposing if len(out[i]) < k]:  # decode steps
            batch, owners = ScheduledBatch(), []
            for draft, i, _ in proposing:
                draft.view.token_ids.append(out[i][-1])
                batch.add(draft.view, 1, draft.table)
                owners.append(i)
            self._step(batch, owners, out)
        return out

    def release(self, seq: Sequence) -> None:
        """Frees the blocks of seq's draft, if it has one (seq finished, was aborted, or was preempted)."""
        draft = self.drafts.pop(seq, None)
        if draft is not None:
            for block in draft.table:
                self.allocator.free(block)

    def reset(self) -> None:
        """Forgets every sequence's draft (after a failed proposal, whose state may be half done): all blocks free,
        the next proposal computes each sequence's tokens afresh."""
        self.drafts.clear()
        self.allocator = BlockAllocator(self.num_blocks)

    def _prepare(self, seq: Sequence, k: int) -> _Draft | None:
        """seq's draft rolled back to the longest prefix its tokens share with seq's (never past seq's last token,
        whose logits give the first draft token), seq's tokens after it to compute, and slots reserved for them and
        for k - 1 draft tokens after them; None, and nothing changed, when the free blocks do not hold those."""
        draft = self.drafts.get(seq) or _Draft(Sequence(seq.request_id, [], GREEDY))
        tokens, have = seq.token_ids, draft.view.token_ids
        end = min(len(have), len(tokens) - 1)
        same = min(draft.verified, end)
        while same < end and have[same] == tokens[same]:
            same += 1
        blocks = -(-(len(tokens) + k - 1) // self.block_size) - len(draft.table)
        if blocks > self.allocator.num_free_blocks:
            return None
        draft.table.extend(self.allocator.allocate() for _ in range(blocks))
        self.drafts[seq] = draft
        del have[same:]
        have += tokens[same:]
        draft.view.num_computed_tokens, draft.verified = same, len(tokens)
        return draft

    def _step(self, batch: ScheduledBatch, owners: list[int], out: list[list[int]]) -> None:
        """Runs one step of the draft; each sampled row's argmax joins its sequence's draft (owners: the index in
        `out` of each of the batch's sequences)."""
        logits, index, greedy = self.runner.run(batch, None)
        tokens = greedy[0] if greedy is not None else logits.argmax(-1)  # a decode graph took the argmax already
        for b, token in zip(index, tokens.tolist()):
            out[owners[b]].append(token)


def load_proposer(s: Settings, device: torch.device, dtype: torch.dtype, max_model_len: int,
                  target: ModelConfig) -> DraftModelProposer:
    """The draft of s.speculative_model, loaded with its KV cache (sized by num_draft_blocks) and CUDA graphs; call it
    before the target sizes its own KV cache from the memory left. ValueError if its vocabulary is not the
    target's."""
    model_dir = resolve_model_dir(s.speculative_model)
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_model {s.speculative_model!r} has a vocabulary of {cfg.vocab_size} tokens, the "
                         f"model {target.vocab_size}: a draft model must share the model's tokenizer")
    max_len = min(max_model_len, cfg.max_position_embeddings)
    model = load_model(model_dir, dtype, device)  # one rank's whole model, also under tensor parallelism
    num_blocks = num_draft_blocks(s, cfg, target, dtype, device, max_len)
    # A catch-up after a verify is one or two tokens a sequence: prefill graphs beyond twice max_num_seqs tokens
    # would serve only the first catch-up of a prompt, which may as well run eagerly.
    graph_tokens = min(s.cuda_graph_max_prefill_tokens, 2 * s.max_num_seqs)
    runner = start_runner(model, s.model_copy(update={"num_kv_blocks": num_blocks, "max_loras": 0,
                                                      "cuda_graph_max_prefill_tokens": graph_tokens}), max_len)
    log.info("draft model %s (%d layers): %d KV blocks", model_dir, cfg.num_hidden_layers, num_blocks)
    return DraftModelProposer(runner)


def num_draft_blocks(s: Settings, draft: ModelConfig, target: ModelConfig, dtype: torch.dtype,
                     device: torch.device, max_model_len: int) -> int:
    """The draft's KV blocks. It holds no more than the target's running sequences (each: its tokens and k - 1
    draft tokens), so never more than max_num_seqs sequences of max_model_len tokens. Within that it takes the part
    of the KV memory (what gpu_memory_utilization leaves after both models' weights, or cpu_kv_cache_bytes) that its
    share of a token's K/V bytes is, d / (d + t): the target's cache, sized afterwards from what is left less its
    activation peak, then holds about as many tokens. num_kv_blocks, the target's set by hand, is the draft's too."""
    bs = s.block_size
    most = s.max_num_seqs * -(-max_model_len // bs)
    if s.num_kv_blocks is not None:
        return min(most, s.num_kv_blocks)
    d = block_bytes(draft.num_hidden_layers, bs, draft.num_key_value_heads, draft.head_dim, dtype)
    t = block_bytes(target.num_hidden_layers, bs, max(1, target.num_key_value_heads // s.tensor_parallel_size),
                    target.head_dim, dtype)  # one rank's
    budget = gpu_kv_budget(s.gpu_memory_utilization, device=device) if device.type == "cuda" else s.cpu_kv_cache_bytes
    return max(1, min(most, int(budget * d / (d + t)) // d))
