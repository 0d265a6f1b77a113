"""benchmarks/step_profile.py's host side on the CPU: its smoke (--device cpu) end to end, so that a change to the
engine's internals its prefill and decode sections reach into (the runner, the scheduler, the LLM API) breaks here
rather than on the next GPU run; and every configuration its sweeps time (kernels/decode_linear.py's and
kernels/lora.py's) launches and computes the reference result in the interpreter, so that a sweep on the GPU cannot
fail on a configuration the launchers no longer accept."""
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import step_profile
from benchmarks.generate import TINY_CONFIG
from benchmarks.provenance import git_commit
from kernels.decode_linear import decode_linear, decode_linear_ref
from kernels.lora import (
    ROW_SHRINK_MAX_ROWS,
    TILE_SHRINK_MIN_ROWS,
    lora_add_,
    lora_add_ref,
    lora_tiles,
    max_tiles,
)
from tests.helpers import is_skip_reason, rel_err, run_benchmark

CPU = step_profile.SETUPS["cpu"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    """One run of the smoke for the tests below (about 15 s): its JSON, and its --out folder."""
    out = tmp_path_factory.mktemp("step_profile")
    run_benchmark("step_profile", "--device", "cpu", "--out", str(out), timeout=120,
                  env={**os.environ, "TRITON_INTERPRET": "1"})
    return json.loads((out / "step_profile.json").read_text()), out


def profiled_functions(text: str) -> list[str]:
    """The functions in the rows of a cProfile table as pstats prints it (ncalls, 4 times, function); the benchmark
    keeps its top 18 by own time, the text cut to its end."""
    return re.findall(r"^ +\d+(?:/\d+)? +(?:[\d.]+ +){4}(.+)$", text, re.M)


def test_the_smoke_names_the_cpu_and_its_commit_and_skips_the_graphs_section(smoke):
    result, out = smoke
    assert result["gpu"] == "cpu" and result["commit"] == git_commit() and result["weights"] == CPU["weights"]
    assert result["torch"] == torch.__version__ and result["date"]
    assert is_skip_reason(result["graphs"]), result["graphs"]
    assert not (out / "step_profile.png").exists()  # the plot is the graphs section's: none without it


def test_the_smoke_times_a_prefill_step_the_attention_call_and_the_engines_ttft(smoke):
    result, _ = smoke
    assert (result["tokens"], result["layers"]) == (CPU["tokens"], TINY_CONFIG["num_hidden_layers"])
    for key in ("step_wall_ms", "attention_call_host_us", "attention_call_wall_ms", "engine_ttft_ms"):
        assert result[key] > 0, key
    assert is_skip_reason(result["step_gpu_ms"]) and result["prefill_graphs"] == 0  # eager steps: no CUDA graphs
    # where the host time goes: torch.profiler's table of the forward's ops, cProfile's of the engine's steps
    assert "Self CPU time total" in result["prefill_profile"] and "aten::" in result["prefill_profile"]
    functions = profiled_functions(result["engine_ttft_profile"])
    assert len(functions) >= 12 and any("linear" in f for f in functions), result["engine_ttft_profile"]


def test_the_smoke_times_decode_steps_at_each_batch_and_with_an_adapter(smoke):
    result, _ = smoke
    batches = [str(batch) for batch in CPU["decode_batches"]]  # JSON's keys
    assert list(result["decode_step_ms"]) == list(result["decode_profiles"]) == batches
    assert all(ms > 0 for ms in result["decode_step_ms"].values()), result["decode_step_ms"]
    assert result["decode_step_ms_with_adapter"] > 0
    for batch, profile in result["decode_profiles"].items():  # the steps' projections among the costliest
        functions = profiled_functions(profile)
        assert len(functions) >= 12 and any("linear" in f for f in functions), (batch, profile)
    assert is_skip_reason(result["decode_graph_ms"]), result["decode_graph_ms"]


def test_the_smokes_sweeps_time_every_configuration_of_each_cell(smoke):
    result, _ = smoke
    c = TINY_CONFIG
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    widths = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}  # (n, k)
    linear = {(r["shape"], r["proj"], r["rows"]): r for r in result["linear"]}
    assert set(linear) == {("tiny", proj, m) for proj in widths for m in CPU["linear_rows"]}
    for (_, proj, _), row in linear.items():
        assert (row["n"], row["k"]) == widths[proj], row
        configs = step_profile.LINEAR_CONFIGS + (step_profile.SPLIT_CONFIGS if proj in ("o", "down") else [])
        assert list(row["configs_us"]) == [str(cfg) for cfg in configs]
        assert all(us > 0 for us in row["configs_us"].values()) and row["cublas_us"] > 0 and row["floor_us"] > 0
        assert row["best_us"] == row["configs_us"][str(tuple(row["best"]))] == min(row["configs_us"].values())
    lora = {(r["proj"], r["rows"]): r for r in result["lora"]}
    assert set(lora) == {(proj, m) for proj in widths for m in CPU["lora_rows"]}
    for row in lora.values():
        assert row["adapters"] == CPU["adapters"]
        assert list(row["configs_us"]) == [str(cfg) for cfg in step_profile.LORA_CONFIGS]
        assert row["best_us"] == row["configs_us"][str(tuple(row["best"]))] == min(row["configs_us"].values()) > 0
    cells = [(r["proj"], r["rows"], sorted(k for k in r if k.startswith("us_"))) for r in result["decode_lora"]]
    assert cells == [(proj, m, sorted(f"us_{c}" for c in counts)) for proj in widths
                     for m, counts in CPU["decode_lora_rows"]]
    assert all(r[k] > 0 for r in result["decode_lora"] for k in r if k.startswith("us_"))
    # the shrinks' producers: the norms and the SwiGLU gate at both sizes, o's input past the norms' rows, where the
    # tiles compute the shrinks (the smoke's larger size reaches them)
    assert max(CPU["producer_rows"]) >= TILE_SHRINK_MIN_ROWS > ROW_SHRINK_MAX_ROWS
    producers = {(r["rows"], r["adapter_rows"], r["producer"]): r for r in result["lora_producers"]}
    assert set(producers) == {(m, a, name) for m in CPU["producer_rows"] for a in (max(1, m // 20), m)
                              for name in ("qkv_norm", "gate_up_norm", "down_input")
                              + (("o_input",) if m > ROW_SHRINK_MAX_ROWS else ())}
    for (_, _, name), row in producers.items():
        assert row["lora_us"] > 0 and (row["base_us"] is None if name == "o_input" else row["base_us"] > 0), row


def test_every_swept_decode_linear_configuration_computes_the_projection(device):
    for rows in (3, max(step_profile.LINEAR_ROWS)):
        x, w = torch.randn(rows, 96, device=device), torch.randn(64, 96, device=device) / 10
        want = decode_linear_ref(x, w)
        for cfg in step_profile.LINEAR_CONFIGS + step_profile.SPLIT_CONFIGS:
            out = decode_linear(x, w, config=cfg, partials=cfg[-1] > 1)
            assert rel_err(out.sum(0) if out.dim() == 3 else out, want) < 1e-5, (rows, cfg)


def test_every_swept_lora_configuration_adds_the_updates(device):
    rows, k, n, rank, slots = 20, 48, 40, 16, 3
    weights = torch.randn(slots, rank * (k + n), device=device) / 4
    scales, x = torch.rand(slots, device=device) + 0.5, torch.randn(rows, k, device=device)
    row_slots = np.arange(rows, dtype=np.int32) % slots
    tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots))).to(device)
    want = torch.zeros(rows, n, device=device)
    lora_add_ref(x, [(want, 0, rank * k)], weights, scales, torch.from_numpy(row_slots).to(device), rank)
    for cfg in step_profile.LORA_CONFIGS[::4]:
        y = torch.zeros(rows, n, device=device)
        lora_add_(x, [(y, 0, rank * k)], weights, scales, tiles, rank, config=cfg)
        assert rel_err(y, want) < 1e-5, cfg


def test_every_path_switch_is_a_setting_of_kernels_configs():
    from kernels import configs
    for _, _, switches in step_profile.PATHS:
        assert all(isinstance(getattr(configs, key), bool) for key in switches)


def test_every_lora_case_is_a_valid_decode_linear_call(device):
    """The projection groups of --sections decode_lora and lora (here of a small shape) with their slot layouts:
    decode_linear with one adapter matches its reference."""
    shape = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1}
    rank, slots = 16, 2
    for rows in (3, max(m for m, _ in step_profile.DECODE_LORA_ROWS)):
        for proj, (k, widths, silu, partials, parts, size) in step_profile.lora_cases(shape, rank).items():
            gen = torch.Generator().manual_seed(len(proj))
            x, w = torch.randn(rows, k, generator=gen), torch.randn(sum(widths), k, generator=gen) / k ** 0.5
            lw, scales = torch.randn(slots, size, generator=gen) / 4, torch.rand(slots, generator=gen) + 0.5
            row_slots = np.arange(rows, dtype=np.int32) % (slots + 1) - 1
            tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots)))
            x, w, lw, scales, tiles = (t.to(device) for t in (x, w, lw, scales, tiles))
            lora = (lw, scales, tiles, rank, parts)
            out = decode_linear(x, w, silu_mul=silu, lora=lora, partials=partials)
            ref = decode_linear_ref(x, w, silu_mul=silu, lora=lora, row_slots=torch.from_numpy(row_slots).to(device))
            assert rel_err(out.sum(0) if partials else out, ref) < 1e-5, (rows, proj)
