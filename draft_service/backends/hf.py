"""Draft backend on any transformers causal LM (``distilgpt2`` is the mission's draft)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draft_service.proposer import DEFAULT_BUDGET, ProposeJob, Proposer, budget_of, plan_drafts
from specdec.engine.compute import StepResult
from specdec.engine.executor import Executor
from specdec.engine.planner import Budget
from specdec.engine.requests import eos_ids
from specdec.engine.sessions import SessionStore
from specdec.models import LoadedModel, load_hf, tokenizer_fingerprint
from specdec.params import ModelInfo

if TYPE_CHECKING:
    from draft_service.settings import DraftSettings


class TransformersProposer(Proposer):
    backend = "transformers"

    def __init__(self, loaded: LoadedModel, store: SessionStore, max_draft_tokens: int,
                 overlap_threads: int = 0, budget: Budget = DEFAULT_BUDGET) -> None:
        super().__init__(store, max_draft_tokens)
        self.budget = budget
        self.overlap_threads = overlap_threads  # torch threads of a step that yields cores (0: all)
        self.loaded = loaded
        self.lm = Executor(loaded.model, store)
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
    def from_settings(cls, settings: DraftSettings) -> TransformersProposer:
        loaded = load_hf(settings.model, settings.dtype, settings.device, settings.cache_dir)
        return cls(loaded, SessionStore.from_settings(settings), settings.max_draft_tokens, settings.overlap_threads,
                   budget_of(settings))

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    def grammar_tokenizer(self):
        return self.loaded.tokenizer

    def release(self, session_id: str) -> bool:
        with self.lm.lock:
            return super().release(session_id)

    def step(self, jobs: list[ProposeJob]) -> StepResult:
        """One batched step (see draft_service.proposer.plan_drafts): greedy jobs share a pass; each
        sampling job runs alone, so a seeded request's draft probabilities (and so its output) never
        depend on the batch around it."""
        with self.lm.lock:
            step = plan_drafts(jobs, self.lm.kv, self.budget, self.lm.max_context)
            threads = self.overlap_threads if any(jobs[p.index].yield_cores for p in step.planned) else 0
            results = self.lm.run([p.request() for p in step.shared], [p.request() for p in step.alone], threads)
        ran = [r for r in results if not isinstance(r, BaseException)]
        sessions, rows = len(ran), sum(r.rows for r in ran)
        for p, result in zip(step.planned, results, strict=True):
            job = jobs[p.index]
            if isinstance(result, BaseException):
                step.outcomes[p.index] = result
                continue
            if job.cached_tokens < 0:
                job.cached_tokens = result.cached
            if p.logits and job.advance(job.probabilities(result.logits[-1]), self._eos, sessions):
                step.outcomes[p.index] = job.proposal()
        return StepResult(step.outcomes, sessions, rows)
