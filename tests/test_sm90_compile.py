"""What the interpreter cannot run, compiled for the H100 (sm_90) on the CPU: Triton's own ptxas turns the kernels'
inline PTX into a cubin, so a typo in it fails here, not on the GPU machine. The prefetch of kernels/decode_linear.py
(kernels.configs.PREFETCH) must ask for each piece of a program's weight slice once: one prefetch per thread.

The tests run under the interpreter (tests/conftest.py), where @triton.jit makes functions it cannot compile: the
compiling happens in a child process without it."""
import json
import os
import subprocess
import sys

import pytest


def compile_for_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: pointers.get(name, "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    values = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    return triton.compile(ASTSource(fn, signature, values), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=3))


def decode_linear_ptx(silu_mul: bool, block_n: int, split_k: int, lanes: int) -> str:
    from kernels.decode_linear import _decode_linear_kernel

    pointers = {"X": "*bf16", "W": "*bf16", "BIAS": "*bf16", "Y": "*fp32" if split_k > 1 else "*bf16",
                "LW": "*bf16", "SCALES": "*fp32", "TILES": "*i32"}
    constexprs = dict(HAS_BIAS=False, SILU_MUL=silu_mul, NUM_TILES=0, TILES_PADDED=2, TILE_ROWS=16, RANK=16,
                      BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, LORA_BLOCK_K=512, SPLIT_K=split_k,
                      DOT_PRECISION="tf32", PREFETCH_LANES=lanes, PDL=True)
    kernel = compile_for_sm90(_decode_linear_kernel, pointers, constexprs, num_warps=4)
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


def compiled(case: str, *args) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, case, json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("silu_mul,block_n,split_k", [(True, 32, 1), (False, 32, 4), (False, 16, 1)])
def test_decode_linear_prefetch_compiles_one_prefetch_per_thread(silu_mul, block_n, split_k):
    ptx = compiled("decode_linear", silu_mul, block_n, split_k, 128)
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1, "a thread asks for more than one piece"
    assert ptx.index("cp.async.bulk.prefetch") < ptx.index("griddepcontrol.wait")  # before waiting on its producer
    assert "prefetch" not in compiled("decode_linear", silu_mul, block_n, split_k, 0)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print({"decode_linear": decode_linear_ptx}[sys.argv[1]](*json.loads(sys.argv[2])))
