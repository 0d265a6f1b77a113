"""The training loop, one micro-batch at a time so a caller can interleave it with serving.

Each micro-batch is packed into one flat sequence with cu_seqlens, so the model's training forward runs our
Triton varlen attention (forward + backward kernels) on CUDA, and the PyTorch reference on CPU. The loss is the
mean cross-entropy over the target tokens of the whole optimizer step (completion tokens only), computed over the
vocabulary in chunks (service.finetune.loss). The trained weights are float32 (the master copy) and cast to the
model's dtype (bf16 on GPU) in the forward; AdamW steps them after `grad_accum` micro-batches.
"""
import math
import random
import time
from dataclasses import dataclass

import torch

from service.finetune.data import Example
from service.finetune.loss import IGNORE, linear_cross_entropy
from service.model.lora import Adapter, LoRAConfig, activate, install


class TrainingDiverged(RuntimeError):
    """The loss or the gradients are no longer finite."""


@dataclass
class TrainConfig:
    learning_rate: float
    batch_size: int = 4  # examples per optimizer step
    micro_batch_size: int = 4  # examples per forward/backward; batch_size / micro_batch_size = grad accumulation
    n_epochs: int = 3
    max_steps: int | None = None
    seed: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0


@dataclass
class StepResult:
    step: int  # optimizer steps done
    total_steps: int
    loss: float  # mean over the step's target tokens
    tokens: int  # tokens processed (all, not only targets) in this step
    seconds: float


def pack(examples: list[Example], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """input_ids [tokens], labels [tokens] (next token where it is a target, else IGNORE), positions [tokens]
    (from 0 in every sequence), cu_seqlens, max_len, and the number of targets: all built on the host, so that
    nothing waits on the device to count or place them."""
    ids, labels, positions, lens = [], [], [], []
    for ex in examples:
        ids += ex.token_ids
        labels += [t if m else IGNORE for t, m in zip(ex.token_ids[1:], ex.loss_mask[1:])] + [IGNORE]
        positions += range(len(ex.token_ids))
        lens.append(len(ex.token_ids))
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    input_ids, labels_t, positions_t = torch.tensor([ids, labels, positions]).to(device)  # one copy
    return input_ids, labels_t, positions_t, cu.to(device), max(lens), len(labels) - labels.count(IGNORE)


def loss_sum(model, examples: list[Example], device) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the target tokens of the examples (fp32), and how many there were."""
    input_ids, labels, positions, cu, max_len, targets = pack(examples, device)
    hidden = model.model(input_ids, positions, None, cu, max_len)  # forward_train without the LM head
    return linear_cross_entropy(hidden, model.lm_head.weight, labels), targets


class Trainer:
    """Trains an adapter of `model` (whose own weights stay frozen) on `examples`."""

    def __init__(self, model, examples: list[Example], config: TrainConfig, lora: LoRAConfig):
        if config.batch_size % config.micro_batch_size:
            raise ValueError("batch_size must be a multiple of micro_batch_size")
        self.model, self.examples, self.config = model, examples, config
        self.device = next(model.parameters()).device
        for p in model.parameters():  # the base stays frozen; the engine never needs its gradients
            p.requires_grad_(False)
        install(model)
        self.adapter = Adapter.init(model, lora, seed=config.seed)
        # fused on CUDA: the update of every tensor in one kernel, not a loop of multi-tensor ones
        self.optimizer = torch.optim.AdamW(self.adapter.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay, fused=self.device.type == "cuda")
        steps_per_epoch = math.ceil(len(examples) / config.batch_size)
        self.total_steps = steps_per_epoch * config.n_epochs
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.step = 0
        self._rng = random.Random(config.seed)
        self._order: list[int] = []

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def _next_batch(self) -> list[Example]:
        """The next `batch_size` examples of a fresh shuffle per epoch (the last batch of an epoch may be short)."""
        if not self._order:
            self._order = list(range(len(self.examples)))
            self._rng.shuffle(self._order)
        batch, self._order = self._order[:self.config.batch_size], self._order[self.config.batch_size:]
        return [self.examples[i] for i in batch]

    def _lr(self) -> float:
        c = self.config
        if c.warmup_steps and self.step < c.warmup_steps:
            return c.learning_rate * (self.step + 1) / c.warmup_steps
        return c.learning_rate

    def micro_batches(self):
        """Yields after every micro-batch (forward + backward), returning a StepResult after each optimizer
        step; the caller may pause between any two. Raises TrainingDiverged on a non-finite loss or gradient."""
        while not self.done:
            start = time.perf_counter()
            batch = self._next_batch()
            targets = sum(ex.num_target_tokens for ex in batch)
            total_loss, tokens = 0.0, 0
            for i in range(0, len(batch), self.config.micro_batch_size):
                micro = batch[i:i + self.config.micro_batch_size]
                with torch.enable_grad(), activate([(self.adapter, None)]):
                    loss, _ = loss_sum(self.model, micro, self.device)
                    (loss / targets).backward()
                value = loss.item()  # the one wait of a micro-batch, for its backward too: the duty cycle times it
                if not math.isfinite(value):
                    raise TrainingDiverged(f"the training loss became {value} at step {self.step + 1}")
                total_loss += value
                tokens += sum(len(ex.token_ids) for ex in micro)
                yield None
            norm = torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), self.config.max_grad_norm)
            if not torch.isfinite(norm):
                raise TrainingDiverged(f"the gradient norm became {norm.item()} at step {self.step + 1}")
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            yield StepResult(self.step, self.total_steps, total_loss / targets, tokens, time.perf_counter() - start)

    @torch.no_grad()
    def evaluate(self, examples: list[Example]) -> float:
        """Mean loss over the target tokens of `examples` with the current adapter."""
        total, count = 0.0, 0
        with activate([(self.adapter, None)]):
            for i in range(0, len(examples), self.config.micro_batch_size):
                loss, n = loss_sum(self.model, examples[i:i + self.config.micro_batch_size], self.device)
                total, count = total + loss.item(), count + n
        return total / max(count, 1)
