"""Tensor parallelism (Megatron-style): which slice of each weight a rank holds, and the collectives that join
the ranks' partial results. Every rank runs the same forward on the same tokens:

- q/k/v and gate/up are split by output rows (query heads, KV heads, MLP columns): no communication;
- o_proj and down_proj are split by input columns: each rank's output is a partial sum, all-reduced once;
- the embedding and the LM head are split by vocabulary rows: a token's embedding comes from the rank holding
  it (all-reduce), and every rank gathers the full logits (all-gather).

KV heads are split too, or replicated when there are more ranks than KV heads (rank r then holds KV head
r * kv_heads // size, which serves exactly its query heads). The process group is torch.distributed's default
one: an engine core's ranks are its whole world (NCCL on CUDA, gloo on the CPU).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> "TensorParallel":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()


SINGLE = TensorParallel()


def check_divisible(cfg, size: int) -> None:
    """A clear error when the model cannot be split over `size` ranks."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"its {heads} query heads")
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads (neither divides the other)")
    if cfg.intermediate_size % size:
        problems.append(f"its MLP width {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} cannot split the model: {', '.join(problems)} "
                         f"are not divisible by {size}")


def local_heads(cfg, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) of one rank."""
    return cfg.num_attention_heads // tp.size, max(1, cfg.num_key_value_heads // tp.size)


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows per rank) of the rank's vocabulary slice; the last rank's is padded past the vocabulary."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


# Weight name suffix -> (dimension split, what it is split by)
_SPLITS = {"q_proj": (0, "q"), "k_proj": (0, "kv"), "v_proj": (0, "kv"), "o_proj": (1, "q"),
           "gate_proj": (0, "mlp"), "up_proj": (0, "mlp"), "down_proj": (1, "mlp"),
           "embed_tokens": (0, "vocab"), "lm_head": (0, "vocab")}
VOCAB_SPLIT = {name for name, (_, by) in _SPLITS.items() if by == "vocab"}


def shard_range(module: str, cfg, tp: TensorParallel) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the full weight a rank holds for a projection named `module` (its last name part),
    or None when every rank holds all of it (norms)."""
    split = _SPLITS.get(module)
    if split is None or tp.size == 1:
        return None
    dim, by = split
    d = cfg.head_dim
    if by == "q":
        n = cfg.num_attention_heads // tp.size * d
        return dim, tp.rank * n, (tp.rank + 1) * n
    if by == "kv":
        kv = cfg.num_key_value_heads
        first = tp.rank * kv // tp.size  # the rank's first KV head: its own slice, or the one it replicates
        n = max(1, kv // tp.size)
        return dim, first * d, (first + n) * d
    if by == "mlp":
        n = cfg.intermediate_size // tp.size
        return dim, tp.rank * n, (tp.rank + 1) * n
    start, n = vocab_rows(cfg.vocab_size, tp)
    return dim, start, min(start + n, cfg.vocab_size)


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(x)
    return x


def embed(weight: torch.Tensor, ids: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Embeddings of `ids` from a vocabulary-split table: each rank fills the rows it holds, zeros elsewhere."""
    if tp.size == 1:
        return torch.nn.functional.embedding(ids, weight)
    start, n = vocab_rows(vocab_size, tp)
    local = ids - start
    held = (local >= 0) & (local < n)
    out = torch.nn.functional.embedding(local.clamp(0, n - 1), weight) * held.unsqueeze(-1).to(weight.dtype)
    return all_reduce(out, tp)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """[tokens, vocab] logits from each rank's [tokens, vocab / size] slice."""
    if tp.size == 1:
        return local
    local = local.contiguous()
    parts = torch.empty((tp.size, *local.shape), dtype=local.dtype, device=local.device)
    if local.is_cuda:
        dist.all_gather_into_tensor(parts, local)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(parts.unbind(0)), local)
    return parts.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :vocab_size]
