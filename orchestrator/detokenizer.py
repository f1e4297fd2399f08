"""Incremental detokenisation and stop strings: the text each step adds, held back while it could
still become a stop string, and the final text cut at the first one."""

from __future__ import annotations

from collections.abc import Callable


class Detokenizer:
    """Incremental text from growing token ids, holding back incomplete characters and any tail
    that could still become a stop string.

    Each push decodes only a window: the ids since the previous push's start (its text is known)
    and the new ones, and keeps the difference (the offsets scheme of TGI and vLLM). The window's
    first token gives the new ones their context (a SentencePiece word's leading space, a byte
    sequence split across tokens), so the pieces add up to what decoding everything at once gives,
    and a long answer costs the same per token as a short one (decoding everything each step was
    quadratic in the answer's length)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.decoded = ""  # text of ids[:read], as the windows gave it
        self.prefix = 0  # the window starts here: ids[prefix:read] decode to decoded's tail
        self.read = 0  # ids up to here are in decoded
        self.sent = 0  # characters of text already emitted
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        known = self.decode(self.ids[self.prefix:self.read])
        window = self.decode(self.ids[self.prefix:])
        # an incomplete multi-byte character decodes as U+FFFD: wait for the rest (unless this is the end)
        if len(window) > len(known) and (final or not window.endswith("\ufffd")):
            self.decoded += window[len(known):]
            self.prefix, self.read = self.read, len(self.ids)
        text = self.decoded
        end = len(text)
        for s in self.stop:
            pos = text.find(s, max(0, self.sent - len(s)))
            if 0 <= pos < end:
                end, final, self.stopped = pos, True, True
        if not final:
            end = min(end, max(self.sent, len(text) - self.holdback))
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta

    @property
    def text(self) -> str:
        return self.decode(self.ids)

    def final(self) -> tuple[str, int]:
        """The text to return and the generated ids it covers: everything, or where a stop string
        was met, the text before the first one and the fewest ids that hold it."""
        text = self.text
        if not self.stopped:
            return text, len(self.ids)
        text = _cut_at_stop(text, self.stop)
        return text, self.tokens_covering(text)

    def tokens_covering(self, text: str) -> int:
        """The fewest leading ids whose text begins with ``text`` (a prefix of :attr:`text`):
        a binary search, since once a prefix's text holds it, every longer prefix's does (a
        character cut in the middle of its bytes decodes as U+FFFD until its last byte)."""
        lo, hi = 0, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.decode(self.ids[:mid]).startswith(text):
                hi = mid
            else:
                lo = mid + 1
        return lo


def _cut_at_stop(text: str, stop: list[str]) -> str:
    positions = [p for p in (text.find(s) for s in stop if s) if p >= 0]
    return text[: min(positions)] if positions else text
