"""Draft backend on any transformers causal LM (``distilgpt2`` is the mission's draft)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draft_service.proposer import ProposeJob, Proposer, batch_of_distinct_sessions
from specdec.engine.compute import StepResult
from specdec.engine.executor import Executor, ForwardRequest, torch_threads
from specdec.engine.requests import eos_ids
from specdec.engine.sessions import SessionsFull, SessionStore
from specdec.errors import Cancelled
from specdec.models import LoadedModel, load_hf, tokenizer_fingerprint
from specdec.params import ModelInfo

if TYPE_CHECKING:
    from draft_service.settings import DraftSettings


class TransformersProposer(Proposer):
    backend = "transformers"

    def __init__(self, loaded: LoadedModel, store: SessionStore, max_draft_tokens: int,
                 overlap_threads: int = 0) -> None:
        super().__init__(store, max_draft_tokens)
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
        return cls(loaded, SessionStore.from_settings(settings), settings.max_draft_tokens, settings.overlap_threads)

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    def grammar_tokenizer(self):
        return self.loaded.tokenizer

    def release(self, session_id: str) -> bool:
        with self.lm.lock:
            return super().release(session_id)

    def step(self, jobs: list[ProposeJob]) -> StepResult:
        """One batched forward: every job (one per session) advances by one draft token; a job's
        first step also computes the tokens its cache missed."""
        chosen, outcomes = batch_of_distinct_sessions(jobs)
        active, requests = [], []
        taken: set[str] = set()
        with self.lm.lock:
            for i in chosen:
                job = jobs[i]
                if not job.begin(self.lm.max_context):
                    outcomes[i] = job.proposal()
                    continue
                try:
                    session = self.lm.session(job.session_id, job.issued, keep=taken)
                except Cancelled as exc:  # released since the call was made
                    outcomes[i] = exc
                    continue
                except SessionsFull:  # never evicting a session of this step: the next step
                    continue
                taken.add(job.session_id)
                active.append(i)
                requests.append(ForwardRequest(session, job.tokens + job.drafted, 1))
            # Greedy jobs share a pass; each sampling job runs alone, so a seeded request's draft
            # probabilities (and so its output) never depend on the batch around it. The sampling
            # passes of one step hold SAMPLING_ROWS_PER_STEP rows (one pass at least, in order);
            # the others wait for the next step (all of them at once took seconds a step).
            active, requests = _within_budget(active, requests, jobs)
            greedy = [n for n, i in enumerate(active) if jobs[i].sampling.greedy]
            groups = ([greedy] if greedy else []) + [[n] for n, i in enumerate(active) if not jobs[i].sampling.greedy]
            results: list = [None] * len(active)
            with torch_threads(self.overlap_threads if any(jobs[i].yield_cores for i in active) else 0):
                for group in groups:
                    for n, result in zip(group, self.lm.forward_batch([requests[n] for n in group]), strict=True):
                        results[n] = result
        sessions = sum(1 for r in results if not isinstance(r, BaseException))
        rows = sum(r.rows for r in results if not isinstance(r, BaseException))
        for i, result in zip(active, results, strict=True):
            job = jobs[i]
            if isinstance(result, BaseException):
                outcomes[i] = result
                continue
            if job.cached_tokens < 0:
                job.cached_tokens = result.cached
            if job.advance(job.probabilities(result.logits[-1]), self._eos, sessions):
                outcomes[i] = job.proposal()
        return StepResult(outcomes, sessions, rows)


# Rows the sampling passes of one draft step may hold, past which they wait for the next step
SAMPLING_ROWS_PER_STEP = 256


def _within_budget(active: list[int], requests: list[ForwardRequest], jobs: list[ProposeJob]
                   ) -> tuple[list[int], list[ForwardRequest]]:
    """``active`` and ``requests`` less the sampling jobs past this step's budget (their outcome
    stays PENDING: they run in a later step)."""
    from specdec.engine.sessions import common_prefix_len

    budget, kept = SAMPLING_ROWS_PER_STEP, []
    for n, i in enumerate(active):
        if not jobs[i].sampling.greedy:
            request = requests[n]
            rows = len(request.tokens) - common_prefix_len(request.session.tokens, request.tokens)
            if budget < rows and budget < SAMPLING_ROWS_PER_STEP:
                budget = -1  # in order: a later, smaller one does not overtake it
                continue
            budget -= rows
        kept.append(n)
    return [active[n] for n in kept], [requests[n] for n in kept]
