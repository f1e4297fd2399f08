"""Prompt-lookup drafting on small arrays."""

from __future__ import annotations

from draft_service.backends.ngram import find_continuation


def test_longest_suffix_match_wins():
    # suffix [2, 3] occurred at 1..2 followed by 4, 5
    assert find_continuation([1, 2, 3, 4, 5, 9, 2, 3], k=2) == [4, 5]


def test_latest_match_is_used():
    # [7] occurs twice before the end; the latest one (followed by 8) wins over the earlier (followed by 1)
    assert find_continuation([7, 1, 7, 8, 7], k=1, max_ngram=1) == [8]


def test_falls_back_to_shorter_ngram():
    assert find_continuation([5, 6, 1, 9, 6], k=3, max_ngram=3) == [1, 9, 6]


def test_no_match_and_short_inputs():
    assert find_continuation([1, 2, 3, 4], k=3) == []
    assert find_continuation([1], k=3) == []


def test_continuation_is_capped_at_k_and_by_sequence_end():
    assert find_continuation([1, 2, 3, 1], k=2) == [2, 3]
    assert find_continuation([4, 4], k=5) == [4]
