"""Autotune configs for every kernel, one section per kernel file."""
import functools
import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Floating-point contraction (a * b + c as one FMA) on, as every config and tolerance here was measured with it:
# Triton 3.9 warns at each process's first compile that its default turns it off from 3.10. A user's own setting
# of the variable stands.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# ---------------------------------------------------------------------------------------------------------
# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the one before it in
# the stream finishes, and waits (gdc_wait) before it reads or writes anything that kernel touches; weights, which
# no kernel of a step writes, may be read before the wait. A decode step of a small model is a chain of kernels of a
# few microseconds each, so each launch's latency hides behind its predecessor's tail (CUDA graphs keep the
# dependency). The decode path's kernels use it (decode_linear, elementwise, decode, lora); PDL = False turns it off.
# ---------------------------------------------------------------------------------------------------------
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (the kernels' imports)
    PDL = not INTERPRET
except ImportError:  # a Triton without the griddepcontrol ops
    gdc_launch_dependents = gdc_wait = None
    PDL = False


def pdl_launch(device) -> dict:
    """The launch options of a kernel that supports PDL (its PDL constexpr set to match) on `device`."""
    on = PDL and device.type == "cuda" and _capability(device.index)[0] >= 9
    return {"launch_pdl": True, "PDL": True} if on else {"PDL": False}


@functools.cache
def _capability(index) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(index)


_ZEROED: dict[tuple, list] = {}


def zeroed_scratch(name: str, device, n: int, dtype=None):
    """At least n elements named `name`, zero between launches: the arrival counters (int32, the default) and
    float32 sums of programs that share one result, the last to arrive reading them and putting them back to zero
    (kernels/decode.py's merge in the split, kernels/lora.py's tile shrinks). Grown, never freed (a captured graph
    keeps the one it was captured with); launches on one stream at a time share them."""
    import torch
    buffers = _ZEROED.setdefault((name, device), [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, 4096), dtype=dtype or torch.int32, device=device))
    return buffers[-1]

# ---------------------------------------------------------------------------------------------------------
# Prefill forward (kernels/prefill.py)
# BLOCK_M = 128 suits Hopper wgmma; head_dim 256 needs fewer stages to fit shared memory. K/V read by TMA (the
# unpaged path) also wins with 64 x 64 tiles on short sequences, where more programs per SM hide each one's
# prologue (H100, hd128 causal N=2048: 423 TFLOP/s against 396 for 128 x 128). The interpreter runs a single
# small config so CPU tests stay fast.
# ---------------------------------------------------------------------------------------------------------
def _tma_tile_hook(nargs):
    """The K/V descriptors' tile is [BLOCK_N, HEAD_DIM] of whichever config runs."""
    if nargs["USE_TMA"]:
        for name in ("desc_k", "desc_v"):
            nargs[name].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


def _prefill_configs(shapes):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=_tma_tile_hook)
            for m, n, w, s in shapes]


if INTERPRET:
    PREFILL_CONFIGS = _prefill_configs([(16, 16, 1, 1)])
else:
    PREFILL_CONFIGS = _prefill_configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                                        (128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3)])
_PREFILL_TMA = {(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)}
# The rows of a serving step's tiles (kernels/prefill.py q_tiles), built on the host before a config is chosen:
# the configs of that path have BLOCK_M = PREFILL_TILE_M. Prompt chunks beside decodes are short; 64 suits them.
PREFILL_TILE_M = PREFILL_CONFIGS[0].kwargs["BLOCK_M"] if INTERPRET else 64


def prune_prefill_configs(configs, named_args, **kwargs):
    if INTERPRET:
        return configs[:1]
    args = {**named_args, **kwargs}  # where Triton puts constexpr kwargs varies by version
    shape = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)  # noqa: E731
    if args["HEAD_DIM_PADDED"] >= 256:  # shared memory: keep the small-tile, few-stage configs only
        configs = [c for c in configs if c.kwargs["BLOCK_N"] == 64 and c.num_stages <= 2]
    elif args["USE_TMA"]:
        configs = [c for c in configs if shape(c) in _PREFILL_TMA]
    elif not args["TILED"] and args["HEAD_DIM_PADDED"] > 64:  # head_dim 64 also tries 64-row tiles (more programs)
        configs = [c for c in configs if c.kwargs["BLOCK_M"] == 128]
    if args["TILED"]:
        configs = [c for c in configs if c.kwargs["BLOCK_M"] == PREFILL_TILE_M]
    return configs

# ---------------------------------------------------------------------------------------------------------
# Where the forward and backward stream K/V (or Q/dO) tiles through TMA (kernels/tma.py). On the H100 it paid for
# head_dim 128: the causal forward from 512 tokens on (GPU time at 512 / 1024 / 2048: 236 / 305 / 371 TFLOP/s
# against 194 / 282 / 348 by pointers; an earlier reading that it lost at 1024 was the descriptors' host time,
# before kernels/launches.py), the backward from 2048 (+0..5%). Elsewhere it lost (head_dim 64 backward: about
# 10%), so those shapes keep pointer loads. The interpreter takes TMA wherever it can, so CI tests that path too.
# ---------------------------------------------------------------------------------------------------------
TMA_FROM_TOKENS = {"forward": 512, "backward": 2048}


def tma_pays(head_dim: int, max_seqlen: int, pass_: str) -> bool:
    return INTERPRET or (head_dim == 128 and max_seqlen >= TMA_FROM_TOKENS[pass_])


# ---------------------------------------------------------------------------------------------------------
# Where the warp-specialized Gluon kernels (kernels/hopper_prefill.py, hopper_backward.py; sm_90 and Triton 3.6 only,
# kernels.hopper.supported decides) replace the Triton ones (the forward: unpaged whole batches only): the fewest
# tokens of the longest sequence, by pass, head_dim and causal. H100, bf16, 16k tokens per batch, TFLOP/s Gluon
# against Triton. Forward (since the persistent causal programs pair long and short row blocks): hd128 causal
# 243 / 231 at 512 (157 in a second timing), 441 / 335 at 1024, 492 / 398 at 2048; hd128 full 575 / 422 at 1024;
# hd64 causal 289 / 290 at 1024, 362 / 337 at 2048, 409 / 375 at 4096; hd64 full 415 / 360 at 1024, 434 / 402 at
# 2048. Backward: hd128 causal 339 / 282 at 2048 up to 457 / 394 at 16384, full 452 / 382 at 8192; hd64 causal
# 348 / 339 at 8192 (not measured below, nor hd64 full).
# ---------------------------------------------------------------------------------------------------------
HOPPER_FROM_TOKENS = {
    "forward": {(128, True): 1024, (128, False): 1024, (64, True): 2048, (64, False): 1024},
    "backward": {(128, True): 2048, (128, False): 2048, (64, True): 8192},
}


def hopper_pays(pass_: str, head_dim: int, causal: bool, max_seqlen: int) -> bool:
    return not INTERPRET and max_seqlen >= HOPPER_FROM_TOKENS[pass_].get((head_dim, bool(causal)), float("inf"))


# ---------------------------------------------------------------------------------------------------------
# Decode, split-KV (kernels/decode.py)
# Memory-bound: a large KV tile per iteration (gathered row by row through the block table, so independent of
# the cache block size) with a deep pipeline keeps enough bytes in flight. head_dim 256 halves BLOCK_N.
# ---------------------------------------------------------------------------------------------------------
DECODE_BLOCK_N = 16 if INTERPRET else 128
DECODE_NUM_WARPS = 1 if INTERPRET else 4
DECODE_NUM_STAGES = 1 if INTERPRET else 3
# Fewer launches per layer in a decode step (benchmarks/step_profile.py times each): DECODE_MERGE_IN_SPLIT, the split
# program that finishes last merges its (sequence, KV head)'s splits (no merge kernel); DECODE_ROPE_IN_ATTENTION, the
# fused decode path rotates q and writes the new token's K/V into the cache in the attention kernel (no RoPE kernel;
# service.model.llama). Off: on the H100 (d0bf65a/35dff4c, random weights), against the step without them, each alone
# was 6% faster to 4% slower, both together 1-3% faster at batch 1 and 8, 1-6% at 64 and within 1% at 256 for the
# Qwen2.5-0.5B and Llama-3.2-1B shapes; and RoPE in attention sends speculative verifies back to the prefill path
# (service/engine/model_runner.py).
DECODE_MERGE_IN_SPLIT = False
DECODE_ROPE_IN_ATTENTION = False

# ---------------------------------------------------------------------------------------------------------
# Training backward (kernels/backward.py), one fixed config per kernel keyed by padded head_dim (the smallest key
# >= it). dK/dV holds a K/V block of BLOCK_N keys and streams BLOCK_M queries; dQ the reverse. Picked by a sweep
# on the H100 (bf16, 16k tokens, hidden 2048; see benchmarks/results/attention.json for what they reach).
# ---------------------------------------------------------------------------------------------------------
if INTERPRET:
    BACKWARD_DKDV = {d: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)
                     for d in (64, 128, 256)}
    BACKWARD_DQ = BACKWARD_DKDV
else:
    BACKWARD_DKDV = {64: triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
                     128: triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
                     256: triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=1)}
    BACKWARD_DQ = {64: triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
                   128: triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
                   256: triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=1)}
