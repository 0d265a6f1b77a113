"""A tiny decoder trained through kernels.flash_attn_func: the loss falls and every parameter's gradient
matches the same model on torch SDPA. The trainer's chunked loss (service.finetune.loss) against the plain one:
values and gradients, alone and through a training step."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from service.finetune import loss as chunked
from service.finetune.data import Example
from service.finetune.loss import IGNORE, linear_cross_entropy, linear_cross_entropy_ref
from tests.helpers import rel_err

interface = pytest.importorskip("kernels.interface")


class Block(nn.Module):
    def __init__(self, dim, nheads, nheads_k, attention):
        super().__init__()
        self.nheads, self.nheads_k, self.head_dim = nheads, nheads_k, dim // nheads
        self.attention = attention
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * nheads_k * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.SiLU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.nheads, self.head_dim)
        k, v = self.wkv(h).view(b, s, 2, self.nheads_k, self.head_dim).unbind(2)
        x = x + self.wo(self.attention(q, k, v).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, attention, vocab=32, dim=64, nheads=4, nheads_k=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, nheads, nheads_k, attention) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def flash_attention(q, k, v):
    return interface.flash_attn_func(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _copy_task(batch, seqlen, vocab, device):
    # The second half repeats the first: learnable only by attending back, so attention gradients matter.
    half = torch.randint(0, vocab, (batch, seqlen // 2), device=device)
    tokens = torch.cat([half, half], 1)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _setup(device, dtype):
    flash = Decoder(flash_attention).to(device, dtype)
    sdpa = Decoder(sdpa_attention).to(device, dtype)
    sdpa.load_state_dict(flash.state_dict())
    return flash, sdpa


def _check_training(device, dtype, batch, seqlen, steps, tol):
    flash, sdpa = _setup(device, dtype)
    inputs, targets = _copy_task(batch, seqlen, 32, device)
    _loss(flash, inputs, targets).backward()
    _loss(sdpa, inputs, targets).backward()
    for (name, p), ref in zip(flash.named_parameters(), sdpa.parameters()):
        assert rel_err(p.grad, ref.grad) < tol, f"{name}: rel err {rel_err(p.grad, ref.grad):.3g}"

    opt = torch.optim.AdamW(flash.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):  # memorise one fixed batch: a reliable drop within a few dozen steps
        opt.zero_grad()
        loss = _loss(flash, inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_training_matches_sdpa(device):
    if device == "cpu":
        _check_training(device, torch.float32, batch=2, seqlen=16, steps=30, tol=2e-2)
    else:
        _check_training(device, torch.float32, batch=8, seqlen=128, steps=30, tol=2e-2)


@pytest.mark.gpu
def test_training_matches_sdpa_bf16():
    _check_training("cuda", torch.bfloat16, batch=8, seqlen=256, steps=30, tol=2e-2)


# -- the chunked loss ------------------------------------------------------------------------------------------
def _loss_inputs(dtype, tokens=37, dim=16, vocab=101):
    hidden = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,))
    labels[8:16] = IGNORE  # a whole chunk of 8 rows without a target
    labels[torch.rand(tokens) < 0.2] = IGNORE
    labels[-1] = IGNORE
    return hidden, weight, labels


def _value_and_grad(loss_fn, hidden, weight, labels, **kwargs):
    hidden.grad = None
    loss = loss_fn(hidden, weight, labels, **kwargs)
    n = int((labels != IGNORE).sum())
    (loss / n).backward()  # the trainer's mean over the step's targets
    return loss.detach(), hidden.grad.clone()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_rows", [8, 5, 1000])  # 37 tokens: whole chunks and a short last one; one chunk
def test_chunked_loss_matches_the_plain_loss(dtype, tol, chunk_rows):
    hidden, weight, labels = _loss_inputs(dtype)
    loss, grad = _value_and_grad(linear_cross_entropy, hidden, weight, labels, chunk_rows=chunk_rows)
    ref_loss, ref_grad = _value_and_grad(linear_cross_entropy_ref, hidden, weight, labels)
    assert loss.dtype == ref_loss.dtype == torch.promote_types(dtype, torch.float32) and grad.dtype == dtype
    assert rel_err(loss, ref_loss) < max(tol, 1e-6), (loss, ref_loss)  # float32 sums, in another order
    assert rel_err(grad, ref_grad) < tol
    assert not grad[labels == IGNORE].any()  # rows without a target get no gradient
    with torch.no_grad():  # evaluation: the value alone
        assert rel_err(linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows), ref_loss) < max(tol, 1e-6)


def test_chunked_loss_leaves_a_trained_weight_to_the_plain_loss():
    hidden, weight, labels = _loss_inputs(torch.float64)
    weight.requires_grad_(True)
    linear_cross_entropy(hidden, weight, labels, chunk_rows=8).backward()
    ref = weight.grad.clone()
    weight.grad = None
    linear_cross_entropy_ref(hidden, weight, labels).backward()
    assert rel_err(ref, weight.grad) < 1e-12


def test_a_training_step_updates_the_adapter_as_the_plain_loss_does(tmp_path, monkeypatch):
    from service.finetune import trainer as training
    from service.model.loader import load_model
    from service.model.lora import LoRAConfig
    from tests.tiny_models import VOCAB, make_tiny_model

    model = load_model(make_tiny_model("qwen2", tmp_path / "qwen2"), torch.float32, "cpu")
    examples = []
    for length, prompt in [(50, 10), (77, 0), (130, 60), (21, 5), (64, 64 - 2), (99, 30)]:
        ids = torch.randint(3, VOCAB, (length,)).tolist()
        examples.append(Example(ids, [False] * prompt + [True] * (length - prompt)))
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 1)  # chunks of 128 rows: 2-3 per micro-batch of ~200 tokens

    def train(loss_fn):
        monkeypatch.setattr(training, "linear_cross_entropy", loss_fn)
        trainer = training.Trainer(model, examples, training.TrainConfig(learning_rate=1e-2, batch_size=4,
                                                                         micro_batch_size=2, n_epochs=2),
                                   LoRAConfig(rank=4, alpha=8))
        steps = trainer.micro_batches()
        next(steps)  # the first micro-batch's backward: B starts at zero, so only B has a gradient yet
        grads = torch.cat([t.grad.flatten() for t in trainer.adapter.parameters()])
        losses = [r.loss for r in steps if r is not None]
        return grads, losses, torch.cat([t.detach().flatten() for t in trainer.adapter.parameters()])

    grads, losses, weights = train(linear_cross_entropy)
    ref_grads, ref_losses, ref_weights = train(linear_cross_entropy_ref)
    assert len(losses) == 4 and rel_err(torch.tensor(losses), torch.tensor(ref_losses)) < 1e-5
    assert grads.any() and rel_err(grads, ref_grads) < 1e-5
    # Adam divides each update by the gradient's running scale: float32 summation-order noise in small gradients
    # grows to ~1e-5 after four steps on some BLAS builds (torch 2.11 on the GPU machine read 1.3e-5).
    assert rel_err(weights, ref_weights) < 1e-4


@pytest.mark.gpu
def test_cuda_graph_steps_train_as_eager_steps_do(tmp_path):
    """Micro-batches of repeated (bucketed) shapes replay captured graphs (and the optimizer step too): the losses
    and the trained adapter are those of eager, unpadded steps, shapes that come once or twice included."""
    from service.finetune import trainer as training
    from service.model.loader import load_model
    from service.model.lora import LoRAConfig
    from tests.tiny_models import VOCAB, make_tiny_model

    model = load_model(make_tiny_model("qwen2", tmp_path / "qwen2"), torch.float32, "cuda")
    lengths = [40, 40, 33, 40, 40, 40, 40, 57, 40, 40, 40, 40]
    examples = [Example(torch.randint(3, VOCAB, (n,)).tolist(), [i % 3 > 0] * n) for i, n in enumerate(lengths)]

    def train(graphs):
        config = training.TrainConfig(learning_rate=1e-2, batch_size=4, micro_batch_size=2, n_epochs=3, seed=1,
                                      warmup_steps=2, cuda_graphs=graphs)
        trainer = training.Trainer(model, examples, config, LoRAConfig(rank=4, alpha=8))
        losses = [r.loss for r in trainer.micro_batches() if r is not None]
        return trainer, torch.tensor(losses), torch.cat([t.detach().flatten() for t in trainer.adapter.parameters()])

    trainer, losses, weights = train(True)
    assert trainer._micro_graphs and trainer._step_graph is not None
    _, ref_losses, ref_weights = train(False)
    assert rel_err(losses, ref_losses) < 1e-4 and rel_err(weights, ref_weights) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_chunked_loss_on_cuda_matches_the_plain_loss(dtype, tol):
    hidden, weight, labels = (t.cuda() for t in _loss_inputs(dtype, vocab=5003))
    hidden = hidden.detach().requires_grad_(True)
    loss, grad = _value_and_grad(linear_cross_entropy, hidden, weight, labels, chunk_rows=8)
    ref_loss, ref_grad = _value_and_grad(linear_cross_entropy_ref, hidden, weight, labels)
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(grad, ref_grad) < tol
