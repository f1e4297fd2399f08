"""Draft backends, picked by name from :data:`BACKENDS` (``--backend``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draft_service.proposer import Proposer
    from draft_service.settings import DraftSettings

logger = logging.getLogger(__name__)


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


def native_unavailable(settings: DraftSettings) -> str | None:
    """None when the native backend serves this draft well, else why not (``auto`` then takes
    llamacpp): the draft's GGUF must be a Llama or GPT-2 file quantised to types specdec.native
    computes, and this CPU must run its vector kernels for them (AVX2, or AVX-512 VNNI for Q4_1 and
    Q8_0; the portable kernel is correct but far slower than llama.cpp). With those kernels a
    draft token costs less native than through llama.cpp (docs/benchmarks.md, "The native draft
    backend")."""
    from specdec.model.gguf_convert import draft_gguf
    from specdec.model.gguf_file import GGUFFile
    from specdec.model.gguf_model import FLOAT_TYPES, file_type, unsupported
    from specdec.native import QUANT_FORMATS, kernels

    if settings.gpu_layers:
        return f"gpu_layers={settings.gpu_layers} asks llama.cpp to put the draft on the GPU"
    native = kernels()
    if native is None:
        return "specdec.native is unavailable (see the log)"
    gguf = GGUFFile(draft_gguf(settings.model, settings.target_model, settings.quant, settings.cache_dir))
    why = unsupported(gguf)
    types = {tensor.type_name for tensor in gguf.tensors.values()}
    quantised = sorted(types & set(QUANT_FORMATS))
    if why is None and (not quantised or types - set(QUANT_FORMATS) - set(FLOAT_TYPES)):
        why = f"a {file_type(gguf)} file (specdec.native reads files quantised to {', '.join(QUANT_FORMATS)})"
    slow = [t for t in quantised if native.quant_isa(t) == "baseline"]
    if why is None and slow:
        why = f"this CPU has no AVX2 (specdec.native's {', '.join(slow)} linears would run the portable kernel)"
    return why


def resolve_backend(settings: DraftSettings) -> str:
    """The backend ``settings.backend`` names; for ``auto``, native where :func:`native_unavailable`
    finds nothing against it, else llamacpp (the reason logged)."""
    if settings.backend != "auto":
        return settings.backend
    why = native_unavailable(settings)
    if why is None:
        logger.info("draft backend auto: native (the GGUF draft on specdec's kernels)")
        return "native"
    logger.info("draft backend auto: llamacpp, not native: %s", why)
    return "llamacpp"


def create_proposer(settings: DraftSettings, backend: str | None = None) -> Proposer:
    """The proposer of ``backend`` (default: ``settings.backend`` resolved, see
    :func:`resolve_backend`). When ``auto`` chose native and the file still does not load (a
    tensor the runner has no place for, such as attention biases), llama.cpp serves it instead."""
    from specdec.model.gguf_model import UnsupportedModel

    backend = backend or resolve_backend(settings)
    if settings.backend == "auto" and backend == "native":
        try:
            return BACKENDS["native"](settings)
        except UnsupportedModel as exc:
            logger.warning("draft backend auto: native cannot load this draft (%s); using llamacpp", exc)
            backend = "llamacpp"
    return BACKENDS[backend](settings)
