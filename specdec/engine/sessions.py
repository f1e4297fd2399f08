"""Per-session KV cache store: bounded by session count and by bytes, LRU eviction, idle TTL.

The store is generic over the cache object (a transformers ``DynamicCache``, a llama.cpp sequence
slot …). It only knows each entry's size in bytes, reported by the engine after every call.
An evicted session is not an error: the next call on it simply re-prefills. A released one is
gone for every call made before the Release (see :meth:`SessionStore.get_or_create`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.errors import Cancelled, ResourceExhausted

if TYPE_CHECKING:
    from specdec.settings import ModelServiceSettings

logger = logging.getLogger(__name__)


class SessionsFull(Exception):
    """Every session the store may hold is taken by the step asking: the call waits for the next."""

# Released session ids remembered (oldest forgotten first), so that a call made before a Release
# and still waiting (queued, or between two steps) cannot re-create the session after it.
RELEASED_REMEMBERED = 4096


@dataclass
class Session:
    """One session's cached state."""

    session_id: str
    cache: Any
    # Token ids whose keys/values ``cache`` holds, in order.
    tokens: list[int] = field(default_factory=list)
    nbytes: int = 0
    last_used: float = field(default_factory=time.monotonic)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    # Fast path: the usual call extends the cached sequence by a few tokens.
    if n and a[n - 1] == b[n - 1] and a[:n] == b[:n]:
        return n
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionStore:
    """LRU map session_id -> Session, bounded by ``max_sessions`` and ``max_bytes``.

    Sessions idle for more than ``ttl_s`` seconds are dropped on the next access to the store.
    ``on_evict`` is called with each session removed for any reason (to free backend resources).
    A Release wins over every call made before it: calls take a :meth:`stamp` when they arrive,
    and :meth:`get_or_create` refuses to bring back a session released after that stamp.
    Thread-safe; the engine holds its own lock around model compute.
    """

    @classmethod
    def from_settings(cls, settings: ModelServiceSettings) -> SessionStore:
        """The store a model service's settings ask for (``max_sessions``, ``kv_budget_mb``, ``session_ttl_s``)."""
        return cls(settings.max_sessions, settings.kv_budget_bytes, settings.session_ttl_s)

    def __init__(
        self,
        max_sessions: int,
        max_bytes: int,
        ttl_s: float,
        on_evict: Callable[[Session], None] | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.on_evict = on_evict  # the KV manager sets it (specdec.engine.kv)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.RLock()
        # A running total, so readers on other threads (metrics, Info) never iterate the map
        # while the compute thread reorders or evicts sessions.
        self._nbytes = 0
        self.evictions = 0
        self._clock = itertools.count(1)
        self._released: OrderedDict[str, int] = OrderedDict()  # session id -> stamp of its last Release

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def nbytes(self) -> int:
        """Bytes held across sessions (safe to read from any thread)."""
        return self._nbytes

    def stamp(self) -> int:
        """A point in this store's history, later than every one before: a call takes one when it
        arrives and passes it to :meth:`get_or_create` as ``issued``."""
        with self._lock:
            return next(self._clock)

    def get_or_create(self, session_id: str, factory: Callable[[], Any], issued: int | None = None,
                      keep: Collection[str] = ()) -> Session:
        """Return the session (marked most recently used), creating it with ``factory()``.

        ``issued``: the :meth:`stamp` of the call asking. A session released after it is not
        created again (Cancelled): the caller sent the Release after this call, so it no longer
        wants the call's result, and the session would stay until its idle TTL. A call made after
        the Release creates the session afresh, as for any new id.

        ``keep``: the sessions a step has already taken. Creating one when the store is full evicts
        the least recently used session outside them; when every session is one of them, raises
        :class:`SessionsFull` (the call waits for the next step), so a step never evicts a session
        it is about to compute for (its cache would be filled outside the budget, then thrown away).
        """
        with self._lock:
            self._expire()
            session = self._sessions.get(session_id)
            if session is None:
                if issued is not None and self._released.get(session_id, 0) > issued:
                    raise Cancelled(f"session {session_id!r} was released after this call was made")
                if len(self._sessions) >= self.max_sessions and not self._evict_lru(keep=keep):
                    raise SessionsFull(f"all {self.max_sessions} sessions are taken by this step")
                session = Session(session_id=session_id, cache=factory())
                self._sessions[session_id] = session
            else:
                self._sessions.move_to_end(session_id)
            session.last_used = time.monotonic()
            return session

    def reserve(self, session: Session, extra_bytes: int, pinned: Collection[str] = ()) -> None:
        """Make room for ``session`` to grow by ``extra_bytes``, evicting other sessions (LRU first)
        but never one in ``pinned`` (the other sessions of the same batched forward).

        Raises ResourceExhausted when the session alone would exceed the budget.
        """
        with self._lock:
            needed = session.nbytes + extra_bytes
            if needed > self.max_bytes:
                raise ResourceExhausted(
                    f"session needs {needed} bytes of KV cache, over the budget of {self.max_bytes} bytes"
                )
            while self._nbytes + extra_bytes > self.max_bytes:
                if not self._evict_lru(keep={session.session_id, *pinned}):
                    raise ResourceExhausted(
                        f"KV budget of {self.max_bytes} bytes is full and no other session can be evicted"
                    )

    def update(self, session: Session, tokens: list[int], nbytes: int) -> None:
        """Record what the session's cache now holds."""
        with self._lock:
            if self._sessions.get(session.session_id) is session:
                self._nbytes += nbytes - session.nbytes
            session.tokens = tokens
            session.nbytes = nbytes
            session.last_used = time.monotonic()

    def reset(self, session: Session) -> None:
        """Forget what a session's cache holds (after a failed forward its contents are unknown);
        the next call on it re-prefills."""
        self.update(session, [], 0)

    def release(self, session_id: str) -> bool:
        """Drop a session now, and keep calls made before this from creating it again; False when
        it was not held."""
        with self._lock:
            self._released[session_id] = next(self._clock)
            self._released.move_to_end(session_id)
            if len(self._released) > RELEASED_REMEMBERED:
                self._released.popitem(last=False)
            if session_id not in self._sessions:
                return False
            self._remove(session_id)
            return True

    def clear(self) -> None:
        with self._lock:
            for sid in list(self._sessions):
                self._remove(sid)

    def _expire(self) -> None:
        if self.ttl_s <= 0:
            return
        cutoff = time.monotonic() - self.ttl_s
        for sid in [sid for sid, s in self._sessions.items() if s.last_used < cutoff]:
            logger.info("session %s idle for more than %.0f s, dropped", sid, self.ttl_s)
            self._remove(sid)

    def _evict_lru(self, keep: Collection[str]) -> bool:
        for sid in self._sessions:
            if sid not in keep:
                logger.info("evicting session %s (LRU)", sid)
                self._remove(sid)
                self.evictions += 1
                return True
        return False

    def _remove(self, session_id: str) -> None:
        """Drop a session and free its backend resources (call with the lock held)."""
        session = self._sessions.pop(session_id)
        self._nbytes -= session.nbytes
        session.tokens = []
        session.nbytes = 0
        if self.on_evict is not None:
            self.on_evict(session)
