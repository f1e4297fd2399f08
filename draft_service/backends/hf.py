"""Draft backend on any transformers causal LM (``distilgpt2`` is the mission's draft)."""

from __future__ import annotations

from draft_service.proposer import Proposal, Proposer, draft_loop
from specdec import sampling as sm
from specdec.engine import CachedCausalLM, ModelInfo, eos_ids
from specdec.models import LoadedModel, load_hf, tokenizer_fingerprint
from specdec.sessions import SessionStore


class TransformersProposer(Proposer):
    backend = "transformers"

    def __init__(self, loaded: LoadedModel, store: SessionStore, max_draft_tokens: int) -> None:
        super().__init__(store, max_draft_tokens)
        self.loaded = loaded
        self.lm = CachedCausalLM(loaded.model, store)
        config = loaded.model.config
        self._info = ModelInfo(
            model_id=loaded.model_id,
            architecture=(config.architectures or [type(loaded.model).__name__])[0],
            vocab_size=self.lm.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            max_context=self.lm.max_context,
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            device=str(self.lm.device),
            backend=self.backend,
            max_draft_tokens=max_draft_tokens,
            eos_token_ids=eos_ids(config, loaded.tokenizer, getattr(loaded.model, "generation_config", None)),
        )
        self._eos = set(self._info.eos_token_ids)

    @classmethod
    def from_settings(cls, settings) -> TransformersProposer:
        loaded = load_hf(settings.model, settings.dtype, settings.device, settings.cache_dir)
        store = SessionStore(settings.max_sessions, settings.kv_budget_bytes, settings.session_ttl_s)
        return cls(loaded, store, settings.max_draft_tokens)

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    def release(self, session_id: str) -> bool:
        with self.lm.lock:
            return super().release(session_id)

    def _propose(self, session_id, tokens, k, threshold, sampling, return_distributions) -> Proposal:
        with self.lm.lock:
            session = self.lm.session(session_id)
            cached_first = -1

            def next_probs(drafted: list[int]):
                nonlocal cached_first
                logits, cached = self.lm.extend(session, tokens + drafted)
                if cached_first < 0:
                    cached_first = cached
                return sm.probabilities(logits[-1], sampling)

            proposal = draft_loop(next_probs, k, len(tokens), threshold, sampling, self._eos, return_distributions)
        proposal.cached_tokens = cached_first
        return proposal
