"""The streaming detokenizer: pieces that add up to the whole decode, stop strings cut where they
start (never streamed), incomplete characters held back, and a per-step cost that does not grow
with the answer's length (in-process, the embedded model's byte-level BPE tokenizer)."""

from __future__ import annotations

import random

import pytest

from orchestrator.detokenizer import Detokenizer, _cut_at_stop
from specdec.models import load_tokenizer

TEXT = ("Speculative decoding — «vite» et sûr. 日本語のテキスト、絵文字 🚀🧪 too.\n"
        "def f(x):\n    return x ** 2  # ½ × π ≈ 1.57\n") * 6


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _stream(detok: Detokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 5)
        chunk = ids[i:i + n]
        i += n
        pieces.append(detok.push(chunk, final=i >= len(ids)))
    return pieces


@pytest.mark.parametrize("seed", range(4))
def test_pieces_add_up_to_the_whole(tok, seed):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    detok = Detokenizer(_decode(tok), [])
    pieces = _stream(detok, ids, random.Random(seed))
    assert "".join(pieces) == tok.decode(ids) == detok.text
    assert not any("\ufffd" in p for p in pieces)  # split characters waited for their last byte


@pytest.mark.parametrize("stop", [["π ≈"], ["return x"], ["🧪", "日本"], ["never there"]])
def test_stop_strings_cut_where_they_start(tok, stop):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    for seed in range(3):
        detok = Detokenizer(_decode(tok), stop)
        streamed = "".join(_stream(detok, ids, random.Random(seed)))
        assert streamed == _cut_at_stop(tok.decode(ids), stop)
        assert detok.stopped == (stop != ["never there"])


def test_each_step_decodes_a_window_not_the_whole_answer(tok):
    ids = tok(TEXT * 8, add_special_tokens=False).input_ids
    assert len(ids) > 2000
    sizes: list[int] = []

    def decode(x: list[int]) -> str:
        sizes.append(len(x))
        return tok.decode(x)

    detok = Detokenizer(decode, ["\n\n\n"])
    pieces = _stream(detok, ids, random.Random(0))
    assert "".join(pieces) == tok.decode(ids)
    # a step decodes its new tokens and the previous step's (at most 5 each; a few steps more while a
    # character's bytes are split across tokens), never everything so far (over 2,000 tokens here)
    assert max(sizes) <= 40, max(sizes)


@pytest.mark.parametrize("seed", range(4))
def test_the_tokens_of_a_text_cut_at_a_stop_string(tok, seed):
    """usage.completion_tokens after a stop string: the fewest generated tokens whose text holds
    what is returned, however many tokens the last (speculated) block brought past it."""
    rng = random.Random(seed)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    whole = _decode(tok)(ids)
    start = rng.randrange(40, len(whole) - 40)
    stop = whole[start:start + 3]
    detok = Detokenizer(_decode(tok), [stop])
    _stream(detok, ids, rng)
    returned = _cut_at_stop(detok.text, [stop])
    n = detok.tokens_covering(returned)
    assert _decode(tok)(ids[:n]).startswith(returned) and not _decode(tok)(ids[:n - 1]).startswith(returned)
    assert n < len(detok.ids)
