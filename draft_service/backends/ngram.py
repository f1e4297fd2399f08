"""Model-free prompt-lookup drafting: propose what followed the latest earlier occurrence of the
sequence's last n-gram (Saxena 2023, "prompt lookup decoding"; vLLM's ngram proposer).

Cheap and surprisingly good when the output copies from the prompt (summaries, code edits,
extraction). Its "distribution" is one-hot on the proposed token, which keeps lossless sampling
exact: a rejected token is then resampled from the target's p with that token removed.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from draft_service.proposer import Proposal, Proposer, StopReason
from specdec.engine.sessions import SessionStore
from specdec.params import ModelInfo

if TYPE_CHECKING:
    from draft_service.settings import DraftSettings

_WORD = array("I").itemsize  # bytes per packed id (ids are below 2**32)


def find_continuation(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram
    (n from ``max_ngram`` down to ``min_ngram``); [] when no suffix n-gram occurred before.

    The search runs over the ids packed as 4-byte words (``bytes.rfind``, in C): a model draft
    looks up at every pass, and a Python scan of a long context would cost a good share of one.
    """
    length = len(tokens)
    if length < 2 or k <= 0:
        return []
    data = array("I", tokens).tobytes()
    # Latest match first: recent context predicts best. A match must leave at least one token
    # after it, which also excludes the suffix itself.
    limit = (length - 1) * _WORD
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = data[(length - n) * _WORD :]
        end = limit
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % _WORD == 0:  # not a match straddling two ids
                start = at // _WORD + n
                return tokens[start : start + k]
            end = at + len(pattern) - 1
    return []


class NgramProposer(Proposer):
    backend = "ngram"

    def __init__(self, store: SessionStore, max_draft_tokens: int, *, max_ngram: int, min_ngram: int,
                 vocab_size: int, max_context: int) -> None:
        super().__init__(store, max_draft_tokens)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._info = ModelInfo(
            model_id=f"ngram(n={min_ngram}..{max_ngram})",
            architecture="prompt-lookup",
            vocab_size=vocab_size,
            tokenizer_fingerprint="",  # tokenizer-agnostic
            max_context=max_context,
            dtype="none",
            device="cpu",
            backend=self.backend,
            max_draft_tokens=max_draft_tokens,
        )

    @classmethod
    def from_settings(cls, settings: DraftSettings) -> NgramProposer:
        return cls(SessionStore.from_settings(settings), settings.max_draft_tokens, max_ngram=settings.ngram_max,
                   min_ngram=settings.ngram_min, vocab_size=settings.ngram_vocab_size,
                   max_context=settings.ngram_max_context)

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    def _propose(self, session_id, tokens, k, threshold, sampling, return_distributions) -> Proposal:
        draft = find_continuation(tokens, k, self.max_ngram, self.min_ngram)
        # No cache to fill: every request token counts as already processed (no catch-up cost).
        if not draft:
            return Proposal([], [], StopReason.NO_CANDIDATE, cached_tokens=len(tokens))
        dists = [([t], [1.0]) for t in draft] if return_distributions else []
        reason = StopReason.MAX_TOKENS if len(draft) == k else StopReason.NO_CANDIDATE
        return Proposal(draft, [1.0] * len(draft), reason, dists, cached_tokens=len(tokens))
