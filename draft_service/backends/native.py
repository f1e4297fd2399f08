"""Draft backend on specdec's own kernels: a quantised GGUF draft run by specdec.model.runner.

The same file the llamacpp backend runs (the embedded Q4_1 draft, or any model converted to GGUF),
loaded by specdec.model.gguf_model: its linears compute on the file's quantised blocks with AVX2 (AVX-512
VNNI for Q4_1 and Q8_0 where the CPU has it; specdec.native), everything else on the runner the
target uses, sessions on the engine's KV buffers; a draft token costs less than through llama.cpp
on the machines measured (docs/benchmarks.md, "The native draft backend"). Planning, prefix reuse,
crop and eviction are the transformers backend's, since the engine is the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from draft_service.backends.hf import TransformersProposer
from draft_service.proposer import DEFAULT_BUDGET, Proposer, budget_of
from specdec.engine.executor import Executor
from specdec.engine.planner import Budget
from specdec.engine.sessions import SessionStore
from specdec.model.gguf_convert import draft_gguf
from specdec.model.gguf_model import UnsupportedModel, file_type, load_gguf
from specdec.models import gguf_tokenizer_fingerprint, load_tokenizer
from specdec.native import kernels
from specdec.params import ModelInfo

if TYPE_CHECKING:
    from draft_service.settings import DraftSettings


class NativeProposer(TransformersProposer):
    backend = "native"

    def __init__(self, path: Path, store: SessionStore, max_draft_tokens: int, overlap_threads: int = 0,
                 budget: Budget = DEFAULT_BUDGET) -> None:
        Proposer.__init__(self, store, max_draft_tokens)
        self.overlap_threads = overlap_threads
        self.budget = budget
        if kernels() is None:
            raise UnsupportedModel("the native draft backend needs specdec.native, which is unavailable here (the log "
                                   "says why); use SPECDEC_DRAFT_BACKEND=llamacpp")
        model, quant, gguf = load_gguf(path, dequantize_blocks=False)
        self.lm = Executor(model, store, quant=quant)
        if self.lm.runner is None:
            raise UnsupportedModel(f"{path.name}: specdec's runner does not cover this model (the log says why); use "
                                   "SPECDEC_DRAFT_BACKEND=llamacpp")
        fingerprint, _, eos = gguf_tokenizer_fingerprint(gguf)
        self._info = ModelInfo(
            model_id=str(path), architecture=(model.config.architectures or [type(model).__name__])[0],
            vocab_size=self.lm.vocab_size, tokenizer_fingerprint=fingerprint, max_context=self.lm.max_context,
            dtype=file_type(gguf), device="cpu", backend=self.backend, max_draft_tokens=max_draft_tokens,
            eos_token_ids=sorted(eos),
        )
        self._eos = set(eos)
        self.path = path

    def grammar_tokenizer(self):
        return load_tokenizer(str(self.path))  # the one the file carries, once, for the first grammar

    @classmethod
    def from_settings(cls, settings: DraftSettings) -> NativeProposer:
        path = draft_gguf(settings.model, settings.target_model, settings.quant, settings.cache_dir)
        return cls(path, SessionStore.from_settings(settings), settings.max_draft_tokens, settings.overlap_threads,
                   budget_of(settings))
