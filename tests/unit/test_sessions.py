"""SessionStore: LRU by count, byte budget, idle TTL, release (and calls made before it)."""

from __future__ import annotations

import time

import pytest

from specdec.engine import sessions
from specdec.engine.sessions import SessionStore, common_prefix_len
from specdec.errors import Cancelled, ResourceExhausted


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5, 6], [5, 6]) == 2


def test_count_bound_evicts_least_recently_used():
    evicted = []
    store = SessionStore(max_sessions=2, max_bytes=1000, ttl_s=0, on_evict=lambda s: evicted.append(s.session_id))
    store.get_or_create("a", object)
    store.get_or_create("b", object)
    store.get_or_create("a", object)  # a is now the most recent
    store.get_or_create("c", object)
    assert evicted == ["b"]
    assert "a" in store and "c" in store and "b" not in store


def test_byte_budget_evicts_others_then_refuses():
    store = SessionStore(max_sessions=10, max_bytes=100, ttl_s=0)
    a = store.get_or_create("a", object)
    store.reserve(a, 60)
    store.update(a, [1] * 6, 60)
    b = store.get_or_create("b", object)
    store.reserve(b, 50)  # 60 + 50 > 100: a goes
    assert "a" not in store and store.evictions == 1
    store.update(b, [1] * 5, 50)
    with pytest.raises(ResourceExhausted, match="over the budget"):
        store.reserve(b, 51)  # b alone would need 101 bytes
    assert "b" in store  # refusing does not drop the session


def test_idle_sessions_expire():
    store = SessionStore(max_sessions=10, max_bytes=100, ttl_s=0.05)
    store.get_or_create("old", object)
    time.sleep(0.1)
    store.get_or_create("new", object)
    assert "old" not in store and "new" in store


def test_release():
    released = []
    store = SessionStore(max_sessions=10, max_bytes=100, ttl_s=0, on_evict=lambda s: released.append(s.session_id))
    store.get_or_create("a", object)
    assert store.release("a") is True
    assert store.release("a") is False
    assert released == ["a"] and len(store) == 0


def test_a_call_made_before_the_release_does_not_recreate_the_session():
    store = SessionStore(max_sessions=10, max_bytes=100, ttl_s=0)
    before = store.stamp()
    store.get_or_create("a", object, before)
    store.release("a")
    with pytest.raises(Cancelled, match="released after this call was made"):
        store.get_or_create("a", object, before)
    assert "a" not in store
    # released while nothing was held yet: the call queued before it loses all the same
    queued = store.stamp()
    store.release("b")
    with pytest.raises(Cancelled):
        store.get_or_create("b", object, queued)
    # a call made after the Release, or one without a stamp, is a new session
    store.get_or_create("a", object, store.stamp())
    store.get_or_create("b", object)
    assert "a" in store and "b" in store
    # and once re-created, even the older call finds it (it no longer brings anything back)
    assert store.get_or_create("a", object, before).session_id == "a"
    assert store.stamp() > queued > before


def test_released_ids_are_remembered_within_a_bound_oldest_forgotten_first(monkeypatch):
    monkeypatch.setattr(sessions, "RELEASED_REMEMBERED", 3)
    store = SessionStore(max_sessions=10, max_bytes=100, ttl_s=0)
    before = store.stamp()
    for sid in ["a", "b", "c", "a", "d"]:  # "a" released again: now the most recent but one
        store.release(sid)
    assert list(store._released) == ["c", "a", "d"]
    store.get_or_create("b", object, before)  # forgotten: created as any unknown id
    with pytest.raises(Cancelled):
        store.get_or_create("a", object, before)
