"""The model services' gRPC ports under attack, on the embedded stack with a token (no mTLS):
floods of callers without the token and of Health/Watch streams, and a forward that hangs.

Real processes: the llama.cpp draft and the target with SPECDEC_*_AUTH_TOKEN and their default
worker pools, and an orchestrator that sends the token. The hang is injected into the target
process by a ``sitecustomize`` module on its PYTHONPATH only: while a file exists, its batched
step blocks, as a deadlocked forward would.
"""

from __future__ import annotations

import collections
import os
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.reliability.helpers import post, summarize, write_report
from tests.support import start_model_service, start_orchestrator, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

TOKEN = "reliability-" + "7" * 40
AUTH = (("authorization", f"Bearer {TOKEN}"),)
FLOOD = 200  # header-only calls, and as many Watch streams, per service
PROMPT_IDS = [504, 1296, 3003, 4683, 359, 1080, 2300, 28]
HANG_TIMEOUT_S = 8.0  # the services' default
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

HANG_HOOK = '''\
"""Fault injection (tests/reliability/test_grpc_pressure.py): while the file named by
SPECDEC_TEST_HANG_FILE exists, the target's batched step does not return (it creates
<file>.entered when it starts waiting)."""
import os
import time

_path = os.environ.get("SPECDEC_TEST_HANG_FILE")
if _path:
    from target_service import verify as _verify

    _step = _verify.TargetEngine.step

    def _hanging_step(self, jobs):
        if os.path.exists(_path):
            open(_path + ".entered", "w").close()  # the test times the hang from here
        while os.path.exists(_path):
            time.sleep(0.05)  # the fault itself: a forward that does not return
        return _step(self, jobs)

    _verify.TargetEngine.step = _hanging_step
'''


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("grpc-pressure-logs")
    hook = tmp_path_factory.mktemp("hang-hook")
    (hook / "sitecustomize.py").write_text(textwrap.dedent(HANG_HOOK))
    hang_file = hook / "hang"
    procs = []
    try:
        draft, draft_port = start_model_service("draft", log_dir, {"SPECDEC_DRAFT_AUTH_TOKEN": TOKEN})
        procs.append(draft)
        path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
        target, target_port = start_model_service("target", log_dir, {
            "SPECDEC_TARGET_AUTH_TOKEN": TOKEN, "PYTHONPATH": path, "SPECDEC_TEST_HANG_FILE": str(hang_file)})
        procs.append(target)
        orch, url = start_orchestrator(draft_port, target_port, log_dir, {"SPECDEC_ORCHESTRATOR_GRPC_TOKEN": TOKEN})
        procs.append(orch)
        yield {"url": url, "ports": {"draft": draft_port, "target": target_port}, "hang_file": hang_file,
               "target": target}
    finally:
        for p in reversed(procs):
            p.stop()


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def ready_reading(url: str) -> tuple[int, str, list[bool]]:
    """The orchestrator's /ready: (status, reason, whether each target replica is up). It asks the
    services again at most once a second (READY_RECHECK_S), so a change shows within that."""
    r = httpx.get(f"{url}/ready", timeout=10)
    body = r.json()
    return r.status_code, body.get("reason", ""), [replica["up"] for replica in body["replicas"]["target"]]


def timed_info(kind: str, port: int) -> float:
    """Seconds an authenticated Info took."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.DraftServiceStub(channel) if kind == "draft" else pb_grpc.TargetServiceStub(channel)
        t0 = time.monotonic()
        assert stub.Info(pb.InfoRequest(), timeout=10, metadata=AUTH).max_context > 0
        return time.monotonic() - t0


def model_call(kind: str, port: int, session_id: str) -> float:
    """Seconds an authenticated Propose (draft) or Verify (target) took, its session released after."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        t0 = time.monotonic()
        if kind == "draft":
            stub = pb_grpc.DraftServiceStub(channel)
            stub.Propose(pb.ProposeRequest(session_id=session_id, tokens=PROMPT_IDS, max_draft_tokens=4),
                         timeout=30, metadata=AUTH)
        else:
            stub = pb_grpc.TargetServiceStub(channel)
            stub.Verify(pb.VerifyRequest(session_id=session_id, tokens=PROMPT_IDS), timeout=30, metadata=AUTH)
        took = time.monotonic() - t0
        stub.Release(pb.ReleaseRequest(session_id=session_id), timeout=10, metadata=AUTH)
        return took


def test_floods_without_the_token_leave_the_services_answering(stack):
    """On each service at once: 200 calls without the token that send headers and never a body, and
    200 Health/Watch streams (which need no token). Authenticated Info answers within 2 s, model
    calls and a generation through the orchestrator go on, the body-less calls are refused without
    holding a worker, the Watch streams beyond the cap are refused, and closing them frees it."""
    ports = stack["ports"]
    never = threading.Event()

    def no_body():
        never.wait()
        yield b""

    channels, held = {}, {}
    try:
        for kind, port in ports.items():
            channels[kind] = grpc.insecure_channel(f"127.0.0.1:{port}")
            service = "DraftService" if kind == "draft" else "TargetService"
            silent = channels[kind].stream_unary(f"/specdec.v1.{service}/Info", request_serializer=lambda r: r,
                                                 response_deserializer=pb.InfoResponse.FromString)
            watch = health_pb2_grpc.HealthStub(channels[kind]).Watch
            held[kind] = ([silent.future(no_body(), timeout=60) for _ in range(FLOOD)],
                          [watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(FLOOD)])
        watches = {}
        for kind, (_, streams) in held.items():  # every stream has reached the server: open or refused
            codes = collections.Counter()
            for s in streams:
                try:
                    codes[health_pb2.HealthCheckResponse.ServingStatus.Name(next(s).status)] += 1
                except grpc.RpcError as err:
                    codes[err.code().name] += 1
            watches[kind] = dict(codes)
        # with the Watch streams still open, and the body-less calls still waiting if they held a worker
        info_s = {kind: [timed_info(kind, port) for _ in range(10)] for kind, port in ports.items()}
        call_s = {kind: [model_call(kind, port, f"flooded-{kind}-{i}") for i in range(3)] for kind, port in ports.items()}
        generation = post(stack["url"], "/v1/generate", {"prompt": "The three primary colors are", "max_tokens": 16})
        refused = {kind: collections.Counter(f.exception(timeout=10).code().name for f in calls)
                   for kind, (calls, _) in held.items()}
    finally:
        never.set()
        for calls, streams in held.values():
            for call in calls + streams:
                call.cancel()
    # the places of the closed Watch streams come back
    reopened = {}
    for kind, channel in channels.items():
        deadline = time.monotonic() + 10
        while True:
            try:
                stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
                reopened[kind] = next(stream).status == SERVING
                stream.cancel()
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, err
                time.sleep(0.1)
        channel.close()
    report = {"per_service": FLOOD, "info_s_max": {k: round(max(v), 3) for k, v in info_s.items()},
              "model_call_s_max": {k: round(max(v), 3) for k, v in call_s.items()},
              "body_less_calls": {k: dict(v) for k, v in refused.items()}, "watch_streams": watches,
              "generation": {"status": generation.status, "seconds": round(generation.seconds, 2)},
              "watch_reopened": reopened}
    write_report("grpc_floods", report)
    summarize("gRPC floods (token set, no mTLS)", [
        f"{FLOOD} header-only calls and {FLOOD} Watch streams on each service: authenticated Info at most "
        f"{max(info_s['draft']):.3f} s (draft) / {max(info_s['target']):.3f} s (target); Propose / Verify at most "
        f"{max(call_s['draft']):.2f} s / {max(call_s['target']):.2f} s; a generation {generation.status} in "
        f"{generation.seconds:.1f} s",
        f"header-only calls: {report['body_less_calls']}; Watch streams: {watches}"])
    for kind in ports:
        assert max(info_s[kind]) < 2, report
        assert refused[kind] == {"UNAUTHENTICATED": FLOOD}, report
        assert watches[kind].get("SERVING", 0) >= 1 and watches[kind].get("RESOURCE_EXHAUSTED", 0) >= FLOOD / 2, report
        assert reopened[kind], report
    assert generation.status == 200, report


def test_a_hung_forward_turns_health_not_serving_within_ten_seconds(stack):
    """The target's forward stops returning (the hook holds its batched step): health answers
    NOT_SERVING within 10 s of the hang (the hang timeout, 8 s by default, and the watchdog's
    one-second look), Info still answers meanwhile, and once the forward returns the call completes
    and health is SERVING again."""
    port, hang_file = stack["ports"]["target"], stack["hang_file"]
    assert health(port) == SERVING
    hang_file.touch()
    readings: list[tuple[float, str]] = []
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(model_call, "target", port, "hung")
            entered = hang_file.with_name(hang_file.name + ".entered")
            # the forward has started and does not return
            wait_until(lambda: entered.exists() or pending.done(), 30, "the Verify reaching the forward", 0.02)
            assert not pending.done(), f"the Verify ended instead of reaching the forward: {pending.result()}"
            t0 = time.monotonic()

            def not_serving() -> bool:
                status = health(port)
                readings.append((round(time.monotonic() - t0, 2), health_pb2.HealthCheckResponse.ServingStatus.Name(status)))
                return status == NOT_SERVING

            wait_until(not_serving, 15, lambda: f"health still {readings[-3:]}", 0.1)
            not_serving_s = time.monotonic() - t0
            info_while_hung_s = timed_info("target", port)
            # the orchestrator's /ready agrees with the target's health (it read Info alone, and said 200)
            seen: list[tuple[int, str, list[bool]]] = []

            def ready_changed() -> tuple[int, str, list[bool]] | None:
                seen.append(reading := ready_reading(stack["url"]))
                return reading if reading[0] != 200 else None

            ready_while_hung = wait_until(ready_changed, 5, lambda: f"/ready still {seen[-1]}", 0.1)
            assert not pending.done()  # the forward is still held
            hang_file.unlink()
            t_back = time.monotonic()
            verify_s = pending.result(timeout=60)
            wait_until(lambda: health(port) == SERVING, 10, "health SERVING again", 0.05)
            serving_again_s = time.monotonic() - t_back
            wait_until(lambda: ready_reading(stack["url"])[0] == 200, 10, "/ready 200 again", 0.1)
            ready_again_s = time.monotonic() - t_back
    finally:
        hang_file.unlink(missing_ok=True)
        hang_file.with_name(hang_file.name + ".entered").unlink(missing_ok=True)
    report = {"hang_timeout_s": HANG_TIMEOUT_S, "not_serving_after_s": not_serving_s,
              "info_while_hung_s": round(info_while_hung_s, 3), "held_verify_s": round(verify_s, 1),
              "serving_again_after_s": serving_again_s, "readings": readings[-3:],
              "ready_while_hung": ready_while_hung, "ready_again_after_s": ready_again_s}
    write_report("hung_forward", report)
    summarize("hung forward", [
        f"target forward held: health NOT_SERVING after {not_serving_s:.1f} s (hang timeout {HANG_TIMEOUT_S:.0f} s), "
        f"Info meanwhile in {info_while_hung_s:.3f} s, /ready {ready_while_hung[0]}; released: SERVING again after "
        f"{serving_again_s:.1f} s, /ready 200 after {ready_again_s:.1f} s"])
    assert HANG_TIMEOUT_S - 1 <= not_serving_s < 10, report
    assert info_while_hung_s < 2, report
    assert serving_again_s < 3, report
    # and the replica is marked down for routing, by the same reading
    assert ready_while_hung[0] == 503 and "NOT_SERVING" in ready_while_hung[1] and ready_while_hung[2] == [False], report
    assert ready_again_s < 5, report
    assert stack["target"].alive()
