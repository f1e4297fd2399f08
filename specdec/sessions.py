"""Per-session KV cache store: bounded by session count and by bytes, LRU eviction, idle TTL.

The store is generic over the cache object (a transformers ``DynamicCache``, a llama.cpp sequence
slot …). It only knows each entry's size in bytes, reported by the engine after every call.
An evicted session is not an error: the next call on it simply re-prefills.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import ResourceExhausted

logger = logging.getLogger(__name__)


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
    Thread-safe; the engine holds its own lock around model compute.
    """

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
        self._on_evict = on_evict
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.RLock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def get_or_create(self, session_id: str, factory: Callable[[], Any]) -> Session:
        """Return the session (marked most recently used), creating it with ``factory()``."""
        with self._lock:
            self._expire()
            session = self._sessions.get(session_id)
            if session is None:
                if len(self._sessions) >= self.max_sessions:
                    self._evict_lru(keep=None)
                session = Session(session_id=session_id, cache=factory())
                self._sessions[session_id] = session
            else:
                self._sessions.move_to_end(session_id)
            session.last_used = time.monotonic()
            return session

    def reserve(self, session: Session, extra_bytes: int) -> None:
        """Make room for ``session`` to grow by ``extra_bytes``, evicting other sessions (LRU first).

        Raises ResourceExhausted when the session alone would exceed the budget.
        """
        with self._lock:
            needed = session.nbytes + extra_bytes
            if needed > self.max_bytes:
                raise ResourceExhausted(
                    f"session needs {needed} bytes of KV cache, over the budget of {self.max_bytes} bytes"
                )
            while self.nbytes + extra_bytes > self.max_bytes:
                if not self._evict_lru(keep=session.session_id):
                    raise ResourceExhausted(
                        f"KV budget of {self.max_bytes} bytes is full and no other session can be evicted"
                    )

    def update(self, session: Session, tokens: list[int], nbytes: int) -> None:
        """Record what the session's cache now holds."""
        with self._lock:
            session.tokens = tokens
            session.nbytes = nbytes
            session.last_used = time.monotonic()

    def release(self, session_id: str) -> bool:
        """Drop a session now; False when it was not held."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._dispose(session)
        return True

    def clear(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            self._dispose(session)

    def _expire(self) -> None:
        if self.ttl_s <= 0:
            return
        cutoff = time.monotonic() - self.ttl_s
        for sid in [sid for sid, s in self._sessions.items() if s.last_used < cutoff]:
            logger.info("session %s idle for more than %.0f s, dropped", sid, self.ttl_s)
            self._dispose(self._sessions.pop(sid))

    def _evict_lru(self, keep: str | None) -> bool:
        for sid in self._sessions:
            if sid != keep:
                logger.info("evicting session %s (LRU)", sid)
                self._dispose(self._sessions.pop(sid))
                self.evictions += 1
                return True
        return False

    def _dispose(self, session: Session) -> None:
        session.tokens = []
        session.nbytes = 0
        if self._on_evict is not None:
            self._on_evict(session)
