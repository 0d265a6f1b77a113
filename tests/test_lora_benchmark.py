"""benchmarks/lora.py's CPU smokes: the decode steps (the engine's steps with adapters against without; the served
results already in lora.json stay) and --served end to end (a real server serving 8 PEFT adapters, streaming
clients, one round of 0% / 5% / 50% phases and the 0% once more; the decode steps' results stay). And the host side
of its GPU graphs' variants and of the served rounds' ratios."""
import json

from tests.helpers import run_benchmark

PHASE_KEYS = {"adapter_share", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "requests",
              "errors", "adapter_requests", "tok_per_s_x", "ttft_p50_x", "ttft_p99_x", "itl_p50_x", "itl_p99_x",
              "steps"}


def test_decode_steps_with_adapters_on_the_cpu(tmp_path):
    served = {"served": {"device": "earlier run", "phases": []}}
    (tmp_path / "lora.json").write_text(json.dumps(served))
    run_benchmark("lora", "--device", "cpu", "--out", str(tmp_path), timeout=240)
    result = json.loads((tmp_path / "lora.json").read_text())
    assert result["served"] == served["served"] and result["device"] == "cpu" and result["rank"] == 16
    cells = {(r["batch"], r["adapters"], r["adapter_rows"]): r for r in result["decode"]}
    # batch 1 and 4 with 0, 1 and 2 adapters, and the most adapters on one row of 4 (5% of the rows, rounded up)
    assert set(cells) == {(1, 0, 0), (1, 1, 1), (1, 2, 1), (4, 0, 0), (4, 1, 4), (4, 2, 4), (4, 2, 1)}
    for (batch, _, _), row in cells.items():
        assert row["step_ms"] > 0 and row["step_x"] == row["step_ms"] / cells[batch, 0, 0]["step_ms"]
        assert "graph_ms" not in row  # no CUDA graphs on the CPU


def test_served_lora_phases_on_the_cpu(tmp_path):
    decode = {"device": "earlier run", "decode": [{"batch": 1, "adapters": 0, "step_ms": 1.0, "step_x": 1.0}]}
    (tmp_path / "lora.json").write_text(json.dumps(decode))
    run_benchmark("lora", "--served", "--device", "cpu", "--out", str(tmp_path), timeout=240)
    result = json.loads((tmp_path / "lora.json").read_text())
    assert {k: result[k] for k in decode} == decode
    served = result["served"]
    assert (served["adapters"], served["rank"]) == (8, 16)
    phases = served["phases"]
    assert [p["adapter_share"] for p in phases] == [0.0, 0.05, 0.5, 0.0]
    for phase in phases:
        assert PHASE_KEYS <= phase.keys(), phase
        assert phase["errors"] == 0 and phase["requests"] > 0 and phase["tok_per_s"] > 0, phase
    # the ratios divide by the mean of the two phases without adapters; base_drift is the second over the first
    assert phases[0]["adapter_requests"] == phases[3]["adapter_requests"] == 0
    assert abs(phases[0]["tok_per_s_x"] + phases[3]["tok_per_s_x"] - 2) < 1e-9
    assert abs(served["base_drift"]["tok_per_s"] - phases[3]["tok_per_s"] / phases[0]["tok_per_s"]) < 1e-9
    # Half the requests named an adapter, and they streamed (an unknown adapter would be a 422, an error).
    assert phases[2]["adapter_requests"] >= phases[2]["requests"] / 4 and phases[2]["named_adapter"]["itl_p50_ms"] > 0
    assert [t["adapter_share"] for t in served["issue_targets"]] == [0.05, 0.5]
    # one round on the CPU: each share's ratios are its phase's
    assert [(s["adapter_share"], s["rounds"]) for s in served["shares"]] == [(0.05, 1), (0.5, 1)]
    assert all(s["tok_per_s_x"] == p["tok_per_s_x"] for s, p in zip(served["shares"], phases[1:3]))
    # The steps in each window by how they ran: on the CPU all eager, from slots where a request named an adapter
    for phase in phases:
        steps = phase["steps"]
        assert steps and {key.split("/")[0] for key in steps} == {"eager"}, steps
        assert abs(sum(s["share"] for s in steps.values()) - 1) < 1e-9 and all(s["mean_ms"] > 0 for s in steps.values())
    assert "eager/slots" in phases[2]["steps"] and "eager/slots" not in phases[0]["steps"]
    assert (tmp_path / "lora.png").stat().st_size > 0


def test_served_rounds_divide_by_the_base_phases_around_them():
    """Two rounds on a server that slows down: each adapter phase against the base phases before and after its
    round, each share averaged over its rounds; the base phases against the mean of all three."""
    from benchmarks.lora import RATIO_KEYS, phase_ratios

    plan = [(0.0, 100), (0.05, 90), (0.5, 80), (0.0, 80), (0.05, 72), (0.5, 60), (0.0, 60)]
    rows = [{"adapter_share": share, **{key: tok for key in RATIO_KEYS}} for share, tok in plan]
    shares = phase_ratios(rows)
    assert [r["tok_per_s_x"] for r in rows] == [100 / 80, 90 / 90, 80 / 90, 1.0, 72 / 70, 60 / 70, 60 / 80]
    assert [(s["adapter_share"], s["rounds"]) for s in shares] == [(0.05, 2), (0.5, 2)]
    assert shares[0]["tok_per_s_x_rounds"] == [1.0, 72 / 70] and shares[0]["tok_per_s_x"] == (1.0 + 72 / 70) / 2
    assert shares[1]["itl_p50_x"] == (80 / 90 + 60 / 70) / 2


def test_the_graphs_variants_name_kernels_lora_switches_and_skip_batches_they_leave_as_shipped():
    """Each variant's switches exist in kernels/lora.py and no_pdl_graphs' PDL switch in kernels/configs.py (the GPU
    run patches them; a stale name would fail only there); a batch captures again only the variants that change its
    graph."""
    import kernels.configs
    import kernels.lora
    from benchmarks.lora import PAST_NORM_ROWS, VARIANTS, variants_at

    assert all(hasattr(kernels.lora, switch) for switches in VARIANTS.values() for switch in switches)
    assert isinstance(kernels.configs.PDL, bool)
    assert variants_at(1) == ["as_shipped", "o_own_launches"]
    assert set(variants_at(64)) == set(VARIANTS) - PAST_NORM_ROWS and variants_at(256) == list(VARIANTS)
