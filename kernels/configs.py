"""Autotune configs for every kernel, one section per kernel file."""
import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# ---------------------------------------------------------------------------------------------------------
# Prefill forward (kernels/prefill.py)
# BLOCK_M = 128 suits Hopper wgmma; head_dim 256 needs fewer stages to fit shared memory.
# The interpreter runs a single small config so CPU tests stay fast.
# ---------------------------------------------------------------------------------------------------------
if INTERPRET:
    PREFILL_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
else:
    PREFILL_CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    ]


def prune_prefill_configs(configs, named_args, **kwargs):
    if INTERPRET:
        return configs[:1]
    head_dim = {**named_args, **kwargs}["HEAD_DIM_PADDED"]  # where Triton puts constexpr kwargs varies by version
    if head_dim >= 256:  # shared memory: keep the small-tile, few-stage configs only
        return [c for c in configs if c.kwargs["BLOCK_N"] == 64 and c.num_stages <= 2] or configs[-1:]
    return [c for c in configs if c.kwargs["BLOCK_M"] == 128]

# ---------------------------------------------------------------------------------------------------------
# Decode, split-KV (kernels/decode.py)
# Memory-bound: a large KV tile per iteration (gathered row by row through the block table, so independent of
# the cache block size) with a deep pipeline keeps enough bytes in flight. head_dim 256 halves BLOCK_N.
# ---------------------------------------------------------------------------------------------------------
DECODE_BLOCK_N = 16 if INTERPRET else 128
DECODE_NUM_WARPS = 1 if INTERPRET else 4
DECODE_NUM_STAGES = 1 if INTERPRET else 3

# ---------------------------------------------------------------------------------------------------------
# Training backward (kernels/backward.py), one fixed config per kernel keyed by padded head_dim (the smallest key
# >= it). dK/dV holds a K/V block of BLOCK_N keys and streams BLOCK_M queries; dQ the reverse. Picked by a sweep
# on the H100 (bf16, 16k tokens, hidden 2048; see benchmarks/results/attention.json for what they reach).
# ---------------------------------------------------------------------------------------------------------
if INTERPRET:
    BACKWARD_DKDV = {d: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1) for d in (64, 128, 256)}
    BACKWARD_DQ = BACKWARD_DKDV
else:
    BACKWARD_DKDV = {64: triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
                     128: triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
                     256: triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=1)}
    BACKWARD_DQ = {64: triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
                   128: triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
                   256: triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=1)}
