"""Readiness of the orchestrator against a real target service (gRPC, in this process) while the
draft is unreachable: ready but degraded, and requests decode without drafts, unchanged."""

from __future__ import annotations

from fastapi.testclient import TestClient

from orchestrator.app import create_app
from orchestrator.settings import OrchestratorSettings
from tests.conftest import free_port


def test_a_draft_outage_leaves_the_orchestrator_ready_but_degraded(tiny_target_server):
    port, path = tiny_target_server
    dead = f"127.0.0.1:{free_port()}"
    settings = OrchestratorSettings(target_address=f"127.0.0.1:{port}", draft_address=dead, tokenizer=path)
    with TestClient(create_app(settings)) as client:
        r = client.get("/ready")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ready"] is True and body["reason"] == ""
        assert body["degraded"].startswith(f"draft service at {dead} unreachable") and "without drafts" in body["degraded"]
        assert client.get("/v1/info").json()["degraded"] == body["degraded"]
        spec = client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 6, "ignore_eos": True})
        plain = client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 6, "ignore_eos": True,
                                                   "mode": "autoregressive"})
        assert spec.status_code == plain.status_code == 200, spec.text
        assert spec.json()["token_ids"] == plain.json()["token_ids"] and len(plain.json()["token_ids"]) == 6


def test_a_target_outage_is_not_ready(tiny_target_server):
    _, path = tiny_target_server
    settings = OrchestratorSettings(target_address=f"127.0.0.1:{free_port()}", draft_address=f"127.0.0.1:{free_port()}",
                                    tokenizer=path)
    with TestClient(create_app(settings)) as client:
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["reason"].startswith("target service at")
