"""What the interpreter cannot run, compiled for the H100 (sm_90) on the CPU: Triton's own ptxas turns the kernels'
inline PTX into a cubin, so a typo in it fails here, not on the GPU machine; kernels/decode_linear.py compiles as its
launcher calls it, with and without LoRA, and where it writes float32 partial sums; the decode attention's last
split program (kernels.configs.DECODE_MERGE_IN_SPLIT) counts itself in with one atomic at GPU scope that releases its
partials and acquires the others', which it reads past L1.

The tests run under the interpreter (tests/conftest.py), where @triton.jit makes functions it cannot compile: the
compiling happens in a child process without it."""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest


def compile_for_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, divisible=()):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: pointers.get(name, "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    values = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    # What the JIT tells the compiler of 16-byte aligned pointers and integers divisible by 16: without it loads
    # are not vectorized, nor K loops pipelined with cp.async, as they are on the GPU.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    return triton.compile(ASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=3))


class Capture:
    """Stands in for a @triton.jit kernel: a launch records its arguments in `seen` and runs nothing."""

    def __init__(self, seen: dict):
        self.seen = seen

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.seen.update(args=args, kwargs=kwargs)


def launched_ptx(module, kernel: str, launch, **gpu_constexprs) -> str:
    """Compiles what `launch()` (a launcher of `module`, called on CPU tensors) would launch of module.kernel, with
    the argument types and specializations the JIT gives them on the GPU (an argument of 1 is a constexpr, a
    tensor its pointer type, an aligned pointer or an integer divisible by 16 marked so): a launcher that passes a
    placeholder of another dtype fails here, not on the GPU.
    gpu_constexprs: what the launcher sets on an H100 only (PDL, from kernels.configs.pdl_launch)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fn, seen = getattr(module, kernel), {}
    setattr(module, kernel, Capture(seen))
    try:
        launch()
    finally:
        setattr(module, kernel, fn)
    options = {key: seen["kwargs"].pop(key) for key in ("num_warps", "num_stages") if key in seen["kwargs"]}
    seen["kwargs"].pop("launch_pdl", None)
    pointers, constexprs, divisible = {}, dict(gpu_constexprs), []
    arguments = {**dict(zip(fn.arg_names, seen["args"])), **seen["kwargs"]}  # a keyword may carry a tensor too
    declared = {param.name for param in fn.params if param.is_constexpr}
    for name, value in arguments.items():
        if name in declared:
            constexprs.setdefault(name, value)
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            constexprs[name] = spec
        else:
            pointers[name] = kind
            if spec == "D":
                divisible.append(name)
    kernel = compile_for_sm90(fn, pointers, constexprs, options.get("num_warps", 4), divisible)
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


def decode_linear_launched(rows: int, silu_mul: bool, partials: bool, tiles: int) -> str:
    """kernels.decode_linear as a decode step calls it (bf16, the Qwen2.5-0.5B shape's widths), without LoRA or
    with `tiles` tiles of rank 16 (the shrink kernel it launches first: shrink_launched)."""
    import torch

    import kernels.decode_linear as module
    import kernels.lora

    kernels.lora._shrink_kernel = Capture({})  # runs in a process of its own (compiled)

    n = 4864 if silu_mul else 896
    x = torch.randn(rows, 896, dtype=torch.bfloat16)
    weight = torch.randn(2 * n if silu_mul else n, 896, dtype=torch.bfloat16)
    parts = [(n, 0, 16 * 896), (n, 16 * (896 + n), 16 * (2 * 896 + n))] if silu_mul else [(n, 0, 16 * 896)]
    lora = (torch.zeros(8, 16 * 2 * (896 + n), dtype=torch.bfloat16), torch.zeros(8),
            torch.full((8, 17), -1, dtype=torch.int32), 16, parts)
    return launched_ptx(module, "_decode_linear_kernel", lambda: module.decode_linear(
        x, weight, silu_mul=silu_mul, partials=partials, lora=lora if tiles else None), PDL=True)


def shrink_launched(rows: int, k: int, parts: int, columns: bool = False, silu: bool = False,
                    kernel: str = "_shrink_kernel") -> str:
    """kernels.lora.lora_shrink of `rows` bf16 rows, K = k, for `parts` projections of rank 16 over 8 slots (in the
    columns layout where `columns`; of silu(gate) * up, slices of one gate-up tensor, where `silu`); kernel
    _tile_columns_kernel: from tiles (kernels.lora.TILE_SHRINK_MIN_ROWS), its input copied; "columns_shrinks_":
    that kernel with the input in the columns already."""
    import numpy as np
    import torch

    import kernels.lora as module

    module.TILE_SHRINK_MIN_ROWS = 0 if kernel == "_shrink_kernel" else 1
    gate_up = torch.randn(rows, 2 * k, dtype=torch.bfloat16)
    x, up = gate_up[:, :k], gate_up[:, k:] if silu else None
    weights, scales = torch.zeros(8, 16 * 2 * k * parts, dtype=torch.bfloat16), torch.ones(8)
    tiles = torch.from_numpy(module.lora_tiles(np.arange(rows) % 8, module.max_tiles(rows, 8)))
    offsets, num_tiles = [16 * 2 * k * p for p in range(parts)], min(rows, 8)
    if kernel == "columns_shrinks_":
        t = torch.empty(rows, k + parts * 8 * 16, dtype=torch.bfloat16)
        return launched_ptx(module, "_tile_columns_kernel", lambda: module.columns_shrinks_(
            t, k, weights, scales, tiles, 16, offsets, num_tiles), PDL=True)
    return launched_ptx(module, kernel, lambda: module.lora_shrink(
        x, weights, scales, tiles, 16, offsets, num_tiles, columns, up=up), PDL=True)


def decode_split_ptx(rope: bool, merge: bool) -> str:
    from kernels.decode import _decode_split_kernel

    pointers = {"Q": "*fp32" if rope else "*bf16", "KCache": "*bf16", "VCache": "*bf16", "CacheSeqlens": "*i32",
                "BlockTable": "*i32", "QRows": "*i32", "Out": "*bf16", "PartialOut": "*fp32", "PartialLse": "*fp32",
                "Counters": "*i32", "scale_log2": "fp32", "KNew": "*fp32", "VNew": "*fp32", "Positions": "*i64",
                "CosSin": "*fp32", "SlotMapping": "*i64"}
    constexprs = dict(GROUP=7, SEQLEN_Q=1, NUM_SPLITS=16, BLOCK_SIZE=16, HEAD_DIM=64, HEAD_DIM_PADDED=64,
                      BLOCK_M=16, BLOCK_N=128, IS_CAUSAL=True, VARLEN_Q=False, ROPE_SPLITS=4 if rope else 0,
                      MERGE_IN_SPLIT=merge, SPLITS_PADDED=16, PDL=True)
    # Every pointer a decode step passes is 16-byte aligned (its allocations, and views at multiples of 64 elements)
    aligned = [name for name, kind in pointers.items() if kind.startswith("*")]
    kernel = compile_for_sm90(_decode_split_kernel, pointers, constexprs, num_warps=4, divisible=aligned)
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


def lora_ptx(kernel: str) -> str:
    """kernels.lora.lora_add_'s `kernel` (_tile_shrink_kernel or _expand_kernel) on q, k and v of 64 bf16 rows
    (the Qwen2.5-0.5B shape's widths), rank 16."""
    import numpy as np
    import torch

    import kernels.lora as module

    x = torch.randn(64, 896, dtype=torch.bfloat16)
    outputs = [(torch.zeros(64, n, dtype=torch.bfloat16), a, b)
               for n, a, b in [(896, 0, 16 * 896), (128, 16 * 1792, 16 * 2688), (128, 16 * 2816, 16 * 3712)]]
    weights, scales = torch.zeros(8, 16 * 3840, dtype=torch.bfloat16), torch.ones(8)
    tiles = torch.from_numpy(module.lora_tiles(np.arange(64) % 8, 8))
    for other in {"_tile_shrink_kernel", "_expand_kernel"} - {kernel}:
        setattr(module, other, Capture({}))  # runs in a process of its own (compiled)
    return launched_ptx(module, kernel, lambda: module.lora_add_(x, outputs, weights, scales, tiles, 16), PDL=True)


def norm_launched(add: bool, rows: int, k: int, parts: int, columns: bool = False, update: bool = False) -> str:
    """kernels.elementwise's rms_norm_shrinks (add_rms_norm_shrinks where `add`) of `rows` bf16 rows, K = k,
    computing the shrinks of `parts` projections of rank 16 over 8 slots (in the columns layout where `columns`);
    update: adding first the LoRA update of the projection from 896 columns whose output the rows are (o's)."""
    import numpy as np
    import torch

    import kernels.elementwise as module
    from kernels.lora import lora_tiles, max_tiles

    x, w = torch.randn(rows, k, dtype=torch.bfloat16), torch.ones(k, dtype=torch.bfloat16)
    o_at = 16 * 2 * k * parts  # o's A [16, 896] and B [k, 16] after the others' pairs
    weights, scales = torch.zeros(8, o_at + 16 * (896 + k), dtype=torch.bfloat16), torch.ones(8)
    tiles = torch.from_numpy(lora_tiles(np.arange(rows) % 8, max_tiles(rows, 8)))
    shrinks = (weights, scales, tiles, 16, [16 * 2 * k * p for p in range(parts)])
    o_update = (torch.randn(rows, 896, dtype=torch.bfloat16), o_at, o_at + 16 * 896) if update else None
    if add:
        return launched_ptx(module, "_add_rms_norm_kernel", lambda: module.add_rms_norm_shrinks(
            x.clone(), x.clone(), w, 1e-6, shrinks, columns, o_update), PDL=True)
    return launched_ptx(module, "_rms_norm_kernel", lambda: module.rms_norm_shrinks(x, w, 1e-6, shrinks, columns),
                        PDL=True)


def merge_shrinks_launched(rows: int) -> str:
    """kernels.decode.decode_attention_shrinks' merge of `rows` bf16 rows of 14 heads of 64 (o's input in the
    Qwen2.5-0.5B shape) in 3 splits, with o's shrinks of rank 16 over 8 slots."""
    import numpy as np
    import torch

    import kernels.decode as module
    from kernels.lora import lora_tiles, max_tiles

    q = torch.randn(rows, 14, 64, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)
    lens, table = torch.full((rows,), 20, dtype=torch.int32), torch.zeros(rows, 4, dtype=torch.int32)
    weights, scales = torch.zeros(8, 16 * 2 * 896, dtype=torch.bfloat16), torch.ones(8)
    tiles = torch.from_numpy(lora_tiles(np.arange(rows) % 8, max_tiles(rows, 8)))
    module._decode_split_kernel = Capture({})  # runs in a process of its own (compiled)
    return launched_ptx(module, "_decode_merge_shrinks_kernel", lambda: module.decode_attention_shrinks(
        q, cache, cache, lens, table, None, 3, (weights, scales, tiles, 16, [0])), PDL=True)


# The cases the tests below compile, all in two child processes (one each started in the test, it spent two of the
# three seconds of a case starting)
DECODE_LINEAR = [(1, False, True, 0), (1, False, False, 0), (16, True, False, 0), (1, False, True, 1),
                 (16, True, False, 8), (64, True, False, 8), (64, False, True, 8)]
SHRINKS = [(1, 896, 3, False, False), (16, 4864, 1, False, False), (40, 896, 1, True, False),
           (64, 4864, 1, True, False), (64, 4864, 1, True, True), (256, 4864, 1, True, True)]
NORMS = [(False, 1, 896, 3, False, False), (True, 64, 896, 2, False, False), (True, 256, 2048, 3, False, False),
         (True, 40, 896, 3, True, False), (False, 64, 896, 2, True, False), (True, 1, 896, 2, False, True),
         (True, 64, 896, 2, True, True)]
MERGE_SHRINKS = [17, 64]
TILE_SHRINKS = [(256, 4864, 1, True, True, "_tile_columns_kernel"), (256, 896, 1, True, False, "_tile_columns_kernel"),
                (256, 4864, 1, True, False, "columns_shrinks_"), (100, 896, 3, True, False, "columns_shrinks_")]
LORA_KERNELS = ["_tile_shrink_kernel", "_expand_kernel"]


def planned() -> list[tuple[str, list]]:
    return ([("decode_linear_launched", [*case]) for case in DECODE_LINEAR]
            + [("shrink_launched", [*case]) for case in SHRINKS + TILE_SHRINKS]
            + [("norm_launched", [*case]) for case in NORMS]
            + [("merge_shrinks_launched", [rows]) for rows in MERGE_SHRINKS]
            + [("decode_split", [rope, merge]) for rope in (False, True) for merge in (False, True)]
            + [("lora", [kernel]) for kernel in LORA_KERNELS])


_PTX: dict[str, str] = {}


def compiled(case: str, *args) -> str:
    """The PTX of a planned case (the first call compiles them all, in two processes without the interpreter)."""
    if not _PTX:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        todo = planned()
        with tempfile.TemporaryDirectory() as tmp:
            children = []
            for half in range(2):
                path = os.path.join(tmp, f"{half}.json")
                with open(path, "w") as f:
                    json.dump(todo[half::2], f)
                children.append(subprocess.Popen([sys.executable, __file__, path], env=env, cwd=root,
                                                 stderr=subprocess.PIPE, text=True))
            for child in children:
                _, err = child.communicate(timeout=900)
                assert child.returncode == 0, err[-3000:]
            for half in range(2):
                with open(os.path.join(tmp, f"{half}.json.out")) as f:
                    _PTX.update(json.load(f))
    key = json.dumps([case, list(args)])
    assert key in _PTX, f"{key}: not in planned()"
    assert not _PTX[key].startswith("FAILED"), _PTX[key][-3000:]
    return _PTX[key]


def test_kernels_compile_with_fp_fusion_unless_the_user_turns_it_off():
    """kernels.configs sets Triton's FP-fusion default on (Triton 3.10 turns it off); a user's setting stands. The
    RMSNorm's float32 products and sums are FMAs in its PTX."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    code = "import os, kernels; print(os.environ['TRITON_DEFAULT_FP_FUSION'])"
    for user in (None, "0"):
        seen = subprocess.run([sys.executable, "-c", code], env={**env, **({"TRITON_DEFAULT_FP_FUSION": user}
                              if user else {})}, capture_output=True, text=True, check=True)
        assert seen.stdout.split() == [user or "1"]
    if os.environ.get("TRITON_DEFAULT_FP_FUSION", "1") == "1":  # (the compiling children have this environment)
        assert "fma.rn.f32" in compiled("norm_launched", False, 1, 896, 3, False, False)


@pytest.mark.parametrize("rows,silu_mul,partials,tiles", DECODE_LINEAR)
def test_decode_linear_compiles_as_its_launcher_calls_it(rows, silu_mul, partials, tiles):
    """Without LoRA the launcher passes its output as the slot weights: float32 where it writes partial sums. At
    64 rows (KERNEL_ROWS, what step_profile times) the tiles stay in registers too."""
    ptx = compiled("decode_linear_launched", rows, silu_mul, partials, tiles)
    assert "mma" in ptx and "ld.local" not in ptx


@pytest.mark.parametrize("rows,k,parts,columns,silu", SHRINKS)
def test_lora_shrink_reads_its_slots_before_the_wait(rows, k, parts, columns, silu):
    """The slots' A is read before the wait on the kernel before (it is written before the step), x after it."""
    ptx = compiled("shrink_launched", rows, k, parts, columns, silu)
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait] and "ld.global" in ptx[wait:]


@pytest.mark.parametrize("rows,k,parts,columns,silu,kernel", TILE_SHRINKS)
def test_lora_tile_shrink_reads_a_before_the_wait_and_counts_its_chunks_in(rows, k, parts, columns, silu, kernel):
    """kernels.lora's columns from tiles: a program's chunk of A before the wait, the rows after it; its sums added
    and its chunk counted in with atomics at GPU scope (the count acquiring the others' sums), no local memory.
    Where one program takes all of K (kernels.lora.TILE_WHOLE_K: q/k/v's 896) no atomics at all."""
    from kernels.lora import TILE_WHOLE_K

    ptx = compiled("shrink_launched", rows, k, parts, columns, silu, kernel)
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait] and "ld.global" in ptx[wait:] and "ld.local" not in ptx and "mma" in ptx
    if k <= TILE_WHOLE_K:
        assert not re.search(r"\b(atom|red)\.global", ptx)
        return
    # (the sums' adds are an atom, or a red where the result goes unused: Triton 3.9)
    assert re.search(r"(atom|red)\.global\.gpu\.relaxed\.add\.v2\.f32", ptx)
    assert "atom.global.gpu.acq_rel.add.u32" in ptx


@pytest.mark.parametrize("add,rows,k,parts,columns,update", NORMS)
def test_norms_with_lora_shrinks_read_the_slots_tiles_before_the_wait(add, rows, k, parts, columns, update):
    """Each program's chunk of A is read before the wait (with the rows' slots, from the tiles: both are written
    before the step), and stays in registers across it (no local memory); the rows after it. update (the add after
    o, adding o's LoRA updates): o's A and B too, all in registers."""
    ptx = compiled("norm_launched", add, rows, k, parts, columns, update)
    wait = ptx.index("griddepcontrol.wait")
    before = ptx[:wait].count("ld.global")
    assert before >= 3 and "ld.global" in ptx[wait:] and "ld.local" not in ptx


@pytest.mark.parametrize("rows", MERGE_SHRINKS)
def test_the_decode_merge_with_shrinks_reads_the_slots_before_the_wait(rows):
    """As the norms: each program's chunk of o's A before the wait, the partials after it, no local memory."""
    ptx = compiled("merge_shrinks_launched", rows)
    wait = ptx.index("griddepcontrol.wait")
    assert ptx[:wait].count("ld.global") >= 3 and "ld.global" in ptx[wait:] and "ld.local" not in ptx


@pytest.mark.parametrize("rope", [False, True])
def test_decode_split_merges_after_one_release_acquire_atomic(rope):
    ptx = compiled("decode_split", rope, True)
    atomics = [line.strip() for line in ptx.splitlines() if "atom." in line]
    assert len(atomics) == 1 and atomics[0].startswith("@%p") and "atom.global.gpu.acq_rel.add" in atomics[0]
    assert "ld.global.cg" in ptx and "bar.sync" in ptx.split("atom.global")[0].rsplit("st.global", 1)[1]
    assert "atom." not in compiled("decode_split", rope, False)


@pytest.mark.parametrize("kernel", LORA_KERNELS)
def test_lora_kernels_read_their_input_after_the_wait(kernel):
    """The tiles are read before the wait on the kernel before (written before the step); x, or the shrinks, and
    the outputs after it, where the K loop's pipelined copies (cp.async) start, none before."""
    ptx = compiled("lora", kernel)
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait] and "cp.async" not in ptx[:wait] and "mma" in ptx[wait:]
    assert "ld.global" in ptx[wait:] or "cp.async" in ptx[wait:]


if __name__ == "__main__":  # compiles the cases listed in the file argv[1] into argv[1] + ".out"
    import importlib
    import traceback

    sys.path.insert(0, os.getcwd())
    cases = {"decode_linear_launched": decode_linear_launched, "shrink_launched": shrink_launched,
             "decode_split": decode_split_ptx, "lora": lora_ptx, "norm_launched": norm_launched,
             "merge_shrinks_launched": merge_shrinks_launched}
    # The cases stand in Capture for the kernels they do not compile: each gets the modules as they were
    modules = [importlib.import_module(f"kernels.{name}")
               for name in ("lora", "decode", "decode_linear", "elementwise")]
    with open(sys.argv[1]) as f:
        todo = json.load(f)
    out = {}
    for case, args in todo:
        saved = [dict(vars(module)) for module in modules]
        try:
            out[json.dumps([case, args])] = cases[case](*args)
        except Exception:  # the test that asked for it fails with this
            out[json.dumps([case, args])] = "FAILED\n" + traceback.format_exc()
        for module, attributes in zip(modules, saved):
            vars(module).update(attributes)
    with open(sys.argv[1] + ".out", "w") as f:
        json.dump(out, f)
