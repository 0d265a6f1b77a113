"""The fused inference path (service/model/layers.py: fused projections, kernels/decode_linear.py, the fused
add + RMSNorm and RoPE + cache-write kernels) against the module-by-module path it replaces, on the GPU: logits of
prefill and decode steps, and an engine's greedy outputs through its CUDA graphs."""
import pytest
import torch

from service.model.loader import load_model
from tests.helpers import rel_err
from tests.test_model import paged_run
from tests.tiny_models import VOCAB, make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["as_is", "experiments"])
def switches(request, monkeypatch):
    """The decode step as it is, and with kernels/configs.py's experiments on (RoPE, the cache write and the splits'
    merge in the attention kernel)."""
    from kernels import configs
    if request.param == "experiments":
        for key in ("DECODE_ROPE_IN_ATTENTION", "DECODE_MERGE_IN_SPLIT"):
            monkeypatch.setattr(configs, key, True)
    return request.param


@pytest.mark.parametrize("kind,overrides", [("qwen2", {}), ("llama", {"num_key_value_heads": 1}), ("qwen3", {})])
def test_fused_steps_give_the_module_path_logits(tmp_path, kind, overrides, switches):
    """A 21-token prompt (cuBLAS on the fused weights) and a 3-token one, then decode steps of 2 rows
    (kernels/decode_linear.py); bf16, so logits agree to bf16 rounding and greedy tokens agree."""
    path = make_tiny_model(kind, tmp_path, **overrides)
    model = load_model(path, torch.bfloat16, "cuda")
    assert model.model.layers[0].self_attn.qkv_weight is not None
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (3, 21)]
    torch.manual_seed(0)
    fused, fused_seqs = paged_run(model, prompts, num_decode=4, device="cuda")
    model.fuse_projections(False)
    torch.manual_seed(0)
    unfused, seqs = paged_run(model, prompts, num_decode=4, device="cuda")
    assert fused_seqs == seqs
    for b in range(len(prompts)):
        assert rel_err(fused[b], unfused[b]) < 2e-2


def test_fused_views_share_the_modules_weights(tmp_path):
    model = load_model(make_tiny_model("qwen2", tmp_path), torch.bfloat16, "cuda")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() == attn.qkv_bias[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.out_features:].data_ptr()


def test_engine_greedy_outputs_equal_the_unfused_path(switches):
    """The embedded model (trained weights: clear argmax margins), CUDA graphs at batch 1 and 12 (decode_linear)
    and 40 (cuBLAS on the fused weights); then the graphs recaptured on the module path."""
    from service.engine.llm import LLM
    from service.protocol import SamplingParams

    llm = LLM(None, device="cuda", num_kv_blocks=512)
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun".split()
    prompts = [" ".join(words[i % 7:i % 7 + 3 + i % 9]) for i in range(40)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    def run():
        return [[o.token_ids for o in llm.generate(prompts[:n], params)] for n in (1, 12, 40)]

    fused = run()
    llm.engine.model.fuse_projections(False)
    llm.engine.runner._capture_graphs()
    assert run() == fused
