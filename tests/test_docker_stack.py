"""Structural checks of the docker compose stack, Prometheus config and Grafana provisioning (no Docker needed)."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))


def dockerfile_instruction(name: str) -> str:
    """The text of the Dockerfile's (last) instruction `name`, continuation lines joined."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip().upper().startswith(name + " ")]
    assert lines, f"Dockerfile has no {name}"
    return lines[-1][len(name):].strip()


def load_yaml(pattern: str) -> dict:
    """The one YAML file under docker/ matching pattern."""
    (path,) = DOCKER.glob(pattern)
    return yaml.safe_load(path.read_text())


def service_port(service: dict) -> int:
    command = service["command"]
    return int(command[command.index("--port") + 1])


def mounts(service: dict) -> dict[str, str]:
    """container path -> host source (relative to docker/) of a service's volumes."""
    return {spec.split(":")[1]: spec.split(":")[0] for spec in service.get("volumes", [])}


def all_panels(panels):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def test_build_context_and_referenced_files_exist():
    build = SERVICES["service"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert (DOCKER / build["context"] / "pyproject.toml").exists()
    for name, service in SERVICES.items():
        for container_path, source in mounts(service).items():
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: mounted {source} is missing"
            else:
                assert source in COMPOSE["volumes"], f"{name}: named volume {source} is not declared"
    assert list((DOCKER / "grafana/provisioning/datasources").glob("*.yml"))
    assert list((DOCKER / "grafana/provisioning/dashboards").glob("*.yml"))
    assert DASHBOARDS


def test_dockerfile_runs_the_compose_command_as_non_root_with_healthcheck():
    assert json.loads(dockerfile_instruction("CMD")) == SERVICES["service"]["command"]
    assert dockerfile_instruction("USER") not in ("root", "0")
    assert "/health" in dockerfile_instruction("HEALTHCHECK")
    text = (DOCKER / "Dockerfile").read_text()
    assert "HF_HOME=/models" in text and "/models" in dockerfile_instruction("VOLUME")
    build_inputs = re.findall(r"^(?:ARG|ENV)\s+(.*)$", text, flags=re.M)
    assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", " ".join(build_inputs)), "no secrets in the build"


def test_gpu_service_reserves_a_gpu_and_cpu_variant_does_not():
    devices = SERVICES["service"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    cpu = SERVICES["service-cpu"]
    assert "deploy" not in cpu and cpu["profiles"] == ["cpu"]
    assert cpu["environment"]["LLM_DEVICE"] == "cpu"
    assert "service" in cpu["networks"]["default"]["aliases"], "Prometheus and locust reach it as `service`"
    assert cpu["command"] == SERVICES["service"]["command"]
    gpu_env = {k: v for k, v in SERVICES["service"]["environment"].items() if k != "LLM_DEVICE"}
    assert {k: v for k, v in cpu["environment"].items() if k != "LLM_DEVICE"} == gpu_env


def test_service_default_model_volumes_and_ports():
    service = SERVICES["service"]
    env = service["environment"]
    assert env["LLM_MODEL"] is None, "LLM_MODEL only passes through: unset means the embedded default model"
    volumes = mounts(service)
    assert volumes[env["HF_HOME"]] == "models"
    assert volumes[env["LLM_FINETUNE_DIR"]] == "finetune"
    port = service_port(service)
    assert f"{port}:{port}" in service["ports"]
    assert f":{port}/health" in " ".join(service["healthcheck"]["test"])


def test_every_long_running_service_has_a_healthcheck():
    for name, service in SERVICES.items():
        if name != "loadtest":
            assert service["healthcheck"]["test"][0] == "CMD", name


def test_prometheus_scrapes_the_service():
    prometheus = SERVICES["prometheus"]
    config_path = [source for target, source in mounts(prometheus).items() if target.endswith("prometheus.yml")][0]
    config = yaml.safe_load((DOCKER / config_path).read_text())
    targets = [t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    assert f"service:{service_port(SERVICES['service'])}" in targets
    assert "9090:9090" in prometheus["ports"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_prometheus_config():
    result = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_matches_the_stack():
    grafana = SERVICES["grafana"]
    volumes = mounts(grafana)
    assert volumes["/etc/grafana/provisioning"] == "./grafana/provisioning"
    (datasource,) = load_yaml("grafana/provisioning/datasources/*.yml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = load_yaml("grafana/provisioning/dashboards/*.yml")["providers"]
    dashboards_dir = provider["options"]["path"]
    assert volumes[dashboards_dir] == "./grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_dir + "/") and (DOCKER / "grafana/dashboards" / Path(home).name).exists()
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_panels_use_the_provisioned_datasource_and_have_queries(path):
    uid = load_yaml("grafana/provisioning/datasources/*.yml")["datasources"][0]["uid"]
    dashboard = json.loads(path.read_text())
    panels = [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]
    assert panels
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
            assert target["expr"].strip() and re.search(r"\bllm_|\bvllm:|\bup\b", target["expr"]), panel["title"]


def test_dashboard_covers_every_exported_metric():
    """Each metric of the contract (notes: metrics.md) appears in some panel."""
    exprs = " ".join(t["expr"] for path in DASHBOARDS for p in all_panels(json.loads(path.read_text())["panels"])
                     for t in p.get("targets", []))
    for metric in ["llm_time_to_first_token_seconds", "llm_inter_token_latency_seconds",
                   "llm_e2e_request_latency_seconds", "llm_queue_time_seconds", "llm_engine_step_seconds",
                   "llm_request_prompt_tokens", "llm_request_generation_tokens", "llm_requests_total",
                   "llm_prompt_tokens_total", "llm_generation_tokens_total", "llm_preemptions_total",
                   "llm_prefix_cache_queried_tokens_total", "llm_prefix_cache_hit_tokens_total",
                   "llm_requests_running", "llm_requests_waiting", "llm_kv_cache_usage_ratio",
                   "llm_gpu_memory_allocated_bytes", "llm_gpu_memory_reserved_bytes", "llm_gpu_memory_total_bytes",
                   "llm_batch_size", "llm_finetune_jobs", "llm_finetune_tokens_per_second", "llm_finetune_loss",
                   "llm_engine_steps_total", "llm_engine_step_time_seconds_total"]:
        assert metric in exprs, metric


def test_loadtest_profile_runs_the_locustfile_against_the_service():
    loadtest = SERVICES["loadtest"]
    assert loadtest["profiles"] == ["loadtest"]
    assert mounts(loadtest)["/mnt/loadtest"] == "../loadtest" and (ROOT / "loadtest/locustfile.py").exists()
    args = " ".join(loadtest["command"])
    assert "/mnt/loadtest/locustfile.py" in args and "--headless" in args
    assert f"--host=http://service:{service_port(SERVICES['service'])}" in args
