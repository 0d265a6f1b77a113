"""Scale-out sizing on paper: weights, KV cache and the batch that fits, per GPU and per engine core, for tensor
parallelism (TP), data parallelism (DP: several engine cores) and their mixes on 80 GB H100s.

The KV budget is the engine's own (service/engine/model_runner.py: start_runner -> kvcache.num_blocks_for_gpu, per
rank): gpu_memory_utilization of the GPU, less what the process holds (weights) and the profiled activation peak,
cut into blocks of block_size tokens by kvcache.num_blocks_for_bytes. The defaults come from service/config.py;
weights are sharded the way service/model/parallel.py shards them. Nothing here needs a GPU, except --profile.

python benchmarks/sizing.py [--out benchmarks/results/sizing.md] [--activation-reserve-gib G]
python benchmarks/sizing.py --profile   # on a GPU: its size, and each model's activation peak, measured
"""
import argparse
import os
import sys
import textwrap

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvcache import block_bytes, num_blocks_for_bytes  # noqa: E402
from service.config import Settings  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.parallel import TensorParallel, check_divisible, local_heads  # noqa: E402

GIB = 2**30
DTYPE = torch.bfloat16
# Defaults of the settings the KV budget depends on (not Settings(), which would read LLM_* from the environment).
GPU_MEMORY_UTILIZATION = Settings.model_fields["gpu_memory_utilization"].default
BLOCK_SIZE = Settings.model_fields["block_size"].default
MAX_NUM_SEQS = Settings.model_fields["max_num_seqs"].default
MAX_NUM_BATCHED_TOKENS = Settings.model_fields["max_num_batched_tokens"].default

# CUDA's total memory (torch.cuda.mem_get_info()[1]) on the lent H100 80GB HBM3, read with --profile; nvidia-smi
# says 81559 MiB, 0.5 GB more, which CUDA does not offer.
H100_BYTES = 85_017_493_504
# The engine's activation peak (ModelRunner.profile_activation_peak: a prefill step of max_num_batched_tokens,
# logits included) for each model at TP1, as --profile read it on the H100: the reserve each row keeps unless
# --activation-reserve-gib says otherwise. Under TP it is an upper bound: the q/k/v and MLP activations shrink by t,
# the residual stream and the gathered logits do not.
ACTIVATION_PEAK_GIB = {"Llama-3-8B": 0.94, "Llama-3-70B": 1.81}
CONTEXTS = (4096, 32768)
# (TP, DP) layouts per GPU count: TP within an engine core, DP across cores (or pods: the same memory per GPU).
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 8: [(8, 1), (4, 2), (2, 4), (1, 8)]}

# HF config.json fields of the two model classes (Llama-3.1's: 128k context, llama3 RoPE scaling).
_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
MODELS = {
    "Llama-3-8B": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
                   "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": _ROPE},
    "Llama-3-70B": {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                    "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False,
                    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": _ROPE},
}


def local_kv_heads(model: dict, tp: int) -> int:
    """KV heads one of tp ranks holds: its share, or one replicated head when there are more ranks than KV heads
    (each rank needs the KV head of its query heads). Refuses the splits the engine refuses (the engine's rules)."""
    cfg = ModelConfig.from_dict(model)
    check_divisible(cfg, tp)
    return local_heads(cfg, TensorParallel(0, tp))[1]


def param_count(model: dict, tp: int = 1) -> int:
    """Parameters one of tp ranks holds (all of them at tp=1). q/k/v and gate/up are split by output rows, o and
    down by input columns, embeddings and LM head by vocabulary rows (rounded up: the last rank's is padded);
    norms are replicated. Llama has no biases."""
    h, d = model["hidden_size"], model["head_dim"]
    q = model["num_attention_heads"] // tp * d
    kv = local_kv_heads(model, tp) * d
    attention = h * q + 2 * h * kv + q * h  # q_proj, k_proj, v_proj, o_proj
    mlp = 3 * h * (model["intermediate_size"] // tp)  # gate_proj, up_proj, down_proj
    layer = attention + mlp + 2 * h  # + input and post-attention RMSNorm
    vocab_rows = -(-model["vocab_size"] // tp)
    embeddings = vocab_rows * h * (1 if model.get("tie_word_embeddings") else 2)  # embed_tokens (+ lm_head)
    return model["num_hidden_layers"] * layer + h + embeddings  # + final norm


def weights_bytes(model: dict, tp: int, dtype: torch.dtype = DTYPE) -> int:
    """What one rank holds before its KV cache: its weights, plus the fp32 RoPE cos/sin table every rank builds
    (max_position_embeddings x head_dim; 64 MiB at 128k context)."""
    rope = model["max_position_embeddings"] * model["head_dim"] * 4
    return param_count(model, tp) * dtype.itemsize + rope


def kv_bytes_per_token(model: dict, tp: int, dtype: torch.dtype = DTYPE) -> int:
    """K and V of one token on one rank, every layer: 2 * layers * local KV heads * head_dim * element size."""
    return block_bytes(model["num_hidden_layers"], 1, local_kv_heads(model, tp), model["head_dim"], dtype)


def kv_budget_bytes(model: dict, tp: int, gpu_bytes: int = H100_BYTES, reserve_bytes: int = 0,
                    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> float:
    """num_blocks_for_gpu's budget: the utilization share of the GPU less weights and activation peak. (The CUDA
    context, NCCL buffers and CUDA graphs come out of the share left over.)"""
    return gpu_bytes * gpu_memory_utilization - weights_bytes(model, tp) - reserve_bytes


def kv_blocks(model: dict, tp: int, gpu_bytes: int = H100_BYTES, reserve_bytes: int = 0,
              gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks of one engine core, as the engine would allocate them (0: not even one block fits). Every rank of
    a TP group holds the same block ids (the fewest any rank fits; here all ranks are alike), each for its own KV
    heads."""
    budget = kv_budget_bytes(model, tp, gpu_bytes, reserve_bytes, gpu_memory_utilization)
    try:
        return num_blocks_for_bytes(budget, model["num_hidden_layers"], block_size, local_kv_heads(model, tp),
                                    model["head_dim"], DTYPE)
    except ValueError:
        return 0


def seqs_that_fit(blocks: int, context: int, block_size: int = BLOCK_SIZE, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """Sequences of `context` tokens one engine core holds at once (whole blocks each), at most max_num_seqs."""
    return min(max_num_seqs, blocks // -(-context // block_size))


def size_layout(name: str, tp: int, dp: int, gpu_bytes: int = H100_BYTES, reserve_gib: float | None = None) -> dict:
    """One table row: dp engine cores of tp GPUs each. reserve_gib: activation reserve (default: the model's
    measured peak)."""
    model = MODELS[name]
    reserve = int((ACTIVATION_PEAK_GIB[name] if reserve_gib is None else reserve_gib) * GIB)
    weights = weights_bytes(model, tp)
    blocks = kv_blocks(model, tp, gpu_bytes, reserve)
    return {"model": name, "gpus": tp * dp, "tp": tp, "dp": dp, "weights": weights, "reserve": reserve,
            "weights_fit": weights + reserve <= gpu_bytes * GPU_MEMORY_UTILIZATION,
            "kv_per_token": kv_bytes_per_token(model, tp),
            "kv_budget": max(0.0, kv_budget_bytes(model, tp, gpu_bytes, reserve)),
            "blocks": blocks, "tokens": blocks * BLOCK_SIZE,
            "seqs": {c: seqs_that_fit(blocks, c) for c in CONTEXTS},
            # a TP forward all-reduces after o_proj and down_proj of every layer, and once for the embeddings
            "all_reduces": 2 * model["num_hidden_layers"] + 1 if tp > 1 else 0}


def all_rows(gpu_bytes: int = H100_BYTES, reserve_gib: float | None = None) -> list[dict]:
    return [size_layout(name, tp, dp, gpu_bytes, reserve_gib)
            for name in MODELS for layouts in LAYOUTS.values() for tp, dp in layouts]


def _layout(r: dict) -> str:
    return f"TP{r['tp']}" + (f" x DP{r['dp']}" if r["dp"] > 1 else "")


def _seqs(r: dict, context: int) -> str:
    per_engine = r["seqs"][context]
    text = f"{per_engine}" if r["dp"] == 1 else f"{r['dp']} x {per_engine} = {per_engine * r['dp']}"
    return text + (" (cap)" if per_engine == MAX_NUM_SEQS else "")


def markdown_table(rows: list[dict]) -> str:
    head = ["model", "GPUs", "layout", "weights / GPU (GiB)", "KV / token / GPU (KiB)", "KV space / GPU (GiB)",
            "KV tokens / engine", "KV tokens, all engines", *(f"seqs @ {c // 1024}k" for c in CONTEXTS),
            "all-reduces / forward"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], str(r["gpus"]), _layout(r), f"{r['weights'] / GIB:.1f}", f"{r['kv_per_token'] / 1024:g}"]
        if r["weights_fit"]:
            cells += [f"{r['kv_budget'] / GIB:.1f}", f"{r['tokens']:,}", f"{r['tokens'] * r['dp']:,}",
                      *(_seqs(r, c) for c in CONTEXTS)]
        else:
            cells += ["**weights do not fit**"] + ["-"] * (2 + len(CONTEXTS))
        lines.append("| " + " | ".join(cells + [str(r["all_reduces"])]) + " |")
    return "\n".join(lines)


def _row(rows: list[dict], name: str, tp: int, dp: int) -> dict:
    return next(r for r in rows if (r["model"], r["tp"], r["dp"]) == (name, tp, dp))


def guidance(rows: list[dict]) -> str:
    """When to use which. The numbers are the table's, so the text follows the formulas; the conclusions drawn
    from them were checked against these defaults (re-read them if the defaults change)."""
    lo, hi = CONTEXTS
    k = {c: f"{c // 1024}k" for c in CONTEXTS}
    s1, s2, s8 = (_row(rows, "Llama-3-8B", tp, 1) for tp in (1, 2, 8))
    s4x2, s2x4, s1x8 = (_row(rows, "Llama-3-8B", tp, 8 // tp) for tp in (4, 2, 1))
    b1, b2, b8 = (_row(rows, "Llama-3-70B", tp, 1) for tp in (1, 2, 8))
    b4x2 = _row(rows, "Llama-3-70B", 4, 2)

    def total(r, c):
        return r["seqs"][c] * r["dp"]

    return f"""\
### Replicas (pods) first

When one GPU holds the model with room for a good batch, serve one engine per GPU and scale the number of pods.
Llama-3-8B on one H100: {s1['weights'] / GIB:.1f} GiB of weights, {s1['kv_budget'] / GIB:.1f} GiB of KV space,
{s1['tokens']:,} tokens, so {total(s1, lo)} sequences of {k[lo]} or {total(s1, hi)} of {k[hi]} at once. Replicas
exchange nothing between GPUs (no collective in any step), fail independently (a lost pod loses its own requests
only), roll out one at a time, and scale on queue depth: `llm_requests_waiting`, as the HPA and the KEDA object in
`deploy/kubernetes/` do.

### DP: several engine cores in one pod

On a host with several GPUs and a model that fits one, `--data-parallel-size N` (one engine core per GPU, behind
the same front-ends) holds what N replicas hold: a TP1 x DPN row is the TP1 row times N (Llama-3-8B on 8 GPUs:
{total(s1x8, lo)} sequences of {k[lo]}, {total(s1x8, hi)} of {k[hi]}). What it adds is one endpoint and its
routing: a request goes to the core that holds its prompt's prefix, else to the least-loaded one, so a shared
system prompt or a multi-turn chat hits one core's prefix cache instead of being spread over N pods by a
round-robin balancer. What it costs: the pod is one unit for failures, roll-outs and scheduling (N free GPUs on
one node).

### TP when the weights, or the KV the target needs, do not fit one GPU

Llama-3-70B's weights alone take {b1['weights'] / GIB:.0f} GiB: they do not fit one 80 GB GPU, so no layout of
single-GPU engines serves it. TP2 fits the weights ({b2['weights'] / GIB:.1f} GiB per GPU) but leaves
{b2['kv_budget'] / GIB:.1f} GiB of KV space: {b2['tokens']:,} tokens, {total(b2, lo)} sequences of {k[lo]},
{total(b2, hi)} of {k[hi]}, too little to serve. A TP4 engine holds {b4x2['tokens']:,} tokens
({b4x2['seqs'][lo]} x {k[lo]}, {b4x2['seqs'][hi]} x {k[hi]}), a TP8 one {b8['tokens']:,} ({b8['seqs'][lo]} x
{k[lo]}, {b8['seqs'][hi]} x {k[hi]}). On 8 GPUs, TP8 holds more than TP4 x DP2 ({total(b8, lo)} against
{total(b4x2, lo)} sequences of {k[lo]}, {total(b8, hi)} against {total(b4x2, hi)} of {k[hi]}), because each GPU
keeps an eighth of the weights instead of a quarter; TP4 x DP2 gives two independent engines (half the blast
radius of a failure, collectives over 4 GPUs instead of 8). Keep a TP group inside one NVLink host: its
collectives run in every layer of every step. Across hosts, scale with replicas of the whole TP group.

TP also buys KV space for a model that fits: weights per GPU shrink by t and so does the KV per token per GPU,
so one engine's token capacity grows faster than t (Llama-3-8B: {s1['tokens']:,} tokens at TP1,
{s2['tokens']:,} at TP2, {s8['tokens']:,} at TP8). That pays when the target context does not fit: at {k[hi]},
one GPU holds {total(s1, hi)} Llama-3-8B sequences, a TP2 engine {total(s2, hi)} on two GPUs. At {k[lo]} the
max_num_seqs cap ({MAX_NUM_SEQS} per engine) decides: on 8 GPUs, TP8 and TP4 x DP2 reach it and run
{total(s8, lo)} and {total(s4x2, lo)} sequences, TP1 x DP8 runs {total(s1x8, lo)} and TP2 x DP4 {total(s2x4, lo)}
(TP2 frees weight memory without reaching the cap). A wide batch of short requests needs several engines.

### The trade-offs

- Latency: a TP forward all-reduces the hidden states after the attention and after the MLP of every layer
  ({s8['all_reduces']} all-reduces a step for Llama-3-8B, {b8['all_reduces']} for Llama-3-70B, then an all-gather
  of the logits), each a synchronisation of all t GPUs whose latency does not shrink with the batch. For a small
  model, whose decode step is short, they are a large share of it. In return each GPU reads 1/t of the weights
  per step, which is what bounds a decode step's time from below: TP lowers per-token latency only as far as
  NVLink keeps the collectives cheap.
- Throughput per GPU: replicas and DP spend nothing on communication; for a model that fits one GPU with a good
  batch they give the most tokens per second per GPU.
- Memory: TP divides the weights and the KV per token by t, until t exceeds the KV heads (8 for both models):
  beyond that each rank keeps one replicated KV head, and the KV per token per GPU stops shrinking.
- Operations: replicas fail and roll out one GPU at a time; a DP pod or a TP group is one unit (a failed rank
  stops its engine core).
"""


def reflow(text: str, width: int = 116) -> str:
    """Re-wraps the paragraphs and list items of generated markdown (the numbers put in change their line
    lengths); headings and table rows stay as they are."""
    def verbatim(line):
        return not line.strip() or line.startswith(("#", "|"))

    items = []
    for line in text.splitlines():
        if verbatim(line) or line.startswith("- ") or not items or verbatim(items[-1]):
            items.append(line)
        else:  # a continuation line of the paragraph or list item above
            items[-1] += " " + line.strip()
    return "\n".join(line if verbatim(line) else textwrap.fill(line, width, break_on_hyphens=False,
                                                                subsequent_indent="  " * line.startswith("- "))
                     for line in items) + "\n"


def report(rows: list[dict], reserve_gib: float | None = None, gpu_bytes: int = H100_BYTES,
           command: str = "") -> str:
    if reserve_gib is None:
        reserve = ", ".join(f"{name} {gib} GiB" for name, gib in ACTIVATION_PEAK_GIB.items())
        reserve = (f"each model's activation peak as the engine profiles it (a prefill step of "
                   f"{MAX_NUM_BATCHED_TOKENS} tokens), measured on the H100 at TP1 with `--profile`: {reserve}; "
                   f"an upper bound under TP. `--activation-reserve-gib G` sets one reserve for all rows instead")
    else:
        reserve = f"{reserve_gib:g} GiB per GPU for every row (`--activation-reserve-gib`)"
    return f"""\
# Scale-out sizing: TP, DP and replicas on 80 GB H100s

Generated by `{command or 'python benchmarks/sizing.py'}`: formulas in `benchmarks/sizing.py`, checked by
`tests/test_sizing.py`. On paper; the GPU's size and the activation peaks are the only measured inputs.

Assumptions:

- GPU: NVIDIA H100 80GB HBM3, {gpu_bytes:,} bytes ({gpu_bytes / GIB:.2f} GiB), the total CUDA reports (measured).
- Engine defaults (`service/config.py`): gpu_memory_utilization {GPU_MEMORY_UTILIZATION}, block_size
  {BLOCK_SIZE}, max_num_seqs {MAX_NUM_SEQS} per engine core, max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}.
- KV space per GPU = {GPU_MEMORY_UTILIZATION} x GPU - weights - activation reserve, as `kvcache.num_blocks_for_gpu`
  computes it, in whole blocks (`kvcache.num_blocks_for_bytes`). The other {1 - GPU_MEMORY_UTILIZATION:.0%}
  ({gpu_bytes * (1 - GPU_MEMORY_UTILIZATION) / GIB:.1f} GiB) is left to the CUDA context, NCCL buffers and CUDA
  graphs.
- Activation reserve: {reserve}.
- bf16 weights and KV cache. Weights counted from the HF config shapes (embeddings, q/k/v/o, gate/up/down, norms,
  untied LM head) and sharded as `service/model/parallel.py` does: query heads, MLP width and vocabulary split by
  t, KV heads split (or one replicated per rank when t exceeds them), norms replicated; plus the engine's fp32
  RoPE table (64 MiB at 128k positions). `--profile` found the engine's weights to take exactly these bytes.
- Llama-3-8B: {param_count(MODELS['Llama-3-8B']) / 1e9:.2f}B parameters, Llama-3-70B:
  {param_count(MODELS['Llama-3-70B']) / 1e9:.2f}B (Llama-3.1 shapes, 128k context); both have 8 KV heads of 128,
  so KV per token per GPU is 2 (K, V) x layers x max(1, 8 / t) x 128 x 2 bytes.
- "KV tokens / engine": each GPU of a TP group holds its heads' share of the same tokens, so this is also the
  tokens one GPU holds. "seqs @ N": sequences of N tokens whose KV fits at once, capped at max_num_seqs per
  engine ("(cap)"), times DP. DP rows hold what as many replicas (pods) would. "all-reduces / forward": 2 per
  layer plus the embedding's, for TP > 1.

{markdown_table(rows)}

## When to use which

{guidance(rows)}"""


def profile(layers: int = 8) -> None:
    """On a GPU: its total memory, and for each model the bytes its weights took (against weights_bytes) and the
    engine's own activation-peak profile. Uninitialised weights, first `layers` layers only: the peak is one
    layer's plus the logits (on the H100, 2, 8 and 16 layers read 0.94, 0.94, 0.91 GiB for the 8B, 1.81 for the
    70B)."""
    from service.engine.model_runner import ModelRunner
    from service.model import LlamaForCausalLM

    print(f"GPU total: {torch.cuda.mem_get_info()[1]:,} bytes ({torch.cuda.get_device_name()})")
    for name, full in MODELS.items():
        model = dict(full, num_hidden_layers=min(layers, full["num_hidden_layers"]))
        base = torch.cuda.memory_allocated()
        with torch.device("meta"):
            net = LlamaForCausalLM(ModelConfig.from_dict(model)).to(DTYPE)
        net = net.to_empty(device="cuda")
        net.model.rotary_emb.rebuild("cuda")
        held = torch.cuda.memory_allocated() - base
        runner = ModelRunner(net, BLOCK_SIZE, model["max_position_embeddings"], MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
        peak = runner.profile_activation_peak()
        print(f"{name} ({model['num_hidden_layers']} layers): weights {held:,} bytes (formula "
              f"{weights_bytes(model, 1):,}), activation peak {peak / GIB:.2f} GiB")
        del net, runner
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "sizing.md"))
    parser.add_argument("--activation-reserve-gib", type=float, default=None,
                        help="GPU memory per GPU kept for activations, for every row (default: each model's "
                             "measured peak, ACTIVATION_PEAK_GIB)")
    parser.add_argument("--profile", action="store_true", help="measure on this machine's GPU instead")
    args = parser.parse_args(argv)
    if args.profile:
        return profile()
    command = " ".join(["python benchmarks/sizing.py", *(sys.argv[1:] if argv is None else argv)])
    text = reflow(report(all_rows(reserve_gib=args.activation_reserve_gib), args.activation_reserve_gib,
                         command=command))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
