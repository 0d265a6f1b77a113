"""The training loop, one micro-batch at a time so a caller can interleave it with serving.

Each micro-batch is packed into one flat sequence with cu_seqlens, so the model's training forward runs our
Triton varlen attention (forward + backward kernels) on CUDA, and the PyTorch reference on CPU. The loss is the
mean cross-entropy over the target tokens of the whole optimizer step (completion tokens only), computed over the
vocabulary in chunks (service.finetune.loss). The trained weights are float32 (the master copy, which AdamW steps
after `grad_accum` micro-batches); LoRA's forward reads copies in the model's dtype (bf16 on GPU), renewed after
each optimizer step (Adapter.start_training).

On CUDA a LoRA step is bound by the host (thousands of small launches) unless it runs as CUDA graphs: the forward
+ backward of a micro-batch is captured per shape (tokens, sequences, longest sequence) the second time that shape
comes, and replayed from then on with the micro-batch copied into its inputs; the optimizer step (clipping, AdamW,
zeroing the gradients) is captured after its first run. Graphs share one memory pool and never run at once.
Packed examples of mixed lengths rarely repeat a shape exactly, so each micro-batch is padded up to a bucketed
shape (pad_shape) with sequences of their own that have no targets: they add nothing to the loss or the gradients.
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
    cuda_graphs: bool = True  # LoRA on CUDA: replay micro-batches of repeated shapes and the optimizer step
    max_graphs: int = 8  # micro-batch shapes kept captured (the first ones seen twice)


@dataclass
class StepResult:
    step: int  # optimizer steps done
    total_steps: int
    loss: float  # mean over the step's target tokens
    tokens: int  # the examples' tokens in this step (targets or not; not the padding of bucketed shapes)
    seconds: float


def power_of_two(n: int) -> int:
    """The smallest power of two that is >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def bucket(n: int) -> int:
    """The smallest power of two or 1.5x a power of two that is >= n (n >= 1): below 1.5 n (2^k + 1 -> 1.5 * 2^k)."""
    power = power_of_two(n)
    return power * 3 // 4 if power * 3 // 4 >= n else power


def pad_shape(lens: list[int]) -> tuple[list[int], int]:
    """The lengths of the sequences that pad a micro-batch of sequences `lens` to its bucketed shape, and its
    longest sequence rounded up (the max_len its attention runs with), so that a few shapes recur and CUDA graphs
    replay them: total tokens and sequence count rounded up by bucket(), the longest to a power of two (coarser,
    since it costs only attention programs that return at once; 1.5x buckets there too made ~1.5x as many shapes,
    hence fewer graph hits, in simulated jobs of log-normal lengths). A shape on the buckets is left as it is.

    The padding's cost is bounded by its tokens: fewer than half as many as the real ones (a third of the padded
    micro-batch at worst, about a sixth on average over totals spread evenly in log scale), split evenly over the
    added sequences, none longer than max_len; a rounded-up count adds at most empty sequences."""
    longest, total = power_of_two(max(lens)), sum(lens)
    pad = bucket(total) - total
    added = bucket(len(lens) + -(-pad // longest)) - len(lens)  # no padding sequence longer than max_len
    return [pad // added + (i < pad % added) for i in range(added)], longest


def pack(examples: list[Example], device, bucketed: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """input_ids [tokens], labels [tokens] (next token where it is a target, else IGNORE), positions [tokens]
    (from 0 in every sequence), cu_seqlens, max_len, and the number of targets: all built on the host, so that
    nothing waits on the device to count or place them. `bucketed`: padded to pad_shape's shape, after the
    examples, by sequences of token 0 at position 0 (within any rotary table) whose labels are all IGNORE."""
    ids, labels, positions, lens = [], [], [], []
    for ex in examples:
        ids += ex.token_ids
        labels += [t if m else IGNORE for t, m in zip(ex.token_ids[1:], ex.loss_mask[1:])] + [IGNORE]
        positions += range(len(ex.token_ids))
        lens.append(len(ex.token_ids))
    targets, max_len = len(labels) - labels.count(IGNORE), max(lens)
    if bucketed:
        padding, max_len = pad_shape(lens)
        pad = sum(padding)
        ids += [0] * pad
        labels += [IGNORE] * pad
        positions += [0] * pad
        lens += padding
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    input_ids, labels_t, positions_t = torch.tensor([ids, labels, positions]).to(device)  # one copy
    return input_ids, labels_t, positions_t, cu.to(device), max_len, targets


def loss_sum(model, examples: list[Example], device) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the target tokens of the examples (fp32), and how many there were."""
    input_ids, labels, positions, cu, max_len, targets = pack(examples, device)
    return _packed_loss(model, input_ids, labels, positions, cu, max_len), targets


def _packed_loss(model, input_ids, labels, positions, cu, max_len) -> torch.Tensor:
    hidden = model.model(input_ids, positions, None, cu, max_len)  # forward_train without the LM head
    return linear_cross_entropy(hidden, model.lm_head.weight, labels)


class _MicroBatchGraph:
    """One micro-batch shape's forward + backward, captured: static inputs, the loss it leaves, and the factor of
    the loss's gradient (1 / the step's targets) as a tensor, so that any batch of that shape replays it."""

    def __init__(self, trainer: "Trainer", packed, pool):
        self.inputs = [t.clone() for t in packed[:4]]  # input_ids, labels, positions, cu_seqlens
        self.grad_scale = torch.ones((), device=trainer.device)
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=pool):
            self.loss = trainer._forward_backward(*self.inputs, packed[4], self.grad_scale)

    def run(self, packed, targets: int) -> torch.Tensor:
        for static, t in zip(self.inputs, packed[:4]):
            static.copy_(t, non_blocking=True)
        self.grad_scale.fill_(1 / targets)
        self.graph.replay()
        return self.loss


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
        if not lora.full:
            self.adapter.start_training(next(model.parameters()).dtype)
        cuda = self.device.type == "cuda"
        self.graphs = config.cuda_graphs and cuda and not lora.full
        # fused on CUDA: the update of every tensor in one kernel, not a loop of multi-tensor ones; captured, its
        # step count and learning rate live on the device
        lr = torch.tensor(config.learning_rate, device=self.device) if self.graphs else config.learning_rate
        self.optimizer = torch.optim.AdamW(self.adapter.parameters(), lr=lr, weight_decay=config.weight_decay,
                                           fused=cuda, capturable=self.graphs)
        # Micro-batches padded to bucketed shapes where graphs replay them, and on the CPU, so that tests cover the
        # path the graphs take; eager on CUDA (full fine-tuning, cuda_graphs off) the padding would only cost.
        self.bucketed = self.graphs or self.device.type == "cpu"
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        # Shapes run once (eagerly, which warms a capture up), and those captured: the first max_graphs shapes seen
        # twice, so that a shape that never comes back (an epoch's short last batch) takes no graph.
        self._seen: set[tuple] = set()
        self._micro_graphs: dict[tuple, _MicroBatchGraph] = {}
        self._step_graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # and the norm it leaves
        self._optimizer_steps = 0
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
                value = self._micro_batch(micro, targets).item()  # the one wait of a micro-batch: the duty cycle
                if not math.isfinite(value):
                    raise TrainingDiverged(f"the training loss became {value} at step {self.step + 1}")
                total_loss += value
                tokens += sum(len(ex.token_ids) for ex in micro)
                yield None
            for group in self.optimizer.param_groups:
                if self.graphs:
                    group["lr"].fill_(self._lr())
                else:
                    group["lr"] = self._lr()
            norm = self._optimizer_step()
            if not torch.isfinite(norm):  # captured, the step is done already: the job fails all the same
                raise TrainingDiverged(f"the gradient norm became {norm.item()} at step {self.step + 1}")
            self.step += 1
            yield StepResult(self.step, self.total_steps, total_loss / targets, tokens, time.perf_counter() - start)

    def _forward_backward(self, input_ids, labels, positions, cu, max_len, grad_scale) -> torch.Tensor:
        with torch.enable_grad(), activate([(self.adapter, None)]):
            loss = _packed_loss(self.model, input_ids, labels, positions, cu, max_len)
            loss.backward(grad_scale)
        return loss.detach()

    def _micro_batch(self, micro: list[Example], targets: int) -> torch.Tensor:
        """Forward and backward of one micro-batch (its gradients added to the adapter's); its summed loss."""
        packed = pack(micro, self.device, self.bucketed)
        key = (packed[0].shape[0], packed[3].shape[0], packed[4])
        graph = self._micro_graphs.get(key)
        if graph is None and key in self._seen and len(self._micro_graphs) < self.config.max_graphs:
            graph = self._micro_graphs[key] = _MicroBatchGraph(self, packed, self._pool)
        if graph is not None:
            return graph.run(packed, targets)
        if self.graphs:
            self._seen.add(key)
        scale = torch.tensor(1 / targets, dtype=torch.float32, device=self.device)
        return self._forward_backward(*packed[:5], scale)

    def _clip_step_zero(self) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        if self.adapter.training is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            torch._foreach_zero_([t.grad for t in self.adapter.parameters()])  # the buffers the backward adds to
            self.adapter.sync_training_copies()
        return norm

    def _optimizer_step(self) -> torch.Tensor:
        """Clipping, AdamW, zeroed gradients (captured after the first step, whose run creates AdamW's state);
        the gradients' norm before clipping."""
        self._optimizer_steps += 1
        if not self.graphs or self._optimizer_steps == 1:
            return self._clip_step_zero()
        if self._step_graph is None:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self._pool):
                norm = self._clip_step_zero()
            self._step_graph = graph, norm
        self._step_graph[0].replay()
        return self._step_graph[1]

    @torch.no_grad()
    def evaluate(self, examples: list[Example]) -> float:
        """Mean loss over the target tokens of `examples` with the current adapter."""
        total, count = 0.0, 0
        with activate([(self.adapter, None)]):
            for i in range(0, len(examples), self.config.micro_batch_size):
                loss, n = loss_sum(self.model, examples[i:i + self.config.micro_batch_size], self.device)
                total, count = total + loss.item(), count + n
        return total / max(count, 1)
