"""Prompt-lookup drafting on small arrays."""

from __future__ import annotations

import random

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


def _scan(tokens, k, max_ngram, min_ngram):
    """Reference: the latest earlier match of the longest suffix n-gram, by a plain scan."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_packed_search_equals_a_plain_scan():
    # small alphabets make many matches; large ids make byte patterns that straddle two ids
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.choice([[1, 2], [0, 1, 2, 3], [256, 257, 65536, 65792, 1], list(range(40))])
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        max_ngram = rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        k = rng.randrange(1, 6)
        assert find_continuation(tokens, k, max_ngram, min_ngram) == _scan(tokens, k, max_ngram, min_ngram), (tokens, k)


def test_a_byte_match_across_two_ids_is_not_a_match():
    # 65536 = 00 00 01 00 and 1 = 01 00 00 00 (little-endian): [256, 0] packs bytes that contain
    # the pattern of [1] shifted by one byte; only whole ids count
    assert find_continuation([65536, 1, 9, 1], k=1, max_ngram=1) == [9]
    assert find_continuation([256, 0, 7, 1], k=1, max_ngram=1) == []
