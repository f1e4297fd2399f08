"""The KV manager: each session's cache against one :class:`~specdec.engine.sessions.SessionStore`
(count and byte budget, LRU eviction, idle TTL), for every backend that keeps a cache: the
executor's per-session KV buffers (specdec.model.ragged.SessionKV) and llama.cpp's sequence slots.

A step goes through it in four moves: :meth:`KVManager.session` (the session, with a cache),
:meth:`~KVManager.reusable` (the prefix its cache already holds), :meth:`~KVManager.open` (room
reserved first, so a refusal leaves the session as it was; then the cache cropped to that prefix
and grown) and, after the forward, :meth:`~KVManager.commit` (what the cache now holds) or
:meth:`~KVManager.fail` (its contents unknown: the next call re-prefills).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from specdec.engine.sessions import Session, SessionStore, common_prefix_len


class Cache(Protocol):
    """One session's cache, as the KV manager drives it."""

    length: int  # leading positions that hold valid keys/values

    @property
    def capacity(self) -> int:
        """Positions held (what the session's bytes are counted by)."""

    def capacity_for(self, tokens: int, limit: int) -> int:
        """The capacity :meth:`ensure` would hold for ``tokens`` positions (``limit``: the longest
        a session may reach)."""

    def ensure(self, tokens: int, limit: int) -> None:
        """Hold room for ``tokens`` positions, keeping the first ``length``."""

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions at most."""

    def commit(self, length: int) -> None:
        """The first ``length`` positions are valid now (written by a forward)."""

    def clear(self) -> None:
        """Hold nothing (after a failed forward)."""

    def free(self) -> None:
        """Give the cache's resources back (the session was evicted or released)."""


class KVManager:
    """Sessions and their caches for one model (call under the model's lock)."""

    def __init__(self, store: SessionStore, new_cache: Callable[[], Cache], bytes_per_token: int,
                 model_max_context: int) -> None:
        self.store = store
        self.new_cache = new_cache
        self.bytes_per_token = bytes_per_token
        self.model_max_context = model_max_context
        self._on_evict = store.on_evict  # the store's own callback, if it had one, still runs
        store.on_evict = self._evicted

    @property
    def max_context(self) -> int:
        """Longest sequence a session may hold: the model's context, or fewer tokens when the KV
        budget holds fewer, so clients learn up front that a longer sequence is their input's
        problem (INVALID_ARGUMENT, HTTP 400), not a server fault."""
        return max(2, min(self.model_max_context, self.store.max_bytes // self.bytes_per_token))

    def session(self, session_id: str, issued: int | None = None, keep: Collection[str] = ()) -> Session:
        """The session with a cache (see SessionStore.get_or_create for ``issued`` and ``keep``)."""
        session = self.store.get_or_create(session_id, lambda: None, issued, keep)
        if session.cache is None:
            session.cache = self.new_cache()
        return session

    def reusable(self, session: Session, tokens: list[int], recompute: int) -> int:
        """Leading tokens of ``tokens`` the session's cache holds, less enough that the last
        ``recompute`` (those whose logits are wanted) are computed again."""
        held = min(common_prefix_len(session.tokens, tokens), session.cache.length)
        return max(0, min(held, len(tokens) - recompute))

    def open(self, session: Session, tokens: list[int], cached: int, pinned: Collection[str] = (),
             extra: int = 0) -> None:
        """Room for ``tokens`` and ``extra`` positions past them, the cache cropped to its first
        ``cached``. Room first (evicting others, never one in ``pinned``): a refusal
        (ResourceExhausted) leaves the session exactly as it was."""
        cache, limit = session.cache, self.max_context
        capacity = cache.capacity_for(len(tokens) + extra, limit)
        self.store.reserve(session, capacity * self.bytes_per_token - session.nbytes, pinned)
        cache.crop(cached)
        cache.ensure(len(tokens) + extra, limit)
        self.store.update(session, tokens[:cached], cache.capacity * self.bytes_per_token)

    def commit(self, session: Session, tokens: list[int]) -> None:
        """The cache holds ``tokens`` now."""
        session.cache.commit(len(tokens))
        self.store.update(session, tokens, session.cache.capacity * self.bytes_per_token)

    def fail(self, session: Session) -> None:
        """The forward failed: the cache may be half-written and no longer matches its tokens."""
        session.cache.clear()
        self.store.reset(session)

    def _evicted(self, session: Session) -> None:
        if session.cache is not None:
            session.cache.free()
            session.cache = None
        if self._on_evict is not None:
            self._on_evict(session)
