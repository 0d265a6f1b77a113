"""benchmarks/spec.py on the CPU, shortened: verify-step cost against a decode step, tokens/s at forced acceptance
rates (with and without the acceptance back-off), the n-gram proposer on copy-heavy and free prompts, draft models
(the target itself, its first layers) and the back-off's model; the run must pass and its JSON carry the rows (the
host side of the GPU benchmark cannot rot unseen)."""
import json

from tests.helpers import run_benchmark


def test_a_short_spec_benchmark_runs_on_the_cpu(tmp_path):
    run_benchmark("spec", "--device", "cpu", "--out", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "spec.json").read_text())
    assert [r["batch"] for r in result["verify_cost"]] == [1, 2]
    assert all(r[f"k{k}_ms"] > 0 for r in result["verify_cost"] for k in (0, 2, 4))
    (forced,) = result["forced_acceptance"]
    assert forced["alpha0.0"]["acceptance"] == 0 and forced["alpha1.0"]["acceptance"] == 1
    # Always rejected, the back-off pauses drafting (12 tokens: nine drafts, then a pause); always accepted, it
    # changes nothing.
    rejected, accepted = forced["alpha0.0"], forced["alpha1.0"]
    assert rejected["backoffs"] == 1 and rejected["drafts"] == 9 and rejected["no_backoff"]["drafts"] == 10
    assert accepted["backoffs"] == 0 and accepted["drafts"] == accepted["no_backoff"]["drafts"]
    rows = result["copy_heavy_vs_free"]
    assert [(r["workload"], r["streams"]) for r in rows] == [("copy_heavy", 2), ("copy_heavy", 1), ("free", 2),
                                                             ("free", 1)]
    # The copying variant copies the fortune: its drafts are accepted (the default model's: half or fewer)
    assert all(r["identical_to_plain"] for r in rows) and all(r["acceptance"] >= 0.8 for r in rows[:2])
    assert all(r["ngram_no_backoff_tokens_per_s"] > 0 and r["backoffs"] >= 0 for r in rows)
    assert (tmp_path / "spec.png").stat().st_size > 10_000
    assert result["runs"]["copy_heavy_vs_free"]["model"].startswith("embedded model's copying variant")
    assert all(run["device"] == "cpu" and run["commit"] for run in result["runs"].values())
    many = result["many_streams"]
    assert many["streams"] == 4 and many["off"]["tokens_per_s"] > 0 and len(many["off"]["runs"]) == many["rounds"] == 2
    assert many["ngram_disable_at_2"]["drafts"] == 0 and many["ngram_disable_at_None"]["vs_off"] > 0
    assert [r["context"] for r in result["ngram_host_cost"]] == [500, 2000]
    assert all(r["index_us_per_step"] > 0 and r["scan_us_per_step"] > 0 for r in result["ngram_host_cost"])
    draft = result["draft_model"]
    assert draft["plain"]["tokens_per_s"] > 0 and draft["draft_layers"] == 2 and draft["target_layers"] == 6
    same, fewer = draft["same_checkpoint"], draft["fewer_layers"]
    assert same["acceptance"] > 0.9 and same["drafts"] and same["identical_to_plain"]
    assert fewer["drafts"] and fewer["identical_to_plain"] and fewer["tokens_per_s"] > 0
    # The back-off's model, with this run's step costs (section 2's batch-1 row)
    policy = result["backoff_policy"]
    assert policy["step_ms"]["plain"] == 1e3 / forced["plain_tokens_per_s"]
    rows = {r["workload"]: r for r in policy["rows"]}
    assert len(rows) == 10 and {"stops copying", "starts copying"} <= set(rows)
    assert rows["acceptance 1.0"]["shipped"] == rows["acceptance 1.0"]["no_backoff"] > 0  # never backs off
