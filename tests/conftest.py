"""Fixtures and pytest hooks for every folder under tests/ (unit, service, e2e, reliability,
containers): tiny randomly initialised models of real architectures, saved with ``save_pretrained``
and loaded back through the real ``from_pretrained`` path, the embedded default, and the embedded
stack as real processes. The helpers they use are in tests/support.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import Proc, make_gpt2, make_llama, running_stack


def pytest_addoption(parser) -> None:
    parser.addoption("--require-cuda", action="store_true",
                     help="fail at once when torch sees no CUDA device, instead of skipping the cuda tests (make test-gpu)")


def pytest_configure(config) -> None:
    if config.getoption("--require-cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"no CUDA device: torch {torch.__version__} sees no GPU here, so the cuda tests would "
                                "only be skipped. Run make test-gpu on a machine with an NVIDIA GPU and a CUDA build of torch.")


def pytest_collection_modifyitems(config, items) -> None:
    """A test on the embedded model is marked so, whether it says so or only asks for its fixtures
    (``make test-fast`` leaves them out)."""
    for item in items:
        if {"embedded_stack", "embedded_target"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.embedded)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Kill every service a test started that is still running, whatever failed on the way."""
    for proc in Proc.started:
        proc.kill()


@pytest.fixture
def native_linears(monkeypatch):
    """fp32 linears on specdec.native on any CPU (without AVX-512 the engine prefers oneDNN's)."""
    monkeypatch.setenv("SPECDEC_NATIVE_LINEARS", "on")


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


# the GGUF types a quantised target is tested on (llama.cpp's quantiser makes them from f32)
GGUF_TARGET_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k", "f16")


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """{arch}-{type}: tiny Llama and GPT-2 checkpoints (hidden 256: whole K-quant super-blocks)
    converted by llama.cpp's converter and quantised to every type of GGUF_TARGET_TYPES (GPT-2:
    q8_0 and q4_k_m)."""
    from specdec.model.gguf_convert import ensure_gguf
    from tests.support import make_bpe_model

    root, cache = tmp_path_factory.mktemp("gguf-targets"), tmp_path_factory.mktemp("gguf-target-cache")
    types = {"llama": GGUF_TARGET_TYPES, "gpt2": ("q8_0", "q4_k_m")}
    folders: dict[str, Path] = {}

    class Converted(dict):
        """Each file converted when a test first asks for it (a run converts only what it uses)."""

        def __missing__(self, key: str) -> Path:
            arch, quant = key.split("-", 1)
            if quant not in types.get(arch, ()):
                raise KeyError(key)
            if arch not in folders:
                folders[arch] = make_bpe_model(root / arch, arch, seed=3, hidden=256)
            self[key] = ensure_gguf(str(folders[arch]), quant, cache)
            return self[key]

    return Converted()


@pytest.fixture(scope="module")
def tiny_target_server(tiny_models):
    """(port, model path): a target service on the tiny GPT-2, a real gRPC server in this process."""
    from specdec.engine.sessions import SessionStore
    from specdec.models import load_hf
    from target_service.servicer import build_server
    from target_service.verify import TargetEngine

    engine = TargetEngine(load_hf(tiny_models["gpt2-target"]), SessionStore(8, 1 << 30, 0), max_draft_tokens=8)
    server, port, _ = build_server(engine, "127.0.0.1:0")
    server.start()
    yield port, tiny_models["gpt2-target"]
    server.stop(0)


@pytest.fixture(scope="module")
def fake_orchestrator():
    """A fake orchestrator (tests.support.FakeOrchestrator) shared by a module's UI tests; each
    test resets it with the snapshot it needs."""
    from tests.support import FakeOrchestrator

    with FakeOrchestrator() as fake:
        yield fake


@pytest.fixture(scope="module")
def bpe_engines(tmp_path_factory):
    """(target engine, draft proposer) in this process on two tiny random Llamas with the embedded
    model's BPE tokenizer (which grammars need: specdec.grammar)."""
    from draft_service.backends.hf import TransformersProposer
    from specdec.engine.sessions import SessionStore
    from specdec.models import load_hf
    from target_service.verify import TargetEngine
    from tests.support import make_bpe_model

    root = tmp_path_factory.mktemp("bpe-engines")
    target = TargetEngine(load_hf(str(make_bpe_model(root / "target", "llama", seed=5))), SessionStore(8, 1 << 30, 0),
                          max_draft_tokens=8)
    draft = TransformersProposer(load_hf(str(make_bpe_model(root / "draft", "llama", seed=6))),
                                 SessionStore(8, 1 << 30, 0), max_draft_tokens=8)
    return target, draft


@pytest.fixture(scope="session")
def embedded_target():
    """The embedded default target (SmolLM2-135M-Instruct, fp32), loaded once."""
    from specdec.models import load_hf

    return load_hf("embedded")


@pytest.fixture(scope="session")
def embedded_stack(tmp_path_factory):
    """The embedded stack shared by the end-to-end tests."""
    with running_stack(tmp_path_factory.mktemp("stack-logs")) as stack:
        yield stack
