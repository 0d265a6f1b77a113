"""kernels/greedy.py against PyTorch's argmax and logsumexp (service.engine.sampler.greedy's CPU path), with ties,
a vocabulary that is not a multiple of the kernel's chunk, and rows of a wider tensor."""
import pytest
import torch

from kernels import greedy as kernel
from tests.helpers import rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_and_logprob_match_pytorch(device, dtype, monkeypatch):
    monkeypatch.setattr(kernel, "BLOCK", 256)  # several chunks in the interpreter's small vocabulary
    vocab = 1000
    logits = (torch.randn(5, vocab + 24, device=device) * 4).to(dtype)[:, :vocab]
    logits[1, 7] = logits[1, 900] = logits[1].max() + 1  # a tie across chunks: the lower index wins
    logits[2, 300] = logits[2, 301] = logits[2].max() + 1  # within one
    tokens, logprobs = kernel.greedy(logits)
    ref = logits.float()
    assert tokens.tolist() == ref.argmax(-1).tolist()
    assert tokens[1] == 7 and tokens[2] == 300
    assert rel_err(logprobs, ref.max(-1).values - ref.logsumexp(-1)) < 1e-5
