"""The Gluon warp-specialized Hopper forward (kernels/hopper_prefill.py) against the float32 reference. These need
an sm_90 GPU with Triton 3.6; elsewhere kernels.hopper.supported says False and the tests skip. CI runs the
host-side ones: grid sizes and the ragged batches' tile list (a Triton kernel, in the interpreter)."""
import pytest
import torch
import triton

from kernels import hopper, hopper_prefill
from kernels.reference import varlen_attention_ref
from tests.helpers import cu_seqlens, rel_err

TOL = 1e-2


def _inputs(lens_q, lens_k, nheads, nheads_k, head_dim, dtype):
    q = torch.randn(sum(lens_q), nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(max(sum(lens_k), 1), nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v, cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")


def _check(lens_q, lens_k, nheads, nheads_k, head_dim, causal, dtype=torch.bfloat16, **config):
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, nheads, nheads_k, head_dim, dtype)
    if not hopper.supported(q, k, v):
        pytest.skip("needs an sm_90 GPU and Triton 3.6")
    scale = head_dim ** -0.5
    out, lse = hopper_prefill.hopper_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal,
                                             config=config or None)
    ref, ref_lse = varlen_attention_ref(q.float(), k.float(), v.float(), cu_q, cu_k, scale, causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (nheads, q.shape[0])
    assert rel_err(out, ref) < TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "-inf positions of lse differ"
    assert (lse[~finite] == float("-inf")).all()
    assert (out.transpose(0, 1)[~finite] == 0).all(), "rows that see no key must be 0"
    if finite.any():
        assert rel_err(lse[finite], ref_lse[finite]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gqa_ragged(causal, head_dim, dtype):
    # Lengths off the 128-row program tile and the 128-key block, GQA 4:1.
    lens = [1, 17, 130, 257, 1000]
    _check(lens, lens, 8, 2, head_dim, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_q_differs_from_k(causal, head_dim):
    # Chunked prefill (q shorter than k), q longer than k (causal rows that see no key), and an empty k.
    lens_q = [5, 100, 300, 64, 200, 7]
    lens_k = [40, 30, 700, 64, 0, 129]
    _check(lens_q, lens_k, 4, 1, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{"STAGES": 3, "PINGPONG": False}, {"STAGES": 3, "PINGPONG": True},
                                    {"PINGPONG": False}, {"PERSISTENT": False}, {"TMA_STORE": False}])
def test_configs(config):
    # Every knob of the launcher's config; the persistent programs each run several tiles here.
    lens = [129, 640, 383]
    _check(lens, [n + 50 for n in lens], 4, 2, 128, True, **config)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_real_size_bf16(causal):
    _check([2048, 2048], [2048, 2048], 16, 16, 128, causal)


@pytest.mark.gpu
def test_out_in_place_and_unsupported():
    q, k, v, cu_q, cu_k = _inputs([70, 33], [70, 33], 4, 4, 128, torch.bfloat16)
    if not hopper.supported(q, k, v):
        pytest.skip("needs an sm_90 GPU and Triton 3.6")
    out = torch.full_like(q, float("nan"))
    got, _ = hopper_prefill.hopper_forward(q, k, v, cu_q, cu_k, 70, 70, 0.1, True, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    # An out the copy engine cannot address (heads not packed) is written by plain stores.
    strided = torch.full((q.shape[0], 4, 256), float("nan"), device="cuda", dtype=q.dtype)[..., :128]
    hopper_prefill.hopper_forward(q, k, v, cu_q, cu_k, 70, 70, 0.1, True, out=strided)
    torch.testing.assert_close(strided, out, atol=0, rtol=0)
    assert not hopper.supported(q.float(), k.float(), v.float())
    assert not hopper.supported(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous())
    assert not hopper.supported(q.cpu(), k.cpu(), v.cpu())


@pytest.mark.parametrize("num_m_tiles, num_tiles, causal, persistent", [
    (16, 2048, True, True),      # hd128 causal N=2048 on 132 SMs: each program cycles through all its row blocks
    (64, 2048, True, False),     # N=8192: 15 tiles a program, a cycle of 16 row blocks: one program per tile
    (128, 2048, True, False),
    (128, 2048, False, True),    # full attention: every tile costs the same
    (4, 100, True, False),       # fewer tiles than SMs
    (4, 1024, True, False),      # 132 = 0 mod 4: each program would meet a single row position
    (1, 1024, True, True),       # one row block a sequence: every tile costs the same
])
def test_grid_size(num_m_tiles, num_tiles, causal, persistent):
    grid = hopper_prefill._grid_size(num_m_tiles, num_tiles, causal, False, 132)
    assert grid == (132 if persistent else num_tiles)
    assert hopper_prefill._grid_size(num_m_tiles, num_tiles, causal, True, 132) == num_tiles  # ragged


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [12, 10, 7])
def test_persistent_causal_row_order(programs):
    # Persistent causal programs with row groups of 4, 2 and 1 (8 row tiles a sequence): every tile must be
    # computed exactly once whatever order _tile hands the row blocks out in.
    lens = [1000, 129, 640, 383, 1024]
    _check(lens, lens, 4, 2, 128, True, PROGRAMS=programs, TILE_LIST=False)
    _check(lens, lens, 4, 4, 64, True, PROGRAMS=programs, TILE_LIST=False)
    _check(lens, lens, 4, 2, 128, True, PROGRAMS=programs)  # persistent programs over the ragged batch's list


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_tile_list(causal):
    # Ragged batches run the listed tiles only: empty and one-token sequences, a sequence alone in its tile, the
    # long one; and the same batch as a program per (row tile, head, sequence).
    lens = [2048, 0, 1, 63, 64, 129, 0, 700]
    _check(lens, lens, 8, 2, 128, causal)
    _check(lens, lens, 8, 2, 128, causal, TILE_LIST=False)
    _check(lens, [n + 20 for n in lens], 8, 8, 64, causal)


def test_cpu_tensors_are_not_supported():
    # CI's path: without an sm_90 GPU (or with another Triton) the dispatchers must keep the Triton kernels.
    q = torch.randn(8, 2, 64, dtype=torch.float16)
    assert not hopper.supported(q, q, q)
    assert not hopper.supported(q, q, q, q)


@pytest.mark.gpu
def test_repeated_calls_launch_the_kept_program():
    # Later calls of a signature launch the kept program (kernels.launches.KernelLaunches) and must compute the
    # same on fresh data; 513 query rows (not a multiple of 16, which Triton specializes on) are a new signature.
    programs = hopper_prefill._LAUNCHES.programs
    programs.clear()  # other tests' signatures (Triton keeps the compiled code)
    _check([304, 208], [304, 208], 4, 2, 128, True)
    assert len(programs) == 1
    _check([304, 208], [304, 208], 4, 2, 128, True)
    assert len(programs) == 1
    _check([304, 209], [304, 209], 4, 2, 128, True)
    assert len(programs) == 2


def test_launch_keys_split_where_triton_specializes():
    # kernels.launches.KernelLaunches keeps one program per key it builds from the arguments: two arguments it keys
    # alike must be ones Triton 3.6 (the Gluon kernels' version) compiles alike.
    if not triton.__version__.startswith(hopper.GLUON_VERSION) or hopper.GLUON_ERROR is not None:
        pytest.skip(f"the Gluon kernels run on Triton {hopper.GLUON_VERSION}x only")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from kernels.launches import _specialization
    flat = torch.empty(4096, dtype=torch.bfloat16)
    rows = flat[:64 * 2 * 16].view(64, 2, 16)
    samples = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**32 + 16, -16, 0.5, 1.0, flat, flat[1:],
               flat[8:], flat.float(), torch.empty(8, dtype=torch.int32), hopper.rows_descriptor(rows, 64),
               hopper.rows_descriptor(flat[:65 * 32].view(65, 2, 16), 64), hopper.rows_descriptor(rows, 128)]
    triton_key = lambda arg: native_specialize_impl(CUDABackend, arg, False, True, True)  # noqa: E731
    for a in samples:
        for b in samples:
            if _specialization(a) == _specialization(b):
                assert triton_key(a) == triton_key(b), (a, b)


@pytest.mark.parametrize("lens", [[300, 0, 1, 128, 129, 5], [0], [1000], list(range(0, 520, 13))])
def test_ragged_tiles_list_every_tile_once(lens):
    # The list builder (a Triton kernel: the interpreter runs it in CI) against the order it documents.
    nheads, rows = 3, 128
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiles, slots = hopper_prefill._ragged_tiles(cu_seqlens(lens, device), nheads, sum(lens), rows)
    expected = [(b << 32) | (h << 16) | (triton.cdiv(n, rows) - 1 - i)
                for b, n in enumerate(lens) for h in range(nheads) for i in range(triton.cdiv(n, rows))]
    assert slots == nheads * (triton.cdiv(sum(lens), rows) + len(lens)) >= len(expected)
    assert tiles.tolist() == expected + [-1] * (slots - len(expected))
