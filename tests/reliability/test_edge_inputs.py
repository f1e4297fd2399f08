"""Hand-picked hostile inputs to the HTTP API, each a case generated fuzzing tends to miss or that
once broke a server: every one must get a client error (or a normal answer), never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support import start_model_service, start_orchestrator

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

CLIENT_ERROR = {400, 413, 422}
OK_OR_REFUSED = {200, 400, 422}

# (id, path, raw JSON body, allowed statuses)
CASES = [
    ("lone-surrogate-prompt", "/v1/generate", '{"prompt": "hi \\ud800 there", "max_tokens": 4}', CLIENT_ERROR),
    ("lone-surrogate-chat", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', CLIENT_ERROR),
    ("lone-surrogate-stop", "/v1/generate", '{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 4}', OK_OR_REFUSED),
    ("nul-in-prompt", "/v1/generate", '{"prompt": "a\\u0000b", "max_tokens": 4}', OK_OR_REFUSED),
    ("temperature-1e-40", "/v1/generate", '{"prompt": "Hello", "max_tokens": 4, "temperature": 1e-40}', OK_OR_REFUSED),
    ("temperature-subnormal", "/v1/completions", '{"prompt": "Hello", "max_tokens": 4, "temperature": 5e-324}',
     OK_OR_REFUSED),
    ("top-k-2^33", "/v1/generate", '{"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, "top_k": 8589934592}',
     OK_OR_REFUSED),
    ("top-k-2^64", "/v1/generate", '{"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, "top_k": 18446744073709551616}',
     OK_OR_REFUSED),
    ("top-p-tiny", "/v1/generate", '{"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, "top_p": 1e-300}',
     OK_OR_REFUSED),
    ("seed-max", "/v1/generate", '{"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, "seed": 9223372036854775807}',
     OK_OR_REFUSED),
    ("nan-temperature", "/v1/generate", '{"prompt": "Hello", "temperature": NaN}', CLIENT_ERROR),
    ("infinite-top-p", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     CLIENT_ERROR),
    ("max-tokens-10^30", "/v1/generate", '{"prompt": "Hello", "max_tokens": 1000000000000000000000000000000}',
     CLIENT_ERROR),
    ("k-negative", "/v1/generate", '{"prompt": "Hello", "k": -1}', CLIENT_ERROR),
    ("not-json", "/v1/generate", '{"prompt": ', CLIENT_ERROR),
    ("json-array", "/v1/completions", '[1, 2, 3]', CLIENT_ERROR),
    ("deeply-nested", "/v1/generate", '{"prompt": "x", "stop": ' + "[" * 20000 + "]" * 20000 + "}", CLIENT_ERROR),
    ("empty-messages", "/v1/chat/completions", '{"messages": []}', CLIENT_ERROR),
    ("unknown-role", "/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', CLIENT_ERROR),
    ("content-parts", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}], "max_tokens": 4}',
     OK_OR_REFUSED),
    ("two-prompts", "/v1/completions", '{"prompt": ["a", "b"], "max_tokens": 4}', CLIENT_ERROR),
    ("n-0", "/v1/completions", '{"prompt": "a", "n": 0}', CLIENT_ERROR),
    ("n-huge", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "n": 100000}', CLIENT_ERROR),
]


@pytest.mark.parametrize("name, path, body, allowed", CASES, ids=[c[0] for c in CASES])
def test_hostile_json_gets_a_client_error(embedded_stack, name, path, body, allowed):
    r = httpx.post(embedded_stack["url"] + path, content=body.encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code in allowed, f"{name}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        body = r.json()
        # the OpenAI routes answer in OpenAI's error shape, the native ones FastAPI's
        reason = body["error"]["message"] if path.startswith(("/v1/completions", "/v1/chat")) else body["detail"]
        assert reason, r.text


def test_invalid_utf8_body(embedded_stack):
    r = httpx.post(embedded_stack["url"] + "/v1/generate", content=b'{"prompt": "\xff\xfe\xc3"}', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code in CLIENT_ERROR, r.text


def test_chunked_body_over_the_limit_is_413(embedded_stack):
    """A body without Content-Length (chunked) over the 1 MiB limit: 413 like a declared one."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(embedded_stack["url"] + "/v1/generate", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, f"{r.status_code} {r.text[:300]}"
    assert "body" in r.json()["detail"]
    r = httpx.post(embedded_stack["url"] + "/v1/generate", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_wrong_content_type_and_method(embedded_stack):
    url = embedded_stack["url"]
    r = httpx.post(url + "/v1/generate", content=b"prompt=hello", timeout=30,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code in CLIENT_ERROR, r.text
    assert httpx.get(url + "/v1/generate", timeout=30).status_code == 405
    assert httpx.delete(url + "/v1/models", timeout=30).status_code == 405
    assert httpx.get(url + "/nope", timeout=30).status_code == 404


def test_prompt_over_the_kv_budget_is_a_client_error(tmp_path, embedded_stack):
    """A target whose whole KV budget is smaller than one prompt: that request can never fit, so
    it is the client's to change (4xx naming the budget or the context it allows), not a service
    failure (5xx)."""
    target, target_port = start_model_service("target", tmp_path, {"SPECDEC_TARGET_KV_BUDGET_MB": "4"})
    orch, url = start_orchestrator(embedded_stack["draft_port"], target_port, tmp_path)
    try:
        prompt = "The quick brown fox jumps over the lazy dog. " * 40  # ~400 tokens, ~18 MB of fp32 KV
        r = httpx.post(url + "/v1/generate", json={"prompt": prompt, "max_tokens": 4}, timeout=120)
        assert 400 <= r.status_code < 500, f"{r.status_code} {r.text[:300]}"
        detail = json.dumps(r.json()["detail"])
        assert any(word in detail for word in ("budget", "KV", "context")), r.text
        r = httpx.post(url + "/v1/generate", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        orch.stop()
        target.stop()
