"""The KV manager (specdec.engine.kv) on a recording cache: prefix reuse, room reserved before the
cache changes, commit, reset after a failed forward, the cache freed on eviction."""

from __future__ import annotations

import pytest

from specdec.engine.kv import KVManager
from specdec.engine.sessions import SessionStore
from specdec.errors import ResourceExhausted

BYTES_PER_TOKEN = 10


class Recording:
    """A cache that holds exactly what it is asked to hold, and records what is done to it."""

    def __init__(self) -> None:
        self.length = self.capacity = 0
        self.calls: list[tuple] = []

    def capacity_for(self, tokens: int, limit: int) -> int:
        return max(tokens, self.capacity)

    def ensure(self, tokens: int, limit: int) -> None:
        self.capacity = max(tokens, self.capacity)
        self.calls.append(("ensure", tokens))

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
        self.calls.append(("crop", length))

    def commit(self, length: int) -> None:
        self.length = length

    def clear(self) -> None:
        self.length = self.capacity = 0

    def free(self) -> None:
        self.calls.append(("free",))


def manager(max_sessions: int = 4, max_tokens: int = 100, on_evict=None) -> KVManager:
    store = SessionStore(max_sessions, max_tokens * BYTES_PER_TOKEN, 0, on_evict=on_evict)
    return KVManager(store, Recording, BYTES_PER_TOKEN, model_max_context=64)


def test_the_prefix_held_is_reused_but_the_rows_wanting_logits_are_computed_again():
    kv = manager()
    s = kv.session("a")
    kv.open(s, [1, 2, 3, 4], 0)
    kv.commit(s, [1, 2, 3, 4])
    assert kv.reusable(s, [1, 2, 3, 4, 5, 6], recompute=1) == 4
    assert kv.reusable(s, [1, 2, 3, 4], recompute=1) == 3  # an identical retry costs one row
    assert kv.reusable(s, [1, 2, 9, 9, 9], recompute=1) == 2  # the common prefix only
    s.cache.length = 1  # a cache holding less than its tokens say (a chunk in flight)
    assert kv.reusable(s, [1, 2, 3, 4, 5], recompute=1) == 1


def test_open_reserves_first_then_crops_and_grows():
    kv = manager()
    s = kv.session("a")
    kv.open(s, [1, 2, 3, 4], 0)
    kv.commit(s, [1, 2, 3, 4])
    assert (s.tokens, s.nbytes, kv.store.nbytes) == ([1, 2, 3, 4], 4 * BYTES_PER_TOKEN, 4 * BYTES_PER_TOKEN)
    s.cache.calls.clear()
    kv.open(s, [1, 2, 7, 8, 9], 2, extra=3)
    assert s.cache.calls == [("crop", 2), ("ensure", 8)]
    assert (s.tokens, s.nbytes) == ([1, 2], 8 * BYTES_PER_TOKEN)  # what it holds until the forward commits


def test_a_refused_reservation_leaves_the_session_as_it_was():
    kv = manager(max_tokens=10)
    s = kv.session("a")
    kv.open(s, [1, 2, 3], 0)
    kv.commit(s, [1, 2, 3])
    s.cache.calls.clear()
    with pytest.raises(ResourceExhausted, match="over the budget"):
        kv.open(s, list(range(11)), 3)
    assert (s.tokens, s.nbytes, s.cache.length, s.cache.calls) == ([1, 2, 3], 3 * BYTES_PER_TOKEN, 3, [])


def test_room_evicts_others_but_never_a_pinned_session_and_frees_their_caches():
    evicted = []
    kv = manager(max_tokens=10, on_evict=lambda s: evicted.append(s.session_id))
    sessions = {sid: kv.session(sid) for sid in "abc"}
    for s in sessions.values():
        kv.open(s, [1, 2, 3], 0)
        kv.commit(s, [1, 2, 3])
    freed = {sid: s.cache for sid, s in sessions.items()}
    kv.open(sessions["c"], list(range(7)), 3, pinned={"a"})  # 3 + 3 + 7 = 13 > 10: b goes, a is pinned
    assert evicted == ["b"] and sessions["b"].cache is None and ("free",) in freed["b"].calls
    assert "a" in kv.store and kv.store.nbytes == 10 * BYTES_PER_TOKEN
    with pytest.raises(ResourceExhausted, match="no other session can be evicted"):
        kv.open(sessions["c"], list(range(8)), 7, pinned={"a"})


def test_a_failed_forward_resets_the_session():
    kv = manager()
    s = kv.session("a")
    kv.open(s, [1, 2, 3], 0)
    kv.fail(s)
    assert (s.tokens, s.nbytes, s.cache.length, kv.store.nbytes) == ([], 0, 0, 0)
    assert kv.reusable(s, [1, 2, 3, 4], recompute=1) == 0  # the next call re-prefills


def test_max_context_is_the_models_or_what_the_budget_holds():
    assert manager(max_tokens=1000).max_context == 64
    assert manager(max_tokens=20).max_context == 20
