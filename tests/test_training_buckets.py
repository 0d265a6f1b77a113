"""Micro-batches padded to bucketed shapes (service.finetune.trainer.pad_shape), so that CUDA graphs replay jobs of
mixed lengths: the buckets, shapes already on them left alone (the benchmark's), padding that changes neither any
real token's attention nor the loss nor the gradients, and jobs that train and count tokens as unpadded ones do; on
the GPU, graph replays of a mixed-length job against eager unpadded steps."""
import random

import pytest
import torch

from service.finetune import trainer as training
from service.finetune.data import Example
from service.finetune.loss import IGNORE
from service.model.loader import load_model
from service.model.lora import LoRAConfig
from tests.helpers import rel_err
from tests.tiny_models import VOCAB, make_tiny_model

# (tokens, prompt tokens): lengths on no bucket, so that every micro-batch of them is padded
MIXED = [(50, 10), (77, 0), (130, 60), (21, 5), (64, 62), (99, 30), (45, 44), (117, 20)]


def _examples(shapes) -> list[Example]:
    return [Example(torch.randint(3, VOCAB, (n,)).tolist(), [False] * p + [True] * (n - p)) for n, p in shapes]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_buckets_are_powers_of_two_and_one_and_a_half_times_them():
    assert [training.bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    for n in range(1, 1 << 16):
        b = training.bucket(n)
        odd = b // (b & -b)  # b without its factors of two
        assert n <= b < 1.5 * n and odd in (1, 3) and training.bucket(b) == b, n


def test_padding_rounds_every_dimension_up_to_a_bucket_within_its_bound():
    rng = random.Random(0)
    for _ in range(3000):
        lens = [rng.randint(1, 3000) for _ in range(rng.randint(1, 40))]
        padding, max_len = training.pad_shape(lens)
        sequences = len(lens) + len(padding)
        assert sum(lens) + sum(padding) == training.bucket(sum(lens))
        assert max_len == training.power_of_two(max(lens)) and training.bucket(sequences) == sequences
        assert all(0 <= p <= max_len for p in padding) and max(padding, default=0) - min(padding, default=0) <= 1
        assert 2 * sum(padding) < sum(lens)  # the bound pad_shape's docstring gives


# benchmarks/finetune.py's micro-batches (sequences x tokens) on the GPU, then on the CPU
@pytest.mark.parametrize("sequences,length", [(8, 512), (4, 2048), (16, 1024), (2, 32), (1, 64)])
def test_shapes_on_the_buckets_are_not_padded(sequences, length):
    examples = _examples([(length, length // 3)] * sequences)
    plain, bucketed = training.pack(examples, "cpu"), training.pack(examples, "cpu", bucketed=True)
    for a, b in zip(plain[:4], bucketed[:4]):
        assert torch.equal(a, b)
    assert plain[4:] == bucketed[4:] == (length, sequences * (length - length // 3))


def test_padding_sequences_attend_only_to_themselves(model_path):
    """The examples keep their sequences; the padding comes after them in sequences of its own, without targets:
    every real token's hidden state is the unpadded batch's, and every padding sequence's is its own alone."""
    model = load_model(model_path, torch.float32, "cpu")
    examples = _examples(MIXED[:4])
    plain = training.pack(examples, "cpu")
    ids, labels, positions, cu, max_len, targets = training.pack(examples, "cpu", bucketed=True)
    n, b = plain[0].shape[0], plain[3].shape[0]
    assert ids.shape[0] > n + 50 and targets == plain[5] and max_len > plain[4]  # enough padding to show a leak
    assert torch.equal(cu[:b], plain[3]) and torch.equal(labels[:n], plain[1]) and (labels[n:] == IGNORE).all()
    with torch.no_grad():
        hidden = model.model(ids, positions, None, cu, max_len)
        assert rel_err(hidden[:n], model.model(plain[0], plain[2], None, plain[3], plain[4])) < 1e-6
        for start, stop in zip(cu[b - 1:-1].tolist(), cu[b:].tolist()):
            alone = torch.tensor([0, stop - start], dtype=torch.int32)
            assert rel_err(hidden[start:stop], model.model(ids[start:stop], positions[start:stop], None, alone,
                                                           stop - start)) < 1e-6


def test_a_padded_micro_batch_has_the_loss_and_gradients_of_the_unpadded_one(model_path):
    """Through the trainer's own micro-batch (fp32, CPU). Padding that reached the loss would add ~ln(vocab) per
    padding token (its 66 tokens against the 196 targets: a loss 30% off), and gradients with it."""
    model = load_model(model_path, torch.float32, "cpu")
    examples = _examples(MIXED[:4])
    trainer = training.Trainer(model, examples, training.TrainConfig(learning_rate=1e-2), LoRAConfig(rank=4, alpha=8))
    assert trainer.bucketed  # on the CPU too, for the path CUDA graphs take
    with torch.no_grad():  # B starts at zero: random, so that A has gradients too
        for _, b in trainer.adapter.weights.values():
            b.normal_(0, 0.1)
    trainer.adapter.sync_training_copies()
    targets = sum(ex.num_target_tokens for ex in examples)

    def loss_and_grads(bucketed):
        trainer.bucketed = bucketed
        for t in trainer.adapter.parameters():
            t.grad.zero_()
        loss = trainer._micro_batch(examples, targets)
        return loss, torch.cat([t.grad.flatten() for t in trainer.adapter.parameters()])

    loss, grads = loss_and_grads(True)
    ref_loss, ref_grads = loss_and_grads(False)
    assert grads.count_nonzero() > 0.9 * grads.numel()
    assert rel_err(loss, ref_loss) < 1e-6 and rel_err(grads, ref_grads) < 1e-5


def test_a_job_of_mixed_lengths_trains_and_counts_as_unpadded_micro_batches_do(model_path, monkeypatch):
    model = load_model(model_path, torch.float32, "cpu")
    examples = _examples(MIXED)
    shapes, pack = [], training.pack

    def recording_pack(micro, device, bucketed=False):
        packed = pack(micro, device, bucketed)
        shapes.append((packed[0].shape[0], packed[3].shape[0] - 1, packed[4]))  # tokens, sequences, longest
        return packed
    monkeypatch.setattr(training, "pack", recording_pack)

    def train(bucketed):
        config = training.TrainConfig(learning_rate=1e-2, batch_size=4, micro_batch_size=2, n_epochs=2, seed=3)
        trainer = training.Trainer(model, examples, config, LoRAConfig(rank=4, alpha=8))
        trainer.bucketed = bucketed
        results = [r for r in trainer.micro_batches() if r is not None]
        return results, torch.cat([t.detach().flatten() for t in trainer.adapter.parameters()])

    results, weights = train(True)
    assert len(shapes) == 8
    assert all(training.bucket(t) == t and training.bucket(b) == b and training.power_of_two(m) == m
               for t, b, m in shapes)
    ref_results, ref_weights = train(False)
    assert shapes[8:] != shapes[:8]  # the unpadded run's
    assert [r.tokens for r in results] == [r.tokens for r in ref_results]
    assert sum(r.tokens for r in results) == 2 * sum(n for n, _ in MIXED)  # the examples' tokens, no padding
    losses, ref_losses = torch.tensor([r.loss for r in results]), torch.tensor([r.loss for r in ref_results])
    assert rel_err(losses, ref_losses) < 1e-5 and rel_err(weights, ref_weights) < 1e-4  # see test_training's Adam


@pytest.mark.gpu
def test_a_mixed_length_job_replays_graphs_and_trains_as_eager_steps_do(tmp_path, monkeypatch):
    """Examples of 40-90 tokens, two per micro-batch: exact shapes would rarely repeat, bucketed ones mostly replay
    (at most max_graphs captured); the losses and the trained adapter are those of eager, unpadded steps."""
    model = load_model(make_tiny_model("qwen2", tmp_path / "qwen2"), torch.float32, "cuda")
    rng = random.Random(0)
    examples = _examples([(n, rng.randint(0, n // 2)) for n in (rng.randint(40, 90) for _ in range(24))])
    replays, run = [], training._MicroBatchGraph.run

    def counted_run(graph, packed, targets):
        replays.append(packed[0].shape[0])
        return run(graph, packed, targets)
    monkeypatch.setattr(training._MicroBatchGraph, "run", counted_run)

    def train(graphs):
        config = training.TrainConfig(learning_rate=1e-2, batch_size=4, micro_batch_size=2, n_epochs=4, seed=1,
                                      warmup_steps=2, cuda_graphs=graphs)
        trainer = training.Trainer(model, examples, config, LoRAConfig(rank=4, alpha=8))
        losses = [r.loss for r in trainer.micro_batches() if r is not None]
        return trainer, torch.tensor(losses), torch.cat([t.detach().flatten() for t in trainer.adapter.parameters()])

    trainer, losses, weights = train(True)
    assert trainer.bucketed and 0 < len(trainer._micro_graphs) <= trainer.config.max_graphs
    assert len(replays) > 0.6 * 48, len(replays)  # of 4 epochs x 12 micro-batches
    _, ref_losses, ref_weights = train(False)
    assert rel_err(losses, ref_losses) < 1e-4 and rel_err(weights, ref_weights) < 1e-4
