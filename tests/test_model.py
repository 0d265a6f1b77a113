"""The model against Hugging Face transformers on tiny random checkpoints: full-prompt logits, then decode
steps through the paged KV cache (reference attention on CPU, our kernels on CUDA)."""
import pytest
import torch
from helpers import rel_err
from tiny_models import KINDS, VOCAB, make_tiny_model

from service.model.attention import AttentionMetadata
from service.model.loader import load_model


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return request.param, make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def hf_model(path, dtype, device):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def paged_run(model, prompts, num_decode, block_size=16, device="cpu"):
    """Prefills all prompts in one flat batch, then greedily decodes num_decode tokens per prompt one step
    at a time. Blocks are handed out in a scrambled order. Returns per-prompt logits [len + num_decode, V]
    rows: the prompt's and each decode step's."""
    from kvcache import KVCache

    cfg = model.config
    total = [len(p) + num_decode for p in prompts]
    per_seq = [-(-n // block_size) for n in total]
    num_blocks = sum(per_seq) + 3
    cache = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                    next(model.parameters()).dtype, device)
    cache.storage.fill_(float("nan"))  # unwritten slots must never be read
    model.bind_kv_cache(cache.k_caches, cache.v_caches)
    order = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for n in per_seq:
        tables.append(order[start:start + n])
        start += n
    width = max(per_seq)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)

    def slots(b, lo, hi):
        return [tables[b][p // block_size] * block_size + p % block_size for p in range(lo, hi)]

    def step(tokens, starts):
        ids, pos, slot, lens_q, lens_k = [], [], [], [], []
        for b, (toks, s) in enumerate(zip(tokens, starts)):
            ids += toks
            pos += range(s, s + len(toks))
            slot += slots(b, s, s + len(toks))
            lens_q.append(len(toks))
            lens_k.append(s + len(toks))
        t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        cu = lambda x: torch.nn.functional.pad(t(x).cumsum(0, dtype=torch.int32), (1, 0))  # noqa: E731
        meta = AttentionMetadata(slot_mapping=t(slot, torch.long), block_table=block_table, seqlens_k=t(lens_k),
                                 cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q),
                                 max_seqlen_k=max(lens_k), decode=all(n == 1 for n in lens_q))
        with torch.inference_mode():
            return model.compute_logits(model(t(ids, torch.long), t(pos, torch.long), meta)).float()

    logits = step(prompts, [0] * len(prompts))
    cu = [0]
    for p in prompts:
        cu.append(cu[-1] + len(p))
    rows = [[logits[cu[b]:cu[b + 1]]] for b in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    for _ in range(num_decode):
        nxt = [r[-1][-1].argmax().item() for r in rows]
        out = step([[t] for t in nxt], [len(s) for s in seqs])
        for b, t in enumerate(nxt):
            seqs[b].append(t)
            rows[b].append(out[b:b + 1])
    return [torch.cat(r) for r in rows], seqs


def check_against_hf(kind, path, dtype, device, tol):
    model = load_model(path, dtype, device)
    ref = hf_model(path, dtype, device)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (1, 17, 40)]
    logits, seqs = paged_run(model, prompts, num_decode=4, device=device)
    for b, seq in enumerate(seqs):
        with torch.inference_mode():
            expected = ref(torch.tensor([seq], device=device)).logits[0].float()
        err = rel_err(logits[b], expected)
        assert err < tol, f"{kind} sequence {b}: relative error {err:.2e}"


def test_logits_match_transformers(checkpoint):
    kind, path = checkpoint
    check_against_hf(kind, path, torch.float32, "cpu", 1e-4)


def test_training_forward_matches_and_is_differentiable(checkpoint):
    kind, path = checkpoint
    model = load_model(path, torch.float32, "cpu")
    ref = hf_model(path, torch.float32, "cpu")
    ids = torch.randint(0, VOCAB, (2, 12))
    logits = model.forward_train(ids)
    with torch.no_grad():
        expected = ref(ids).logits
    assert rel_err(logits.detach(), expected) < 1e-4
    # packed varlen: the same two sequences back to back
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    packed = model.forward_train(ids.flatten(), cu_seqlens=cu, max_seqlen=12)
    assert rel_err(packed.detach(), expected.flatten(0, 1)) < 1e-4
    packed.logsumexp(-1).mean().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_unsupported_config_is_rejected():
    from service.model.config import ModelConfig
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})


@pytest.mark.gpu
def test_bf16_logits_match_transformers_on_gpu(checkpoint):
    kind, path = checkpoint
    check_against_hf(kind, path, torch.bfloat16, "cuda", 3e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels on CPU tensors, in Triton's interpreter; on a GPU "
                    "test_bf16_logits_match_transformers_on_gpu runs them")
def test_triton_backend_matches_reference(monkeypatch, tmp_path):
    """The kernel path (Triton interpreter on CPU) gives the reference path's logits: prefill, then decode."""
    import service.model.attention as attention

    path = make_tiny_model("qwen2", tmp_path)
    model = load_model(path, torch.float32, "cpu")
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (3, 21)]
    torch.manual_seed(0)
    expected, seqs = paged_run(model, prompts, num_decode=2)
    monkeypatch.setattr(attention, "use_triton", lambda device: True)
    torch.manual_seed(0)
    logits, seqs_triton = paged_run(model, prompts, num_decode=2)
    assert seqs_triton == seqs
    for b in range(len(prompts)):
        assert rel_err(logits[b], expected[b]) < 1e-4


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused(tmp_path):
    """Fewer rows than the parameter (a truncated q_proj, a smaller vocabulary) fail the load by name, whatever
    the dimension: only a tensor-parallel rank's padded vocabulary slice may be shorter."""
    from safetensors.torch import load_file, save_file

    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        path = make_tiny_model("llama", tmp_path / name)
        tensors = load_file(path / "model.safetensors")
        tensors[name] = tensors[name][:-1].contiguous()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"{name}: checkpoint shape"):
            load_model(path, torch.float32, "cpu")
