"""Replicas behind one orchestrator: address lists and DNS, rendezvous affinity, failover.

The routing unit tests drive :class:`Replicas` with in-process clients whose calls succeed or fail
as each test says (they test the routing, not gRPC); DNS answers come from a patched resolver, since
no name server with several records runs here. The end-to-end test runs two real target services
and kills the one serving a stream while it streams.
"""

from __future__ import annotations

import asyncio
import collections
import socket

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.replicas import Replicas, TargetPool, parse_addresses, rendezvous_rank, unavailable
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.support import gen, iter_sse, start_model_service, start_orchestrator


def test_parse_addresses():
    assert parse_addresses("a:1, b:2,") == [("a", 1), ("b", 2)]
    assert parse_addresses("[::1]:50052") == [("::1", 50052)]
    for bad in ("", "a", "a:x", ":5", " , "):
        with pytest.raises(ValueError):
            parse_addresses(bad)


def test_rendezvous_spreads_sessions_and_moves_only_a_share():
    sessions = [f"s{i}" for i in range(3000)]
    two, three = ["a:1", "b:1"], ["a:1", "b:1", "c:1"]
    before = {s: rendezvous_rank(s, two)[0] for s in sessions}
    after = {s: rendezvous_rank(s, three)[0] for s in sessions}
    counts = collections.Counter(after.values())
    assert all(800 <= counts[a] <= 1200 for a in three), counts  # about a third each
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "c:1" for s in moved)  # a replica joining takes sessions only for itself
    assert 800 <= len(moved) <= 1200
    # and leaving gives back exactly its own sessions
    assert {s: rendezvous_rank(s, two)[0] for s in sessions} == before


class Client:
    """An in-process stand-in for a service client: each call succeeds unless its address is told to fail."""

    def __init__(self, address: str, failing: dict[str, grpc.StatusCode]) -> None:
        self.address, self.failing, self.calls = address, failing, 0

    async def verify(self, session_id: str) -> str:
        self.calls += 1
        if self.address in self.failing:
            raise grpc.aio.AioRpcError(self.failing[self.address], grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        return self.address

    async def close(self) -> None:
        pass


def make_replicas(spec: str, failing: dict[str, grpc.StatusCode]) -> Replicas[Client]:
    return Replicas("target", spec, lambda address, security: Client(address, failing))


def test_failover_marks_down_and_keeps_affinity():
    async def main():
        failing: dict[str, grpc.StatusCode] = {}
        r = make_replicas("h1:1,h2:1,h3:1", failing)
        owner = r.owner("s").address
        assert await r.call("s", lambda c: c.verify("s")) == owner
        failing[owner] = grpc.StatusCode.UNAVAILABLE
        second = r.ranked("s")[1].address
        assert await r.call("s", lambda c: c.verify("s")) == second  # moved in the same call
        assert not r.replicas[owner].up and r.owner("s").address == second
        # other sessions keep their replica unless it was the dead one
        assert all(r.owner(f"x{i}").address != owner for i in range(50))
        # busy is skipped for that call only, and not marked down
        failing.clear()
        failing[second] = grpc.StatusCode.RESOURCE_EXHAUSTED
        third = [a for a in ("h1:1", "h2:1", "h3:1") if a not in (owner, second)][0]
        assert await r.call("s", lambda c: c.verify("s")) == third
        assert r.replicas[second].up
        # a success through the last-resort path brings the dead one back
        failing.clear()
        r.mark_up(owner)
        assert r.owner("s").address == owner
        # all down or busy: the busy error wins (the client should come back), else UNAVAILABLE
        for a in ("h1:1", "h2:1", "h3:1"):
            failing[a] = grpc.StatusCode.UNAVAILABLE
        failing["h2:1"] = grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.call("s", lambda c: c.verify("s"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        failing["h2:1"] = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.call("s", lambda c: c.verify("s"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # other errors are the caller's (bad input), never a failover
        failing.clear()
        failing[r.owner("s").address] = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.call("s", lambda c: c.verify("s"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())


def test_probe_marks_up_and_down():
    async def main():
        failing: dict[str, grpc.StatusCode] = {"h2:1": grpc.StatusCode.UNAVAILABLE}
        r = make_replicas("h1:1,h2:1", failing)
        ok = await r.probe(lambda c: c.verify("probe"))
        assert [rep.address for rep, _ in ok] == ["h1:1"]
        assert [rep.up for rep in r.replicas.values()] == [True, False]
        failing.clear()
        await r.probe(lambda c: c.verify("probe"))
        assert all(rep.up for rep in r.replicas.values())
        assert isinstance(unavailable("x"), grpc.aio.AioRpcError)

    asyncio.run(main())


class InfoClient(Client):
    """A replica serving ``models[address]``: Info answers with that model's fingerprint."""

    def __init__(self, address: str, failing: dict[str, grpc.StatusCode], models: dict[str, str],
                 released: list[str], gate: asyncio.Event | None = None) -> None:
        super().__init__(address, failing)
        self.models, self.released, self.gate = models, released, gate

    async def info(self, timeout_s: float = 2.0):
        if self.gate is not None and self.address == "h2:1":
            await self.gate.wait()  # a slow replica: other checks run meanwhile
        model = self.models[self.address]
        return pb.InfoResponse(model_id=model, tokenizer_fingerprint=f"fp-{model}", vocab_size=100)

    async def release(self, session_id: str) -> bool:
        self.released.append(self.address)
        return True


def make_pool(models: dict[str, str], failing=None, released=None, gate=None):
    from orchestrator.replicas import TargetPool

    failing = {} if failing is None else failing
    released = [] if released is None else released
    return TargetPool(",".join(models), lambda address, security: InfoClient(address, failing, models, released, gate))


def test_a_replica_serving_another_model_is_never_used():
    """Rollout to another model, replica by replica: the one that changed is left out of routing
    (not even a last resort) until it serves the pool's model again; no successful call undoes it."""
    async def main():
        models = {"h1:1": "a", "h2:1": "a", "h3:1": "a"}
        pool = make_pool(models)
        assert (await pool.info()).model_id == "a"
        models["h2:1"] = "b"
        await pool.info()
        r = pool.replicas
        assert r.replicas["h2:1"].wrong_model and "serves another model (b" in r.replicas["h2:1"].wrong_model
        for i in range(200):
            assert all(rep.address != "h2:1" for rep in r.ranked(f"s{i}"))
        # every other replica down: still never the wrong one
        r.mark_down("h1:1", "x")
        r.mark_down("h3:1", "x")
        assert "h2:1" not in {rep.address for rep in r.ranked("s")}
        r.mark_up("h2:1")  # what a successful call does
        assert "h2:1" not in {rep.address for rep in r.ranked("s")}
        assert {d["address"]: d["up"] for d in r.describe()}["h2:1"] is False
        # the background probe sees it serve the pool's model again: back in
        models["h2:1"] = "a"
        await r.probe(lambda c: c.info(), pool._wrong)
        assert not r.replicas["h2:1"].wrong_model
        # the whole service moved to another model: the pool follows (the orchestrator re-checks its tokenizer)
        models.update({"h1:1": "b", "h2:1": "b", "h3:1": "b"})
        assert (await pool.info()).model_id == "b" and pool.fingerprint == ("fp-b", 100)
        assert not any(rep.wrong_model for rep in r.replicas.values())

    asyncio.run(main())


def test_the_pools_model_stays_set_while_a_check_is_running():
    """A check waiting on a slow replica never leaves the pool without its model: a concurrent probe
    still tells the wrong replica apart (the fingerprint was unset during the await)."""
    async def main():
        gate = asyncio.Event()
        models = {"h1:1": "a", "h2:1": "a", "h3:1": "b"}
        pool = make_pool({"h1:1": "a", "h2:1": "a", "h3:1": "a"}, gate=gate)
        gate.set()
        await pool.info()
        gate.clear()
        pool.replicas.replicas["h3:1"].client.models = models
        slow = asyncio.create_task(pool.info())
        await asyncio.sleep(0.01)
        assert pool.fingerprint == ("fp-a", 100)
        await pool.replicas.probe(lambda c: c.info() if c.address != "h2:1" else asyncio.sleep(0, "skip"),
                                  lambda info: pool._wrong(info) if isinstance(info, pb.InfoResponse) else "")
        assert pool.replicas.replicas["h3:1"].wrong_model
        gate.set()
        await slow

    asyncio.run(main())


def test_release_reaches_every_replica_that_served_the_session():
    """A failover leaves a copy of the session on each replica that served it: Release goes to all."""
    async def main():
        failing: dict[str, grpc.StatusCode] = {}
        released: list[str] = []
        pool = make_pool({"h1:1": "a", "h2:1": "a", "h3:1": "a"}, failing, released)
        first = pool.replicas.owner("s").address
        await pool.verify("s")
        failing[first] = grpc.StatusCode.RESOURCE_EXHAUSTED  # busy: the next replica serves the step
        await pool.verify("s")
        second = pool.replicas.ranked("s")[1].address
        assert await pool.release("s")
        assert sorted(released) == sorted({first, second})
        released.clear()
        await pool.release("s")  # forgotten once released: only the owner is asked
        assert released == [first]

    asyncio.run(main())


@pytest.mark.parametrize("given_up", ["cancelled", "deadline"])
def test_release_reaches_a_replica_whose_call_was_given_up(given_up):
    """A pre-draft cancelled, or a call past its deadline, may still run on the replica that took it
    over from a busy owner, and hold the session there: Release goes to that replica too."""
    async def main():
        failing: dict[str, grpc.StatusCode] = {}
        released: list[str] = []
        pool = make_pool({"h1:1": "a", "h2:1": "a", "h3:1": "a"}, failing, released)
        owner, second = [r.address for r in pool.replicas.ranked("s")[:2]]
        failing[owner] = grpc.StatusCode.RESOURCE_EXHAUSTED  # busy: the call goes on to the next one
        entered, never = asyncio.Event(), asyncio.Event()

        async def call(client):
            if client.address != second:
                return await client.verify("s")
            if given_up == "deadline":
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "late")
            entered.set()
            await never.wait()  # still running there when the orchestrator gives up

        task = asyncio.create_task(pool.replicas.call("s", call))
        if given_up == "cancelled":
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(grpc.aio.AioRpcError):
                await task
        await pool.release("s")
        assert sorted(released) == sorted({owner, second})

    asyncio.run(main())


def test_sessions_remembered_for_release_are_bounded(monkeypatch):
    """Sessions never released (a client gone) are forgotten oldest first; Release then asks their owner."""
    from orchestrator import replicas as module

    monkeypatch.setattr(module, "MAX_TRACKED_SESSIONS", 3)

    async def main():
        pool = make_pool({"h1:1": "a", "h2:1": "a"})
        for i in range(5):
            await pool.verify(f"s{i}")
        await pool.verify("s2")  # used again: most recent
        assert list(pool.replicas._holders) == ["s3", "s4", "s2"]

    asyncio.run(main())


def test_a_name_with_several_addresses_is_several_replicas(monkeypatch):
    answers = {"target-headless": ["10.0.0.1", "10.0.0.2"]}

    async def getaddrinfo(self, host, port, **kw):
        if host not in answers:
            raise socket.gaierror(f"unknown {host}")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)

    async def main():
        r = make_replicas("target-headless:50052, single:7", {})
        await r.resolve()
        # one address: the name is kept; several: one replica each
        assert set(r.replicas) == {"10.0.0.1:50052", "10.0.0.2:50052", "single:7"}
        kept = r.replicas["10.0.0.1:50052"].client
        answers["target-headless"] = ["10.0.0.1", "10.0.0.3"]  # a pod replaced
        await r.resolve()
        assert set(r.replicas) == {"10.0.0.1:50052", "10.0.0.3:50052", "single:7"}
        assert r.replicas["10.0.0.1:50052"].client is kept  # a replica that stays keeps its channel
        # the departed replica's channel: open for calls under way, closed after the grace period
        closed = []
        for _, client in r._retired:
            client.close = lambda c=client: asyncio.sleep(0, closed.append(c.address))
        await r.close_retired()
        assert closed == []
        await r.close_retired(grace_s=0.0)
        assert "10.0.0.2:50052" in closed and r._retired == []
        del answers["target-headless"]  # resolution fails: keep what we had
        await r.resolve()
        assert set(r.replicas) == {"10.0.0.1:50052", "10.0.0.3:50052", "single:7"}

    asyncio.run(main())


def _sessions(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return pb_grpc.TargetServiceStub(ch).Info(pb.InfoRequest(), timeout=5).sessions


def _failovers(url: str, service: str, reason: str) -> float:
    """specdec_replica_failovers_total{service, reason} from the orchestrator's /metrics (0 if absent)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "specdec_replica_failovers_total" and sample.labels == {"service": service, "reason": reason}:
                return sample.value
    return 0.0


@pytest.mark.slow
def test_target_replica_killed_mid_stream_keeps_the_stream(tmp_path, embedded_stack):
    """Two target replicas: each stream is pinned to one; killing it mid-stream moves the stream to
    the other (one re-prefill), with the same output as plain decoding and no error."""
    for name in ("t1", "t2"):
        (tmp_path / name).mkdir()
    t1, p1 = start_model_service("target", tmp_path / "t1")
    t2, p2 = start_model_service("target", tmp_path / "t2")
    orch, url = start_orchestrator(embedded_stack["draft_port"], 0, tmp_path, env={
        "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": f"127.0.0.1:{p1},127.0.0.1:{p2}",
        # Probes rarer than the stream, so that the stream's own failing call is what finds the
        # killed replica (a probe that found it first would leave no failover to count).
        "SPECDEC_ORCHESTRATOR_REPLICA_PROBE_INTERVAL_S": "60",
    })
    replicas = {p1: t1, p2: t2}
    try:
        ready = httpx.get(url + "/ready").json()
        assert sorted(r["address"] for r in ready["replicas"]["target"]) == sorted(
            f"127.0.0.1:{p}" for p in (p1, p2))
        body = dict(prompt="The history of the printing press", max_tokens=80, ignore_eos=True,
                    controller="fixed", k=3)
        plain = gen(embedded_stack["url"], mode="autoregressive", **body)
        # sessions spread over both replicas
        for i in range(6):
            gen(url, prompt=f"Request {i} about rivers", max_tokens=4)
        events, killed = [], None
        with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=300) as r:
            assert r.status_code == 200
            for item in iter_sse(r):
                events.append(item)
                if len(events) == 3:
                    owners = [p for p in (p1, p2) if _sessions(p) > 0]
                    assert len(owners) == 1, owners  # one replica holds the stream's session
                    killed = owners[0]
                    replicas[killed].kill()
        assert [e for e, _ in events if e == "error"] == []
        done = [d for e, d in events if e == "done"][0]
        assert done["token_ids"] == plain["token_ids"]
        survivor = p2 if killed == p1 else p1
        info = httpx.get(url + "/v1/info").json()["replicas"]["target"]
        assert {r["address"]: r["up"] for r in info} == {f"127.0.0.1:{killed}": False, f"127.0.0.1:{survivor}": True}
        # new requests go to the survivor; the orchestrator stays ready with one target left
        assert gen(url, prompt="Hello", max_tokens=4)["token_ids"]
        assert httpx.get(url + "/ready").status_code == 200
        assert _failovers(url, "target", "unavailable") >= 1
        # the last one gone: 503, as with a single target
        replicas[survivor].kill()
        r = httpx.post(url + "/v1/generate", json={"prompt": "Hello", "max_tokens": 8}, timeout=60)
        assert r.status_code == 503 and "target" in r.json()["detail"]
    finally:
        orch.stop()
        t1.stop()
        t2.stop()


def test_calls_in_flight_are_counted_per_pool():
    """Each pool counts its own calls in flight (two runtimes in one process share nothing), and
    a failed call is counted out too."""

    class Gated(Client):
        gate: asyncio.Event

        async def verify(self, session_id: str, *args) -> str:
            await self.gate.wait()
            return await super().verify(session_id)

    async def main():
        Gated.gate = asyncio.Event()
        failing: dict[str, grpc.StatusCode] = {}
        one, other = (TargetPool("h1:1", lambda address, security: Gated(address, failing)) for _ in range(2))
        call = asyncio.create_task(one.verify("s"))
        await asyncio.sleep(0)
        assert (one.in_flight, other.in_flight) == (1, 0)
        Gated.gate.set()
        assert await call == "h1:1" and one.in_flight == 0
        failing["h1:1"] = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError):
            await one.verify("s")
        assert one.in_flight == 0

    asyncio.run(main())


async def test_a_runtime_builds_its_pools_from_the_settings():
    from orchestrator.runtime import Runtime
    from orchestrator.settings import OrchestratorSettings

    settings = OrchestratorSettings(draft_address="d1:1,d2:1", target_address="t:2", draft_timeout_s=3.0,
                                    target_timeout_s=9.0, draft_retry_s=4.0, shared_host_max_streams=5)
    rt = Runtime.from_settings(settings)
    try:
        assert (rt.draft.address, rt.target.address) == ("d1:1,d2:1", "t:2")
        assert {r.client.timeout_s for r in rt.draft.replicas.replicas.values()} == {3.0}
        assert [r.client.timeout_s for r in rt.target.replicas.replicas.values()] == [9.0]
        assert rt.draft_health.retry_s == 4.0 and rt.costs.shared_host_max_streams == 5
        assert (rt.draft.in_flight, rt.target.in_flight, rt.background) == (0, 0, set())
    finally:
        await rt.draft.close()
        await rt.target.close()


class _InfoOnly(pb_grpc.TargetServiceServicer):
    async def Info(self, request, context):
        return pb.InfoResponse(model_id="m")


@pytest.mark.parametrize("health", [None, "SERVING", "NOT_SERVING"])
async def test_info_reads_the_services_health_beside_it(health):
    """A service whose gRPC health says NOT_SERVING (its forward pass hangs) answers Info, but the
    client's info() raises NotServing, so readiness and routing take it as down; a service with no
    health service (or one whose Check fails) is judged by Info alone. Real servers on real ports."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import HealthServicer

    from orchestrator.clients import NOT_SERVING, NotServing, TargetClient

    server = grpc.aio.server()
    pb_grpc.add_TargetServiceServicer_to_server(_InfoOnly(), server)
    if health is not None:
        servicer = HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(health))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = TargetClient(f"127.0.0.1:{port}", 5.0)
    try:
        if health == "NOT_SERVING":
            with pytest.raises(NotServing) as err:
                await client.info()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == NOT_SERVING
        else:
            assert (await client.info()).model_id == "m"
    finally:
        await client.close()
        await server.stop(0)
