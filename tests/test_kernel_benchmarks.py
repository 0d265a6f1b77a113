"""The CPU smokes of the attention kernels' benchmarks (benchmarks/attention.py, decode.py and launch.py): each runs
its GPU run's code path end to end on tiny shapes, our kernels in Triton's interpreter, so that an API change breaks
here rather than on the next GPU run. Their numbers mean nothing; which cells they fill, and which they skip and
why, do."""
import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import attention, decode, launch
from benchmarks.provenance import git_commit
from tests.helpers import is_skip_reason, rel_err, run_benchmark

# CI's smokes: our kernels take CPU tensors in Triton's interpreter only (tests/conftest.py turns it on where there is
# no GPU), and on a GPU host the benchmarks themselves run. (Triton 3.6's interpreter, a GPU host's, cannot run them
# anyway: tests.helpers.run_benchmark skips interpreter smokes under Triton < 3.7.)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke; on a GPU the benchmark itself runs")


def run_smoke(script: str, out: Path) -> dict:
    """Runs benchmarks/SCRIPT.py --device cpu into `out`; its JSON, after checking the plot and the provenance."""
    run_benchmark(script, "--device", "cpu", "--out", str(out), timeout=120,
                  env={**os.environ, "TRITON_INTERPRET": "1"})
    assert (out / f"{script}.png").stat().st_size > 0
    result = json.loads((out / f"{script}.json").read_text())
    assert result["gpu"] == "cpu" and result["commit"] == git_commit(), result
    return result


def test_attention_smoke_times_ours_and_sdpa_math_and_skips_the_gpu_peers(tmp_path):
    result = run_smoke("attention", tmp_path)
    cpu = attention.SETUPS["cpu"]
    assert result["dtype"] == "float32" and result["mode"] == "both" and result["backward_available"]
    rows = {(r["provider"], r["head_dim"], r["causal"], r["seqlen"]): r for r in result["rows"]}
    providers = ("ours", "sdpa_math", "sdpa_flash", "sdpa_cudnn", "flex")
    assert len(rows) == len(result["rows"]) == len(providers) * len(cpu["head_dims"]) * 2 * len(cpu["seqlens"])
    assert {key[0] for key in rows} == set(providers)
    for (provider, head_dim, _, seqlen), row in rows.items():
        assert row["nheads"] == cpu["hidden"] // head_dim and row["batch"] == cpu["tokens"] // seqlen == 1
        if provider in ("ours", "sdpa_math"):  # forward and backward timed, through the interpreter for ours
            assert row["error"] is None and row["fwd_tflops"] > 0 and row["bwd_tflops"] > 0, row
        else:
            assert is_skip_reason(row["error"]) and row["fwd_tflops"] is row["bwd_tflops"] is None, row
    assert set(result["peak_memory_mib"]) == {"ours", "sdpa_flash"}
    assert all(is_skip_reason(why) for why in result["peak_memory_mib"].values()), result["peak_memory_mib"]
    varlen = result["varlen"]
    assert varlen["num_seqs"] == cpu["varlen"]["num_seqs"] and varlen["varlen_tflops"] > 0, varlen
    assert varlen["fixed_tflops"] > 0 and varlen["ratio"] == varlen["varlen_tflops"] / varlen["fixed_tflops"]


def test_attention_providers_compute_the_same_attention_in_their_layouts():
    """The CPU's two providers on the same inputs, each in the layout the benchmark gives it: ours and SDPA math
    agree, so the rows compare the same work (a causal flag or layout wired wrong would not)."""
    providers, _ = attention._providers("cpu")
    (ours, ours_layout), (math, math_layout) = providers["ours"], providers["sdpa_math"]
    assert (ours_layout, math_layout) == ("bnhd", "bhnd")
    q, k, v = attention._inputs(1, 48, 2, 32, "bnhd", False, "cpu", torch.float32)
    for causal in (False, True):
        want = math(*(t.transpose(1, 2) for t in (q, k, v)), causal).transpose(1, 2)
        assert rel_err(ours(q, k, v, causal), want) < 1e-5, causal


def test_decode_smoke_times_our_paged_kernel_and_sdpa_math_and_skips_the_gpu_peers(tmp_path):
    result = run_smoke("decode", tmp_path)
    cpu = decode.SETUPS["cpu"]
    assert result["dtype"] == "torch.float32" and result["timing"] == cpu["timing"] and result["unit"] == "TB/s"
    assert (result["nheads"], result["nheads_k"], result["head_dim"]) == (cpu["nheads"], cpu["nheads_k"],
                                                                          cpu["head_dim"])
    assert [(r["batch"], r["ctx"]) for r in result["rows"]] == cpu["shapes"]
    for row in result["rows"]:
        assert set(row["tbps"]) == {"ours bs16", "ours bs128", "sdpa math"}, row
        assert all(tbps > 0 for tbps in row["tbps"].values()), row
        assert set(row["errors"]) == {"sdpa flash", "sdpa cudnn", "flex"}, row
        assert all(is_skip_reason(why) for why in row["errors"].values()), row


def test_launch_smoke_times_every_api_layer_and_skips_the_gpu_time(tmp_path):
    result = run_smoke("launch", tmp_path)
    cpu = launch.SETUPS["cpu"]
    assert (result["heads"], result["head_dim"]) == (cpu["heads"], cpu["head_dim"])
    assert [(r["batch"], r["seqlen"]) for r in result["rows"]] == cpu["shapes"]
    layers = {"flash_attn_func", "flash_attn_func, grad", "flash_attn_varlen_func", "launcher", "sdpa"}
    for row in result["rows"]:
        assert set(row) == layers | {"batch", "seqlen", "gpu_us"}, row
        assert all(row[name] > 0 for name in layers), row
        assert is_skip_reason(row["gpu_us"]), row
