"""Draft backends, picked by name from :data:`BACKENDS` (``--backend``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draft_service.proposer import Proposer
    from draft_service.settings import DraftSettings


def _transformers(settings: DraftSettings) -> Proposer:
    from draft_service.backends.hf import TransformersProposer

    return TransformersProposer.from_settings(settings)


def _llamacpp(settings: DraftSettings) -> Proposer:
    from draft_service.backends.llamacpp import LlamaCppProposer

    return LlamaCppProposer.from_settings(settings)


def _native(settings: DraftSettings) -> Proposer:
    from draft_service.backends.native import NativeProposer

    return NativeProposer.from_settings(settings)


def _ngram(settings: DraftSettings) -> Proposer:
    from draft_service.backends.ngram import NgramProposer

    return NgramProposer.from_settings(settings)


# Imports are deferred so a backend's heavy dependency loads only when it is chosen.
BACKENDS: dict[str, Callable[[DraftSettings], Proposer]] = {
    "transformers": _transformers,
    "llamacpp": _llamacpp,
    "native": _native,
    "ngram": _ngram,
}


def create_proposer(settings: DraftSettings) -> Proposer:
    return BACKENDS[settings.backend](settings)
