"""Replicas of a model service behind one orchestrator: discovery, session affinity, failover.

An address setting holds a comma-separated list of ``host:port``. Each host is resolved to all its
addresses (a Kubernetes headless Service resolves to one address per ready pod) and resolved again
every ``resolve_every_s``, so replicas that join or leave are picked up. A name that resolves to one
address is kept as the name (gRPC resolves it itself, and TLS checks the certificate against it).

Each session is pinned to one replica by rendezvous hashing (highest random weight) of its session
id over the replicas that are up: its KV cache is reused on every call, and a replica joining or
leaving moves only the sessions whose first choice it is. Routing is for speed, never correctness:
every call carries the full sequence, so any replica can serve it, re-prefilling what it lacks.

A replica is marked down when a call to it fails with UNAVAILABLE (unreachable, refused, restarting)
or its probe fails; the call moves at once to the session's next replica, and the stream goes on
with the same output. Probes (``Info``, every ``probe_every_s``) bring it back. A replica whose
queue is full (RESOURCE_EXHAUSTED) is skipped for that call only. When no replica is left the last
error is raised, which the orchestrator turns into 503 (or 429 when all were busy).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
from prometheus_client import Counter, Gauge

from orchestrator.auth import grpc_security
from orchestrator.clients import DraftClient, NotServing, TargetClient
from orchestrator.settings import OrchestratorSettings
from specdec.auth import ChannelSecurity

logger = logging.getLogger(__name__)

REPLICAS_UP = Gauge("specdec_replicas_up", "Replicas of a model service that are up.", ["service"])
REPLICAS_KNOWN = Gauge("specdec_replicas", "Replicas of a model service known (resolved).", ["service"])
FAILOVERS = Counter("specdec_replica_failovers_total",
                    "Calls moved to another replica after one failed or was busy.", ["service", "reason"])

C = TypeVar("C")

# A call that fails with these moves to the session's next replica.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# Sessions whose replicas are remembered for Release; past this the oldest are forgotten (a session
# never released is freed by the services' idle TTL anyway).
MAX_TRACKED_SESSIONS = 100_000
RETIRED_GRACE_S = 60.0  # a departed replica's channel stays open this long for calls under way


def parse_addresses(spec: str) -> list[tuple[str, int]]:
    """``"a:1, b:2"`` -> [("a", 1), ("b", 2)]; IPv6 literals in brackets (``[::1]:50052``)."""
    out = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"{item!r}: expected host:port")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("no address given")
    return out


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rendezvous_rank(session_id: str, addresses: Sequence[str]) -> list[str]:
    """Addresses in the session's order of preference (highest random weight first)."""

    def weight(address: str) -> bytes:
        return hashlib.blake2b(f"{address}\0{session_id}".encode(), digest_size=8).digest()

    return sorted(addresses, key=weight, reverse=True)


@dataclasses.dataclass
class Replica(Generic[C]):
    address: str
    client: C
    name: str  # the host name it was resolved from (for TLS), or its address's host
    up: bool = True
    reason: str = ""  # why it is down
    since: float = dataclasses.field(default_factory=time.monotonic)
    # Why it serves another model than the pool's (""): never routed to, not even as a last
    # resort, and no successful call clears it; only a probe that finds the pool's model again.
    wrong_model: str = ""


class Replicas(Generic[C]):
    """The replicas of one service (``service``: "target" or "draft") and their clients."""

    def __init__(self, service: str, spec: str, make_client: Callable[[str, ChannelSecurity | None], C],
                 security: ChannelSecurity | None = None, resolve_every_s: float = 10.0,
                 probe_every_s: float = 2.0) -> None:
        self.service = service
        self.spec = spec
        self.hosts = parse_addresses(spec)
        self._make_client = make_client
        self.security = security
        self.resolve_every_s = resolve_every_s
        self.probe_every_s = probe_every_s
        self.replicas: dict[str, Replica[C]] = {}
        self._retired: list[tuple[float, C]] = []  # (when, client) of replicas that left
        self._task: asyncio.Task | None = None
        self._holders: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        # Until the first resolution: every configured entry as given.
        self._apply([(_join(h, p), h) for h, p in self.hosts])

    # ---- membership ------------------------------------------------------------------------------

    def _client(self, address: str, name: str) -> C:
        security = self.security
        if security is not None and security.tls and security.server_name is None and not address.startswith(name):
            security = dataclasses.replace(security, server_name=name)  # resolved address: check the name
        return self._make_client(address, security)

    def _apply(self, found: list[tuple[str, str]]) -> None:
        """Make ``found`` [(address, name)] the replica set, keeping the clients of those that stay."""
        wanted = dict(found)
        for address in list(self.replicas):
            if address not in wanted:
                logger.info("%s replica %s left", self.service, address)
                self._retired.append((time.monotonic(), self.replicas.pop(address).client))
        for address, name in wanted.items():
            if address not in self.replicas:
                if self._task is not None:
                    logger.info("%s replica %s joined", self.service, address)
                self.replicas[address] = Replica(address, self._client(address, name), name)
        self._publish()

    async def resolve(self) -> None:
        """Resolve every configured host again; a host that fails to resolve keeps its replicas."""
        loop = asyncio.get_running_loop()
        found: list[tuple[str, str]] = []
        for host, port in self.hosts:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                ips = sorted({info[4][0] for info in infos})
            except OSError as exc:
                kept = [(a, r.name) for a, r in self.replicas.items() if r.name == host]
                logger.warning("%s: cannot resolve %s (%s); keeping %d replica(s)", self.service, host, exc, len(kept))
                found += kept or [(_join(host, port), host)]
                continue
            if len(ips) <= 1:
                found.append((_join(host, port), host))  # one address: keep the name
            else:
                found += [(_join(ip, port), host) for ip in ips]
        self._apply(found)

    # ---- health ----------------------------------------------------------------------------------

    def _publish(self) -> None:
        REPLICAS_KNOWN.labels(self.service).set(len(self.replicas))
        REPLICAS_UP.labels(self.service).set(sum(r.up for r in self.replicas.values()))

    def mark_down(self, address: str, reason: str) -> None:
        replica = self.replicas.get(address)
        if replica is not None and replica.up:
            logger.warning("%s replica %s is down: %s", self.service, address, reason)
            replica.up, replica.reason, replica.since = False, reason, time.monotonic()
            self._publish()

    def mark_up(self, address: str) -> None:
        replica = self.replicas.get(address)
        if replica is not None and not replica.up:
            logger.info("%s replica %s is back", self.service, address)
            replica.up, replica.reason, replica.since = True, "", time.monotonic()
            self._publish()

    def set_wrong_model(self, address: str, reason: str) -> None:
        """Mark (``reason``) or clear ("") a replica serving another model than the pool's."""
        replica = self.replicas.get(address)
        if replica is None or replica.wrong_model == reason:
            return
        if reason:
            logger.warning("%s replica %s is left out: %s", self.service, address, reason)
        else:
            logger.info("%s replica %s serves the pool's model again", self.service, address)
        replica.wrong_model = reason
        self._publish()

    def up(self) -> list[Replica[C]]:
        return [r for r in self.replicas.values() if r.up and not r.wrong_model]

    async def probe(self, check: Callable[[C], Awaitable[Any]],
                    wrong: Callable[[Any], str] | None = None) -> list[tuple[Replica[C], Any]]:
        """Run ``check`` on every replica at once; mark each up or down, and, with ``wrong``
        (result -> why this replica serves another model, or ""), mark or clear it as serving
        another model; [(replica, result)] of those up."""
        replicas = list(self.replicas.values())
        results = await asyncio.gather(*(check(r.client) for r in replicas), return_exceptions=True)
        ok = []
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                code = result.code().name if isinstance(result, grpc.aio.AioRpcError) else type(result).__name__
                self.mark_down(replica.address, result.details() if isinstance(result, NotServing)
                               else f"probe failed: {code}")
            else:
                self.mark_up(replica.address)
                if wrong is not None:
                    self.set_wrong_model(replica.address, wrong(result))
                ok.append((replica, result))
        return ok

    def start(self, check: Callable[[C], Awaitable[Any]], wrong: Callable[[Any], str] | None = None) -> None:
        """Keep resolving and probing in the background (``check``: a cheap call, e.g. Info;
        ``wrong``: as for :meth:`probe`)."""

        async def run() -> None:
            last_resolve = -float("inf")
            while True:
                try:
                    if time.monotonic() - last_resolve >= self.resolve_every_s:
                        last_resolve = time.monotonic()
                        await self.resolve()
                    await self.probe(check, wrong)
                    await self.close_retired()
                except Exception:  # keep probing whatever one round met
                    logger.exception("%s replica probe failed", self.service)
                await asyncio.sleep(self.probe_every_s)

        self._task = asyncio.create_task(run(), name=f"{self.service}-replicas")

    # ---- routing ---------------------------------------------------------------------------------

    def ranked(self, session_id: str) -> list[Replica[C]]:
        """Replicas in this session's order: those up by rendezvous rank, then those down (a last
        resort: a replica marked down may be back before its next probe); never one that serves
        another model (its output would be another model's)."""
        order = [a for a in rendezvous_rank(session_id, list(self.replicas)) if not self.replicas[a].wrong_model]
        return [self.replicas[a] for a in order if self.replicas[a].up] + \
               [self.replicas[a] for a in order if not self.replicas[a].up]

    def owner(self, session_id: str) -> Replica[C] | None:
        ranked = self.ranked(session_id)
        return ranked[0] if ranked else None

    async def call(self, session_id: str, fn: Callable[[C], Awaitable[Any]]) -> Any:
        """``fn(client)`` on the session's replica, moving on to its next one when a replica is
        unreachable (marked down) or busy; the last error when every replica failed."""
        down: grpc.aio.AioRpcError | None = None
        busy: grpc.aio.AioRpcError | None = None
        for replica in self.ranked(session_id):
            try:
                result = await fn(replica.client)
            except asyncio.CancelledError:
                # A call given up (a dropped pre-draft) may still run there and hold the session.
                self._held_by(session_id).add(replica.address)
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # it may still be computing there
                        self._held_by(session_id).add(replica.address)
                    raise
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.mark_down(replica.address, f"{exc.code().name}: {exc.details()}")
                    down = exc
                else:
                    busy = exc
                FAILOVERS.labels(self.service, exc.code().name.lower()).inc()
                continue
            self.mark_up(replica.address)
            self._held_by(session_id).add(replica.address)
            return result
        # Busy somewhere, down elsewhere: busy is the error that tells the client to come back.
        if busy is not None or down is not None:
            raise busy or down
        raise RuntimeError(f"no {self.service} replica configured")

    def _held_by(self, session_id: str) -> set[str]:
        """The replicas that served a call of this session (each may hold a copy of its cache)."""
        held = self._holders.setdefault(session_id, set())
        self._holders.move_to_end(session_id)  # most recent last: the oldest go first past the bound
        if len(self._holders) > MAX_TRACKED_SESSIONS:
            self._holders.popitem(last=False)
        return held

    def holders(self, session_id: str) -> list[Replica[C]]:
        """Every replica that may hold this session: those that served it, and its owner now."""
        addresses = self._holders.pop(session_id, set())
        owner = self.owner(session_id)
        if owner is not None:
            addresses.add(owner.address)
        return [self.replicas[a] for a in sorted(addresses) if a in self.replicas]

    async def close_retired(self, grace_s: float = RETIRED_GRACE_S) -> None:
        """Close the channels of replicas that left more than ``grace_s`` ago (calls already under
        way on them had that long to end); each would otherwise keep reconnecting to a gone address."""
        now = time.monotonic()
        due = [c for t, c in self._retired if now - t >= grace_s]
        self._retired = [(t, c) for t, c in self._retired if now - t < grace_s]
        for client in due:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - a channel that fails to close is gone all the same
                logger.debug("%s: closing a departed replica's channel failed", self.service, exc_info=True)

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"address": r.address, "name": r.name, "up": r.up and not r.wrong_model,
                 "reason": r.wrong_model or r.reason, "for_s": round(now - r.since, 1)} for r in self.replicas.values()]

    async def close(self, close_client: Callable[[C], Awaitable[None]]) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for client in [r.client for r in self.replicas.values()] + [c for _, c in self._retired]:
            await close_client(client)
        self._retired = []


def unavailable(details: str) -> grpc.aio.AioRpcError:
    """The error of a call that found no replica to go to."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Pool:
    """What the orchestrator holds for one service: the interface of a single client (``info``,
    ``release``, ``close``, the service's calls) over all its replicas."""

    service = ""

    @classmethod
    def _from_settings(cls, settings: OrchestratorSettings, address: str, client: type, timeout_s: float) -> Any:
        """The pool of ``address``: ``client`` instances with the call deadline ``timeout_s``, the
        orchestrator's channel security for this service, and its resolve and probe intervals."""
        return cls(address, lambda addr, security: client(addr, timeout_s, security), grpc_security(settings, cls.service),
                   settings.replica_resolve_interval_s, settings.replica_probe_interval_s)

    def __init__(self, spec: str, make_client: Callable[[str, ChannelSecurity | None], Any],
                 security: ChannelSecurity | None = None, resolve_every_s: float = 10.0,
                 probe_every_s: float = 2.0) -> None:
        self.address = spec
        self.replicas: Replicas[Any] = Replicas(self.service, spec, make_client, security, resolve_every_s,
                                                probe_every_s)
        self.fingerprint: tuple[str, int] | None = None  # tokenizer and vocabulary all replicas must share
        # Calls of this pool in flight (Verify or Propose): while one runs on the other service's
        # host, a call to that one asks it to leave this one its cores (``yield_cores``).
        self.in_flight = 0

    def start(self) -> None:
        """Resolve and probe in the background (call inside the event loop)."""
        self.replicas.start(lambda c: c.info(timeout_s=2.0), self._wrong)

    def _wrong(self, info: Any) -> str:
        """Why a replica answering ``info`` serves another model than the pool's ("" when it does not)."""
        if self.fingerprint is None or (info.tokenizer_fingerprint, info.vocab_size) == self.fingerprint:
            return ""
        return f"serves another model ({info.model_id}: tokenizer {info.tokenizer_fingerprint[:12]}, " \
               f"{info.vocab_size} ids) than the pool ({self.fingerprint[0][:12]}, {self.fingerprint[1]} ids)"

    async def info(self, timeout_s: float = 2.0) -> Any:
        """Info of a replica serving the pool's model (all are probed; those that do not answer are
        marked down, those serving another model left out). The pool's model is the first one
        found; it changes only when no replica serves it any more (a rollout to another model),
        and the orchestrator then checks its tokenizer against the new one (orchestrator.app.connect)."""
        await self.replicas.resolve()
        ok = await self.replicas.probe(lambda c: c.info(timeout_s=timeout_s))
        if not ok:
            reasons = "; ".join(f"{r.address}: {r.reason}" for r in self.replicas.replicas.values())
            raise unavailable(f"no {self.service} replica answers ({reasons})")

        def fingerprint(info: Any) -> tuple[str, int]:
            return info.tokenizer_fingerprint, info.vocab_size

        if self.fingerprint is None or all(fingerprint(info) != self.fingerprint for _, info in ok):
            if self.fingerprint is not None:
                logger.warning("%s: no replica serves the pool's model any more; following %s (%s)", self.service,
                               ok[0][0].address, ok[0][1].model_id)
            self.fingerprint = fingerprint(ok[0][1])  # set in one step: no check ever sees it unset
        for replica, info in ok:
            self.replicas.set_wrong_model(replica.address, self._wrong(info))
        return next(info for _, info in ok if fingerprint(info) == self.fingerprint)

    async def release(self, session_id: str) -> bool:
        """Release the session on every replica that may hold it (a failover leaves a copy on each
        replica that served it); whether any held it."""
        held = False
        for replica in self.replicas.holders(session_id):
            try:
                held = await replica.client.release(session_id) or held
            except grpc.aio.AioRpcError:  # that replica is gone: its sessions went with it
                pass
        return held

    async def close(self) -> None:
        await self.replicas.close(lambda c: c.close())

    async def _call(self, session_id: str, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        self.in_flight += 1
        try:
            return await self.replicas.call(session_id, fn)
        finally:
            self.in_flight -= 1


class TargetPool(_Pool):
    service = "target"

    @classmethod
    def from_settings(cls, settings: OrchestratorSettings) -> TargetPool:
        return cls._from_settings(settings, settings.target_address, TargetClient, settings.target_timeout_s)

    async def verify(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call(session_id, lambda c: c.verify(session_id, *args, **kwargs))


class DraftPool(_Pool):
    service = "draft"

    @classmethod
    def from_settings(cls, settings: OrchestratorSettings) -> DraftPool:
        return cls._from_settings(settings, settings.draft_address, DraftClient, settings.draft_timeout_s)

    async def propose(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call(session_id, lambda c: c.propose(session_id, *args, **kwargs))
