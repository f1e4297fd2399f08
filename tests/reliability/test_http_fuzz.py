"""Property-based fuzzing of the orchestrator's HTTP API from its own OpenAPI document (schemathesis).

Every operation gets valid (positive) and schema-violating (negative) requests, seeded; the
orchestrator must answer every one with a status below 500, within the per-request timeout, and
still generate normally afterwards. The orchestrator runs with small token limits so that the
valid generations stay short; that is test configuration, the code paths are the usual ones.
A second run does the same behind API keys, sending the bearer header.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.helpers import env_int, summarize, write_report
from tests.support import start_orchestrator

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

SEED = 20240601
REQUEST_TIMEOUT_S = 60
# Examples per operation and mode; GET routes without parameters yield one case (and no negative one).
POSITIVE = env_int("SPECDEC_FUZZ_POSITIVE_EXAMPLES", 125)
NEGATIVE = env_int("SPECDEC_FUZZ_NEGATIVE_EXAMPLES", 200)
MIN_REQUESTS = 1000
LIMITS = {"SPECDEC_ORCHESTRATOR_MAX_TOKENS_LIMIT": "8", "SPECDEC_ORCHESTRATOR_DEFAULT_MAX_TOKENS": "4"}
API_KEYS = ("rel-key-one", "rel-key-two")


@dataclass
class Tally:
    """Requests sent and what came back."""

    statuses: collections.Counter = field(default_factory=collections.Counter)
    by_mode: dict[str, collections.Counter] = field(default_factory=dict)  # "positive" / "negative"
    by_operation: dict[str, collections.Counter] = field(default_factory=dict)
    server_errors: list[dict] = field(default_factory=list)  # status >= 500
    transport_errors: list[dict] = field(default_factory=list)  # timeouts, resets: no status at all
    negative_accepted: int = 0  # schema-violating requests answered 2xx (lenient, not a failure)
    slowest_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.statuses.values()) + len(self.transport_errors)

    def add(self, case, response, seconds: float, negative: bool) -> None:
        op = f"{case.method.upper()} {case.path}"
        self.statuses[response.status_code] += 1
        self.by_mode.setdefault("negative" if negative else "positive", collections.Counter())[response.status_code] += 1
        self.by_operation.setdefault(op, collections.Counter())[response.status_code] += 1
        self.slowest_s = max(self.slowest_s, seconds)
        if response.status_code >= 500:
            self.server_errors.append({"operation": op, "status": response.status_code, "body": _short(case.body),
                                       "headers": _short(case.headers), "response": response.text[:300]})
        if negative and 200 <= response.status_code < 300:
            self.negative_accepted += 1

    def as_dict(self) -> dict:
        return {"requests": self.total, "statuses": dict(sorted(self.statuses.items())),
                "by_mode": {k: dict(sorted(v.items())) for k, v in sorted(self.by_mode.items())},
                "by_operation": {k: dict(sorted(v.items())) for k, v in sorted(self.by_operation.items())},
                "server_errors": self.server_errors[:50], "transport_errors": self.transport_errors[:50],
                "negative_accepted_2xx": self.negative_accepted, "slowest_request_s": round(self.slowest_s, 2)}


def _short(value, limit: int = 300) -> str:
    try:
        text = json.dumps(value, default=repr)
    except ValueError:
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def fuzz(url: str, tally: Tally, positive: int, negative: int, headers: dict[str, str] | None = None) -> None:
    """Run every operation of the orchestrator's schema through both generation modes."""
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers or {})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9, [f"{op.method} {op.path}" for op in operations]
    session = requests.Session()
    for op in operations:
        for mode, count in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):
            _fuzz_operation(url, op, mode, count, tally, session, headers)


def _fuzz_operation(url: str, op, mode, count: int, tally: Tally, session, headers: dict[str, str] | None) -> None:
    import hypothesis
    import requests
    from hypothesis import HealthCheck, Phase
    from schemathesis import GenerationMode

    negative = mode is GenerationMode.NEGATIVE

    # no shrinking and no example database: each generated case is sent exactly once
    @hypothesis.settings(max_examples=count, deadline=None, phases=[Phase.explicit, Phase.generate],
                         database=None, suppress_health_check=list(HealthCheck), print_blob=False)
    @hypothesis.seed(SEED)
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def send(case) -> None:
        t0 = time.monotonic()
        try:
            response = case.call(base_url=url, session=session, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            tally.transport_errors.append({"operation": f"{case.method.upper()} {case.path}",
                                           "body": _short(case.body), "error": f"{type(exc).__name__}: {exc}"})
            return
        tally.add(case, response, time.monotonic() - t0, negative)

    try:
        send()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing to violate (a GET without parameters has no negative case)


def _report(name: str, title: str, tally: Tally, seconds: float) -> None:
    data = {**tally.as_dict(), "seconds": round(seconds, 1), "seed": SEED,
            "examples_per_operation": {"positive": POSITIVE, "negative": NEGATIVE}}
    write_report(name, data)
    summarize(title, [
        f"requests {tally.total} in {seconds:.0f} s; statuses {dict(sorted(tally.statuses.items()))}",
        f"server errors (>= 500) {len(tally.server_errors)}; transport errors {len(tally.transport_errors)}; "
        f"slowest {tally.slowest_s:.1f} s; negative cases answered 2xx {tally.negative_accepted}",
    ] + [f"{mode} cases: {dict(sorted(c.items()))}" for mode, c in sorted(tally.by_mode.items())]
      + [f"{op}: {dict(sorted(c.items()))}" for op, c in sorted(tally.by_operation.items())])


def _still_generates(url: str, headers: dict | None = None) -> None:
    r = httpx.post(url + "/v1/generate", json={"prompt": "The three primary colors are", "max_tokens": 4}, timeout=60,
                   headers=headers)
    assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1, r.text


def test_openapi_fuzz_never_5xx(embedded_stack, tmp_path):
    orch, url = start_orchestrator(embedded_stack["draft_port"], embedded_stack["target_port"], tmp_path, env=LIMITS)
    tally = Tally()
    t0 = time.monotonic()
    try:
        fuzz(url, tally, POSITIVE, NEGATIVE)
        _report("http_fuzz", "schemathesis (open API)", tally, time.monotonic() - t0)
        assert orch.alive(), orch.tail()
        _still_generates(url)
        _still_generates(embedded_stack["url"])  # the services behind it too
    finally:
        orch.stop()
    assert tally.total >= MIN_REQUESTS
    assert not tally.transport_errors, tally.transport_errors[:5]
    assert not tally.server_errors, json.dumps(tally.server_errors[:10], indent=1)


def _auth_available() -> bool:
    from orchestrator.settings import OrchestratorSettings

    return "api_keys" in OrchestratorSettings.model_fields


def test_openapi_fuzz_with_api_keys(embedded_stack, tmp_path):
    if not _auth_available():
        pytest.skip("the orchestrator has no API keys setting")
    env = {**LIMITS, "SPECDEC_ORCHESTRATOR_API_KEYS": ",".join(API_KEYS)}
    orch, url = start_orchestrator(embedded_stack["draft_port"], embedded_stack["target_port"], tmp_path, env=env)
    headers = {"Authorization": f"Bearer {API_KEYS[1]}"}
    tally = Tally()
    t0 = time.monotonic()
    try:
        # without a key, or with a wrong one: 401 everywhere but the probes
        for path in ("/v1/models", "/openapi.json", "/metrics", "/v1/info"):
            assert httpx.get(url + path, timeout=10).status_code == 401, path
        assert httpx.get(url + "/v1/models", timeout=10, headers={"Authorization": "Bearer nope"}).status_code == 401
        r = httpx.post(url + "/v1/generate", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 401 and r.json()["detail"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        fuzz(url, tally, max(POSITIVE // 5, 10), max(NEGATIVE // 5, 10), headers=headers)
        _report("http_fuzz_api_keys", "schemathesis (API keys, bearer header sent)", tally, time.monotonic() - t0)
        # negative cases include a missing or mangled Authorization header (401 is right there);
        # a valid case carries the key and must never be refused
        assert tally.by_mode["positive"][401] == 0, "a request with a valid key was refused"
        assert orch.alive(), orch.tail()
        _still_generates(url, headers)
    finally:
        orch.stop()
    assert not tally.transport_errors, tally.transport_errors[:5]
    assert not tally.server_errors, json.dumps(tally.server_errors[:10], indent=1)
