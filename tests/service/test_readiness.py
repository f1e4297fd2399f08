"""Readiness of the orchestrator against a real target service (gRPC, in this process) while the
draft is unreachable: ready but degraded, and requests decode without drafts, unchanged."""

from __future__ import annotations

from functools import partial

from fastapi.testclient import TestClient

from orchestrator.app import create_app
from orchestrator.settings import OrchestratorSettings
from tests.support import free_port, wait_until


def test_a_draft_outage_leaves_the_orchestrator_ready_but_degraded(tiny_target_server):
    port, path = tiny_target_server
    dead = f"127.0.0.1:{free_port()}"
    settings = OrchestratorSettings(target_address=f"127.0.0.1:{port}", draft_address=dead, tokenizer=path)
    with TestClient(create_app(settings), base_url="http://localhost") as client:
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
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["reason"].startswith("target service at")


def test_a_draft_that_comes_back_is_connected_again_within_seconds(tiny_target_server):
    """While degraded the orchestrator looks for the draft every 2 s (not every 15 s, as when all is
    well), so requests speculate again soon after the draft returns; /v1/info does not reconnect by
    itself, so it shows the background loop's work."""
    from draft_service.backends.ngram import NgramProposer
    from draft_service.servicer import build_server as build_draft
    from specdec.engine.sessions import SessionStore

    port, path = tiny_target_server
    draft_port = free_port()
    settings = OrchestratorSettings(target_address=f"127.0.0.1:{port}", draft_address=f"127.0.0.1:{draft_port}",
                                    tokenizer=path)
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        assert client.get("/ready").json()["degraded"]
        proposer = NgramProposer(SessionStore(4, 1 << 20, 0), 8, max_ngram=3, min_ngram=1, vocab_size=10, max_context=1000)
        server, _, _ = build_draft(proposer, f"127.0.0.1:{draft_port}")
        server.start()
        try:
            wait_until(lambda: client.get("/v1/info").json()["degraded"] == "", 6,
                       "the draft looked for again and found", 0.05)
        finally:
            server.stop(0)


def _new_target_seen(client: TestClient, pinned: bool, before: str, seen: list):
    """/ready once it has asked the swapped target (at most every READY_RECHECK_S), else None."""
    seen.append(r := client.get("/ready"))
    if pinned:
        return r if "does not match the target's" in r.json()["reason"] else None
    return r if r.json()["target"].get("tokenizer_fingerprint", before) != before else None


def test_a_target_swapped_for_another_tokenizer_is_noticed(tiny_models, tmp_path):
    """A rollout replaces the target with a model of another tokenizer at the same address: the next
    check compares the orchestrator's tokenizer with the target's again, and with the old one
    pinned (SPECDEC_ORCHESTRATOR_TOKENIZER) refuses to serve rather than decode with the wrong
    vocabulary; without a pin it loads the new model's tokenizer and serves it."""
    import shutil

    from orchestrator.runtime import READY_RECHECK_S
    from specdec.engine.sessions import SessionStore
    from specdec.models import load_hf, load_tokenizer
    from target_service.servicer import build_server
    from target_service.verify import TargetEngine

    other = tmp_path / "other"
    shutil.copytree(tiny_models["gpt2-target"], other)
    tok = load_tokenizer(str(other))
    tok.add_tokens(["<extra>"])  # one more token: another vocabulary, another fingerprint
    tok.save_pretrained(other)
    port = free_port()

    def serve(path: str):
        engine = TargetEngine(load_hf(path), SessionStore(8, 1 << 30, 0), max_draft_tokens=8)
        server, _, _ = build_server(engine, f"127.0.0.1:{port}")
        server.start()
        return server

    for pinned in (True, False):
        server = serve(tiny_models["gpt2-target"])
        settings = OrchestratorSettings(target_address=f"127.0.0.1:{port}", draft_address=f"127.0.0.1:{free_port()}",
                                        tokenizer=tiny_models["gpt2-target"] if pinned else None)
        try:
            with TestClient(create_app(settings), base_url="http://localhost") as client:
                r = client.get("/ready")
                assert r.status_code == 200
                before = r.json()["target"]["tokenizer_fingerprint"]
                server.stop(0).wait()
                server = serve(str(other))
                seen: list = []
                r = wait_until(partial(_new_target_seen, client, pinned, before, seen), READY_RECHECK_S + 5,
                               lambda seen=seen: f"/ready never saw the new target: {seen[-1].text}", 0.05)
                if pinned:
                    assert r.status_code == 503
                    assert client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 2}).status_code == 503
                else:
                    assert r.status_code == 200, r.text
                    assert len(r.json()["target"]["tokenizer_fingerprint"]) == len(before) == 64
                    assert client.app.state.rt.tokenizer.convert_tokens_to_ids("<extra>") == len(tok) - 1
        finally:
            server.stop(0)
