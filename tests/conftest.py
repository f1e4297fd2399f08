"""Shared fixtures: tiny randomly initialised models of real architectures, saved with
``save_pretrained`` and loaded back through the real ``from_pretrained`` path, plus the embedded
default for end-to-end checks."""

from __future__ import annotations

import socket
import string
from pathlib import Path

import pytest
import torch

VOCAB = ["<eos>", "<unk>", " "] + list(string.ascii_lowercase) + list(".,!?'-0123456789")


def pytest_addoption(parser) -> None:
    parser.addoption("--require-cuda", action="store_true",
                     help="fail at once when torch sees no CUDA device, instead of skipping the cuda tests (make test-gpu)")


def pytest_configure(config) -> None:
    if config.getoption("--require-cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"no CUDA device: torch {torch.__version__} sees no GPU here, so the cuda tests would "
                                "only be skipped. Run make test-gpu on a machine with an NVIDIA GPU and a CUDA build of torch.")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return str(folder)


def make_gpt2(folder: Path, seed: int, positions: int = 96) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=positions, n_embd=32, n_layer=2, n_head=2,
                        eos_token_id=0, bos_token_id=0)
    return _save(GPT2LMHeadModel(config), folder)


def make_llama(folder: Path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                         eos_token_id=0, bos_token_id=0)
    return _save(LlamaForCausalLM(config), folder)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Paths of tiny checkpoints: {arch}-target and {arch}-draft (same architecture, other seed)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "gpt2-target": make_gpt2(root / "gpt2-target", 0),
        "gpt2-draft": make_gpt2(root / "gpt2-draft", 1),
        "llama-target": make_llama(root / "llama-target", 0),
        "llama-draft": make_llama(root / "llama-draft", 1),
    }


@pytest.fixture(scope="module")
def tiny_target_server(tiny_models):
    """(port, model path): a target service on the tiny GPT-2, a real gRPC server in this process."""
    from specdec.models import load_hf
    from specdec.sessions import SessionStore
    from target_service.engine import TargetEngine
    from target_service.servicer import build_server

    engine = TargetEngine(load_hf(tiny_models["gpt2-target"]), SessionStore(8, 1 << 30, 0), max_draft_tokens=8)
    server, port, _ = build_server(engine, "127.0.0.1:0")
    server.start()
    yield port, tiny_models["gpt2-target"]
    server.stop(0)


@pytest.fixture(scope="session")
def embedded_target():
    """The embedded default target (SmolLM2-135M-Instruct, fp32), loaded once."""
    from specdec.models import load_hf

    return load_hf("embedded")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_reference(model, tokens: list[int], n: int) -> list[int]:
    """Plain greedy decoding without any cache: n tokens after ``tokens`` (independent reference)."""
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(tokens):]


def step_json(draft: list[int], accepted: int, next_token: int, kind: str = "", **fields) -> dict:
    """A `step` event's data as the orchestrator sends it: built through the API's own
    ``orchestrator.schemas.Step`` and dumped to JSON, so a field renamed in the schema breaks the
    tests of every reader (dashboard, benchmarks) that relies on the old name."""
    import json

    from orchestrator.schemas import Step

    kind = kind or ("plain" if not draft else "bonus" if accepted == len(draft) else "correction")
    defaults = {"index": 0, "k": len(draft), "draft_confidences": [0.9] * len(draft),
                "target_probs": [0.8] * len(draft), "next_token_prob": 0.6,
                "tokens": draft[:accepted] + [next_token], "text": "", "draft_ms": 1.0, "verify_ms": 2.0,
                "draft_compute_ms": 0.5, "verify_compute_ms": 1.5, "overhead_ms": 0.1}
    step = Step(**{**defaults, **fields, "draft": draft, "accepted": accepted, "next_token": next_token,
                   "next_kind": kind})
    return json.loads(step.model_dump_json())


# ---- real processes on real ports --------------------------------------------------------------

import contextlib  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from evaluation.procs import answered  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Under pytest-xdist (`make test` runs two workers) every worker starts services of its own on the
# same cores: each computes on one thread, or OpenMP's barriers among more threads than free cores
# would stall a Propose past its deadline and turn speculation off by timing. Their defaults (every
# core) are what the benchmarks and the single-process runs measure.
WORKER_ENV = ({"SPECDEC_TARGET_THREADS": "1", "SPECDEC_DRAFT_THREADS": "1"}
              if os.environ.get("PYTEST_XDIST_WORKER") else {})


class Proc:
    """A service started as ``python -m <module>`` with its log in a file. Every one still running
    when the session ends is killed then (see pytest_sessionfinish), whatever failed on the way."""

    started: list[Proc] = []

    def __init__(self, name: str, module: str, env: dict[str, str], log_dir: Path, args: list[str] = ()) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT,
            env={**os.environ, **WORKER_ENV, "PYTHONUNBUFFERED": "1", **env},
            stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )
        Proc.started.append(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def wait_grpc(port: int, proc: Proc, timeout_s: float = 180) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"{proc.name} not serving on {port}:\n{proc.tail()}")


def wait_http(url: str, proc: Proc, timeout_s: float = 120, status: int = 200) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if answered(httpx.get(url, timeout=2), url, status):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer {status}:\n{proc.tail()}")


def start_model_service(kind: str, log_dir: Path, env: dict[str, str] | None = None) -> tuple[Proc, int]:
    """Start ``draft_service`` or ``target_service`` on a free port (metrics off)."""
    port = free_port()
    prefix = "SPECDEC_DRAFT_" if kind == "draft" else "SPECDEC_TARGET_"
    proc = Proc(kind, f"{kind}_service", {prefix + "PORT": str(port), prefix + "HOST": "127.0.0.1",
                                          prefix + "METRICS_PORT": str(free_port()), **(env or {})}, log_dir)
    try:
        wait_grpc(port, proc)
    except BaseException:
        proc.kill()  # it never reached the caller, who could not stop it
        raise
    return proc, port


def start_orchestrator(draft_port: int, target_port: int, log_dir: Path, env: dict[str, str] | None = None,
                       wait_ready: bool = True) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc("orchestrator", "orchestrator", {
        "SPECDEC_ORCHESTRATOR_PORT": str(port), "SPECDEC_ORCHESTRATOR_HOST": "127.0.0.1",
        "SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS": f"127.0.0.1:{draft_port}",
        "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": f"127.0.0.1:{target_port}",
        "SPECDEC_ORCHESTRATOR_DRAFT_RETRY_S": "1", **(env or {}),
    }, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + ("/ready" if wait_ready else "/health"), proc)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def pytest_sessionfinish(session, exitstatus) -> None:
    for proc in Proc.started:
        proc.kill()


@contextlib.contextmanager
def running_stack(log_dir: Path, orchestrator_env: dict[str, str] | None = None):
    """draft (llama.cpp) + target + orchestrator on the embedded default, as real processes;
    stopped (newest first) on exit."""
    procs: list[Proc] = []
    try:
        draft, draft_port = start_model_service("draft", log_dir)
        procs.append(draft)
        target, target_port = start_model_service("target", log_dir)
        procs.append(target)
        orch, url = start_orchestrator(draft_port, target_port, log_dir, orchestrator_env)
        procs.append(orch)
        yield {"url": url, "draft": draft, "target": target, "orchestrator": orch,
               "draft_port": draft_port, "target_port": target_port, "log_dir": log_dir,
               "ports": {"draft": draft_port, "target": target_port}}
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="session")
def embedded_stack(tmp_path_factory):
    """The embedded stack shared by the end-to-end tests."""
    with running_stack(tmp_path_factory.mktemp("stack-logs")) as stack:
        yield stack
