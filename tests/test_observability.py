"""End-to-end proof of the observability stack, without Docker: the service started with the command and
environment of docker/docker-compose.yml (on CPU, on a loopback port), a real Prometheus running
docker/prometheus/prometheus.yml (retargeted there, scraping every second), a short headless locust run of
loadtest/locustfile.py, then every PromQL expression of every panel of the provisioned Grafana dashboard
evaluated through Prometheus's HTTP API: each must succeed and return data. The same for vLLM's own example
dashboard (tests/data/vllm_grafana, unmodified): a dashboard written for vLLM shows this service's data, and every
model-server series under vLLM's names (tests/test_vllm_metrics.py) reaches Prometheus.

Needs the `prometheus` binary (Debian package `prometheus`); without it the test is skipped, except in CI
(CI=true), where it fails.
"""
import csv
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml
from test_vllm_metrics import SERIES

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))
VLLM_DASHBOARD = ROOT / "tests" / "data" / "vllm_grafana" / "grafana.json"
# Concrete values for Grafana's built-in variables; 1m spans the whole load run at a 1 s scrape interval.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "5m"}
LOAD_USERS, LOAD_SECONDS = 4, 20
SERVICE_START_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until_ok(url: str, proc: subprocess.Popen, log: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited with {proc.returncode} before {url} answered:\n{tail(log)}")
        try:
            if http_get(url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} not ready after {timeout:.0f} s:\n{tail(log)}")


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def start(argv: list[str], log: Path, stack: ExitStack, **kwargs) -> subprocess.Popen:
    """Starts argv in its own process group, killed (group and all) when the stack closes."""
    out = stack.enter_context(open(log, "wb"))
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
    stack.callback(stop, proc)
    return proc


def stop(proc: subprocess.Popen):
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def compose_service(port: int, tmp: Path) -> tuple[list[str], dict[str, str], int]:
    """The compose service's command and environment for a local run: loopback host, the given port,
    LLM_DEVICE=cpu, container paths moved under tmp. Also returns the container port it listens on."""
    service = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())["services"]["service"]
    argv = list(service["command"])
    assert argv[0] == "python", argv
    argv[0] = sys.executable
    container_port = int(argv[argv.index("--port") + 1])
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)

    # The container has no LLM_* beyond compose's, nor the TRITON_INTERPRET that conftest sets without CUDA.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_") and k != "TRITON_INTERPRET"}
    for key, value in service["environment"].items():
        if value is None:                       # passed through from the calling shell, as compose does
            if key in os.environ:
                env[key] = os.environ[key]
        elif str(value).startswith("/"):        # a container volume: a fresh local directory instead
            env[key] = str(tmp / str(value).lstrip("/"))
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        else:
            env[key] = str(value)
    env["LLM_DEVICE"] = "cpu"
    return argv, env, container_port


def prometheus_config(container_port: int, service_port: int) -> dict:
    """docker/prometheus/prometheus.yml with only the service's job, retargeted to loopback, scraping every 1 s."""
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    target = f"service:{container_port}"
    jobs = [job for job in config["scrape_configs"]
            if any(target in group["targets"] for group in job.get("static_configs", []))]
    assert len(jobs) == 1, f"exactly one scrape job must target {target}"
    job = jobs[0]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{service_port}"]}]
    job.pop("scrape_interval", None)
    job.pop("scrape_timeout", None)
    config["scrape_configs"] = [job]
    config["global"] = {**config.get("global", {}), "scrape_interval": "1s", "scrape_timeout": "1s",
                        "evaluation_interval": "1s"}
    return config


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "the prometheus binary is missing (apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def promql(base: str, expr: str) -> dict:
    status, body = http_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
    answer = json.loads(body)
    if status != 200 or answer.get("status") != "success":
        return {"error": f"HTTP {status}: {answer.get('errorType')}: {answer.get('error')}"}
    return answer["data"]


def dashboard_queries(paths=DASHBOARDS, variables=GRAFANA_VARIABLES) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana variables substituted) for every target of every panel."""
    queries = []

    def visit(panels):
        for panel in panels:
            visit(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in variables.items():
                    expr = expr.replace(name, value)
                queries.append((panel["title"], expr))

    for path in paths:
        visit(json.loads(path.read_text())["panels"])
    return queries


def failing(base: str, queries: list[tuple[str, str]]) -> list[str]:
    """The queries that fail or return no data, each with why."""
    problems = []
    for title, expr in queries:
        assert "$" not in expr, f"{title}: unsubstituted Grafana variable in {expr}"
        data = promql(base, expr)
        if "error" in data:
            problems.append(f"{title}: {expr}\n    {data['error']}")
        elif not data["result"]:
            problems.append(f"{title}: {expr}\n    no data")
    return problems


def test_observe_many_adds_what_observe_would():
    """service.metrics.observe_many reaches into prometheus_client's Histogram: it must stay equal to a loop of
    observe() (bucket edges included) with the prometheus_client installed."""
    from prometheus_client import CollectorRegistry, Histogram

    from service.metrics import LATENCY_BUCKETS, observe_many

    values = [0.0, 0.001, 0.0011, 0.02, 0.0199, 5.0, 7.4, 200.0, 0.5, 0.5] + [i / 997 for i in range(300)]
    registry = CollectorRegistry()
    one = Histogram("one", "", buckets=LATENCY_BUCKETS, registry=registry)
    many = Histogram("many", "", buckets=LATENCY_BUCKETS, registry=registry)
    for v in values:
        one.observe(v)
    observe_many(many, values[:7])
    observe_many(many, [])
    observe_many(many, values[7:])
    samples = {m.name: {(s.name.split("_", 1)[1], s.labels.get("le")): s.value for s in m.samples
                        if "created" not in s.name} for m in registry.collect()}
    total = samples["one"].pop(("sum", None))
    assert samples["many"].pop(("sum", None)) == pytest.approx(total) and samples["many"] == samples["one"]


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Runs the whole stack and the load; yields (Prometheus URL, locust stats rows, locust output)."""
    prometheus = prometheus_binary()
    tmp = tmp_path_factory.mktemp("observability")
    service_port, prometheus_port = free_port(), free_port()
    with ExitStack() as stack:
        argv, env, container_port = compose_service(service_port, tmp)
        service = start(argv, tmp / "service.log", stack, env=env, cwd=ROOT)

        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(container_port, service_port)))
        prom = start([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                      f"--web.listen-address=127.0.0.1:{prometheus_port}"], tmp / "prometheus.log", stack)
        base = f"http://127.0.0.1:{prometheus_port}"
        wait_until_ok(f"{base}/-/ready", prom, tmp / "prometheus.log", 30)
        wait_until_ok(f"http://127.0.0.1:{service_port}/health", service, tmp / "service.log", SERVICE_START_TIMEOUT)

        locust = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
             "-u", str(LOAD_USERS), "-r", str(LOAD_USERS), "-t", f"{LOAD_SECONDS}s", "--stop-timeout", "30",
             "--host", f"http://127.0.0.1:{service_port}", "--csv", str(tmp / "locust"), "--only-summary"],
            env={**os.environ, "LOADTEST_MAX_NEW_TOKENS": "8", "LOADTEST_MAX_PROMPT_WORDS": "48"},
            capture_output=True, text=True, timeout=LOAD_SECONDS + 60, cwd=ROOT,
        )
        stats, output = locust_stats(locust, tmp / "locust")
        if service.poll() is not None:
            pytest.fail(f"the service died during the load:\n{tail(tmp / 'service.log')}")

        # Wait until Prometheus has scraped the counters of every request locust saw succeed.
        served = sum(int(row["Request Count"]) - int(row["Failure Count"]) for row in stats
                     if row["Type"] == "POST")
        deadline = time.monotonic() + 20
        seen = -1.0
        while time.monotonic() < deadline:
            result = promql(base, 'sum(llm_requests_total{outcome="success"})').get("result", [])
            seen = float(result[0]["value"][1]) if result else -1.0
            if seen >= served:
                break
            time.sleep(0.5)
        assert seen >= served, (f"Prometheus saw {seen} successful requests, locust {served}:\n"
                                f"{tail(tmp / 'prometheus.log')}")
        yield base, stats, output


def locust_stats(run: subprocess.CompletedProcess, prefix: Path) -> tuple[list[dict], str]:
    """The statistics rows locust wrote with --csv PREFIX, and the end of its output; fails naming its exit and that
    output where it wrote none (it did not run)."""
    output = run.stdout[-4000:] + run.stderr[-4000:]
    stats = Path(f"{prefix}_stats.csv")
    assert stats.exists(), f"locust wrote no stats (exit {run.returncode}):\n{output}"
    with open(stats) as f:
        return list(csv.DictReader(f)), output


def test_the_shipped_load_test_passes_against_the_embedded_model(tmp_path):
    """The README's locust command, unchanged (no LOADTEST_* caps), against the embedded model's 2048-token
    context: every request fits and none fails."""
    from server import serve

    if importlib.util.find_spec("locust") is None:  # (CI installs it: the test extra; importing it patches gevent in)
        pytest.skip("locust is not installed")
    with serve() as url:
        run = subprocess.run([sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
                              "--headless", "-u", "8", "-r", "4", "-t", "30s", "--host", url,
                              "--csv", str(tmp_path / "locust"), "--only-summary"],
                             env={k: v for k, v in os.environ.items() if not k.startswith("LOADTEST_")},
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        rows, output = locust_stats(run, tmp_path / "locust")
    assert run.returncode == 0, output
    assert sum(int(r["Failure Count"]) for r in rows) == 0, output
    assert sum(int(r["Request Count"]) for r in rows if r["Type"] == "POST") > 0


def test_load_test_has_no_failures(observed):
    _, stats, output = observed
    by_type_name = {(row["Type"], row["Name"]): row for row in stats}
    for key in [("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/v1/chat/completions"),
                ("TTFT", "/generate_stream"), ("TTFT", "/v1/chat/completions"),
                ("ITL", "/generate_stream"), ("ITL", "/v1/chat/completions")]:
        row = by_type_name.get(key)
        assert row and int(row["Request Count"]) > 0, f"no {key} in locust stats:\n{output}"
    failed = {f"{row['Type']} {row['Name']}": row["Failure Count"] for row in stats if int(row["Failure Count"])}
    assert not failed, f"locust failures {failed}:\n{output}"


def test_every_dashboard_query_returns_data(observed):
    queries = dashboard_queries()
    assert queries, "no dashboard queries found"
    problems = failing(observed[0], queries)
    assert not problems, "dashboard queries that fail:\n" + "\n".join(problems)


def test_vllms_dashboard_shows_the_service_in_every_panel(observed):
    """vLLM's example dashboard, unmodified: its $model_name variable (label_values(model_name)) offers the served
    model, and with it every panel (requests, latencies, tokens, cache, queues, finish reasons) has data."""
    base = observed[0]
    status, body = http_get(f"{base}/api/v1/label/model_name/values")
    assert status == 200, body
    (model,) = json.loads(body)["data"]
    queries = dashboard_queries([VLLM_DASHBOARD], {**GRAFANA_VARIABLES, "$model_name": model})
    assert len({title for title, _ in queries}) == 12, queries
    problems = failing(base, queries)
    assert not problems, "vLLM dashboard queries that fail:\n" + "\n".join(problems)


@pytest.mark.parametrize("name", sorted(SERIES))
def test_every_vllm_series_reaches_prometheus(observed, name):
    """Each model-server series under vLLM's name, with its labels (those with values: Prometheus drops empty ones,
    such as the adapters of an idle server's vllm:lora_requests_info)."""
    kind, labels = SERIES[name]
    sample = name + {"counter": "_total", "histogram": "_bucket"}.get(kind, "")
    result = promql(observed[0], f"count by ({', '.join(sorted(labels))}) ({sample})")["result"]
    assert result, f"Prometheus has no {sample}"
    for series in result:
        present = {k for k, v in series["metric"].items() if v}
        assert present <= labels and present >= labels - {"running_lora_adapters", "waiting_lora_adapters"}, series


@pytest.mark.parametrize("expr", [
    *(f"histogram_quantile(0.5, sum by (le) (rate({m}_bucket[1m])))" for m in
      ("llm_time_to_first_token_seconds", "llm_inter_token_latency_seconds", "llm_e2e_request_latency_seconds")),
    *(f"histogram_quantile(0.5, sum by (le) (rate({m}_bucket[1m])))" for m in
      ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")),
    "sum(rate(llm_generation_tokens_total[1m]))",
    "sum(rate(vllm:generation_tokens_total[1m]))",
    "sum(rate(vllm:prompt_tokens_total[1m]))",
    'sum(rate(vllm:request_success_total{finished_reason=~"stop|length"}[1m]))',
    # every locust prompt starts with the same instructions
    "sum(rate(llm_prefix_cache_hit_tokens_total[1m])) / sum(rate(llm_prefix_cache_queried_tokens_total[1m]))",
    "sum(rate(vllm:prefix_cache_hits_total[1m])) / sum(rate(vllm:prefix_cache_queries_total[1m]))",
])
def test_load_shows_in_the_panels(observed, expr):
    """The load reaches the series behind the panels: real positive numbers, not just NaN or 0."""
    result = promql(observed[0], expr)["result"]
    assert result, f"no data for {expr}"
    value = float(result[0]["value"][1])
    assert math.isfinite(value) and value > 0, f"{expr} = {value}"
