"""kernels/token_masks.py against the sampler's PyTorch path (service.engine.sampler._apply_token_masks on the
CPU): random bits with the sign bit among them, a vocabulary that is neither a multiple of the kernel's chunk nor of
32, masks shorter than the vocabulary, some rows bound or all, rows of a wider tensor."""
import pytest
import torch

from kernels import token_masks as kernel
from service.engine.sampler import _apply_token_masks


@pytest.mark.parametrize("bound", [[0, 1, 2, 3, 4], [1, 4]], ids=["all-rows", "some-rows"])
@pytest.mark.parametrize("words", [32, 30], ids=["covering", "short"])
def test_masked_logits_match_pytorch(device, monkeypatch, bound, words):
    monkeypatch.setattr(kernel, "BLOCK", 256)  # several chunks in the interpreter's small vocabulary
    vocab = 1000  # 31.25 words: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab + 24)[:, :vocab]
    masks = torch.randint(-2**31, 2**31, (len(bound), words), dtype=torch.int32)
    masks[0, 3] = -1  # every bit, the sign bit included
    masks[-1, 5] = 0
    expected = logits.clone()
    _apply_token_masks(expected, masks, bound)
    got = logits.to(device)
    rows = None if len(bound) == logits.shape[0] else torch.tensor(bound, device=device)
    kernel.apply_token_masks_(got, masks.to(device), rows)
    assert torch.equal(got.cpu(), expected)
    assert (expected[bound[0], 96:128] == logits[bound[0], 96:128]).all()  # the all-ones word kept its logits
    assert (expected[bound[-1], 160:192] == float("-inf")).all()
    if words == 30:
        assert (expected[bound, 960:] == float("-inf")).all()
    others = [r for r in range(5) if r not in bound]
    assert torch.equal(expected[others], logits[others])


def test_later_calls_of_a_signature_reuse_its_program_and_their_own_arguments(device):
    """After the first call of a signature kernels.launches launches the kept program directly: later calls with
    other masks, rows and logits (the same shapes) must still apply their own. On the GPU the first call keeps a
    program and the others add none (the interpreter keeps none)."""
    vocab, kept = 5000, []
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(6, vocab, generator=gen)
        masks = torch.randint(-2**31, 2**31, (3, 157), dtype=torch.int32, generator=gen)
        bound = torch.randperm(6, generator=gen)[:3].tolist()
        expected = logits.clone()
        _apply_token_masks(expected, masks, bound)
        got = logits.to(device)
        kernel.apply_token_masks_(got, masks.to(device), torch.tensor(bound, device=device))
        assert torch.equal(got.cpu(), expected)
        kept.append(set(kernel._LAUNCHES.programs))
    assert kept[0] == kept[-1] and (len(kept[0]) > 0) == (device == "cuda")
