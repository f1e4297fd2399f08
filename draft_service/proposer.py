"""The proposer interface every draft backend implements, the request checks they share, and the
drafting state machine that lets a backend draft for many sessions in one batched step.

A Propose call becomes a :class:`ProposeJob`. Drafting k tokens takes k forward steps; a batched
backend's :meth:`Proposer.step` advances every job waiting by one token in ONE forward pass (the
first step of a job also catches its cache up with the tokens it missed), so B sessions drafting
k tokens cost k batched passes, not B x k single ones. Jobs finish independently (early stop on
low confidence or EOS) and new ones join at the next step.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.engine.compute import PENDING, CpuAccounted, StepResult, run_alone
from specdec.engine.executor import ForwardRequest
from specdec.engine.kv import KVManager
from specdec.engine.planner import Budget, Need, Slot, plan
from specdec.engine.requests import validate_context, validate_session_id, validate_tokens
from specdec.engine.sessions import Session, SessionsFull, SessionStore
from specdec.errors import Cancelled, InvalidArgument, ResourceExhausted
from specdec.params import ModelInfo
from specdec.sampling import STREAM_DRAFT, Sampling, draft_seed, probabilities, process, proposal, sample, to_sparse

logger = logging.getLogger(__name__)


class StopReason(enum.Enum):
    """Why drafting stopped (mirrors DraftStopReason in the proto)."""

    MAX_TOKENS = 1
    LOW_CONFIDENCE = 2
    EOS = 3
    CONTEXT_LIMIT = 4
    NO_CANDIDATE = 5


@dataclass
class ProposeJob(CpuAccounted):
    """A validated Propose request, ready for the compute thread."""

    session_id: str
    tokens: list[int]  # [n] committed tokens
    max_draft_tokens: int
    confidence_threshold: float
    sampling: Sampling
    return_distributions: bool
    prepare_ns: int = 0
    yield_cores: bool = False  # the target computes on this host meanwhile: draft on overlap_threads
    issued: int | None = None  # the store's stamp when the call arrived: a later Release wins (SessionStore)
    queue_ns: int = 0  # set by the scheduler: wait before the first step
    # drafting state, advanced by the backend's steps
    k: int = 0  # tokens to draft at most (max_draft_tokens, or less near the end of the context)
    drafted: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    distributions: list[tuple[list[int], list[float]]] = field(default_factory=list)
    stop_reason: StopReason | None = None
    cached_tokens: int = -1  # leading request tokens found in the cache at the first step
    started_ns: int = 0
    steps: int = 0
    sessions_seen: int = 0  # sum over its steps of the sessions in each
    guess_len: int = 0  # backends that guess ahead by lookup: tokens to guess next (0: not yet)
    grammars: Any = None  # the proposer's specdec.grammar.Grammars, for a request with a grammar
    grammar: Any = None  # the session's GrammarState while drafting under a grammar

    def begin(self, max_context: int) -> bool:
        """Start drafting (once); False when there is no room to draft at all."""
        if not self.started_ns:
            self.started_ns = time.perf_counter_ns()
            # Leave room for the target's next token after the draft.
            self.k = max(0, min(self.max_draft_tokens, max_context - len(self.tokens) - 1))
            if self.k == 0:
                self.stop_reason = StopReason.CONTEXT_LIMIT
            elif self.sampling.grammar and self.grammars is not None:
                s = self.sampling
                try:
                    self.grammar = self.grammars.state(self.session_id, s.grammar, s.output_start, self.tokens)
                except Exception:  # noqa: BLE001 - this job drafts nothing; the step's others go on
                    logger.exception("session %s: the grammar's matcher failed; no draft", self.session_id)
                    self.grammar = None
                if self.grammar is None:  # a sequence the grammar refuses (a pre-draft past a rejection)
                    self.k, self.stop_reason = 0, StopReason.NO_CANDIDATE
        return self.k > 0

    def probabilities(self, logits):
        """The draft's transformed distribution [V] from its ``logits`` [V]: masked by the grammar
        when the request has one, processed (penalties, logit_bias) as the target processes this
        position, then transformed: q' is what the draft samples from and reports."""
        if self.grammar is not None:
            from specdec.grammar import apply

            try:
                logits = apply(logits, self.grammar.mask())
            except Exception:  # noqa: BLE001 - drafting on unconstrained is still lossless (the target masks)
                logger.exception("session %s: the grammar's mask failed; drafting unconstrained", self.session_id)
                self.grammar = None
        if self.sampling.processes:  # penalties and logit_bias: what the target applies at this position
            logits = process(logits[None], self.sampling, self.tokens + self.drafted)[0]
        return probabilities(logits, self.sampling)

    def advance(self, probs, eos: set[int], batch_sessions: int) -> bool:
        """Choose the next draft token from the draft's transformed distribution ``probs`` [V];
        True when drafting is over (the stop reason is set)."""
        i = len(self.drafted)
        if self.sampling.greedy:
            token = int(probs.argmax())
        else:
            probs = proposal(probs)  # at most DRAFT_SUPPORT tokens: what the target then verifies against
            # keyed by the round too (its start): a redraft after a rejection draws afresh
            token = sample(probs, draft_seed(self.sampling.seed, len(self.tokens)), len(self.tokens) + i,
                              STREAM_DRAFT)
        self.drafted.append(token)
        self.confidences.append(float(probs[token]))
        if self.grammar is not None and not self.grammar.advance(token):  # cannot happen: drawn under its mask
            self.stop_reason = StopReason.NO_CANDIDATE
        if self.return_distributions:
            self.distributions.append(to_sparse(probs))
        self.steps += 1
        self.sessions_seen += batch_sessions
        if self.stop_reason is not None:
            pass
        elif token in eos:
            self.stop_reason = StopReason.EOS
        elif self.confidences[-1] < self.confidence_threshold:
            self.stop_reason = StopReason.LOW_CONFIDENCE
        elif len(self.drafted) >= self.k:
            self.stop_reason = StopReason.MAX_TOKENS if self.k == self.max_draft_tokens else StopReason.CONTEXT_LIMIT
        return self.stop_reason is not None

    def proposal(self) -> Proposal:
        return Proposal(
            self.drafted, self.confidences, self.stop_reason or StopReason.MAX_TOKENS, self.distributions,
            cached_tokens=max(self.cached_tokens, 0),
            compute_ns=time.perf_counter_ns() - self.started_ns + self.prepare_ns,
            batch_sessions=self.sessions_seen / self.steps if self.steps else 1.0,
            steps=self.steps,
            queue_ns=self.queue_ns,
        )


@dataclass
class Proposal:
    """Result of one Propose call."""

    tokens: list[int]  # [n] draft token ids, n <= k
    confidences: list[float]  # [n] draft probability of each token
    stop_reason: StopReason
    # [n] sparse draft distributions (ids, probs), only for sampling requests that asked for them.
    distributions: list[tuple[list[int], list[float]]] = field(default_factory=list)
    cached_tokens: int = 0
    compute_ns: int = 0
    batch_sessions: float = 1.0  # mean sessions per batched step it took part in
    steps: int = 0  # forward steps it took part in
    queue_ns: int = 0
    step_cpu_ns: int = 0  # set by the scheduler: mean process CPU time per step it was in


class Proposer(abc.ABC):
    """A draft backend. Model backends implement :meth:`step` (batched); simple ones implement
    :meth:`_propose` (one job at a time). :meth:`prepare` validates first."""

    backend: str = ""

    def __init__(self, store: SessionStore, max_draft_tokens: int) -> None:
        self.store = store
        self.max_draft_tokens = max_draft_tokens

    @property
    @abc.abstractmethod
    def model_info(self) -> ModelInfo:
        """Static description of the model (sessions/KV fields are filled by :meth:`info`)."""

    def info(self) -> ModelInfo:
        info = self.model_info
        info.sessions = len(self.store)
        info.kv_bytes = self.store.nbytes
        info.kv_budget_bytes = self.store.max_bytes
        return info

    def release(self, session_id: str) -> bool:
        validate_session_id(session_id)
        if self._grammars is not None:
            self._grammars.release(session_id)
        return self.store.release(session_id)

    _grammars: Any = None
    _grammars_lock = threading.Lock()

    @property
    def grammars(self) -> Any:
        """The matchers of the sessions drafting under a grammar (specdec.grammar), made on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                from specdec.grammar import Grammars

                info = self.model_info
                self._grammars = Grammars(self.grammar_tokenizer, info.vocab_size, info.eos_token_ids)
        return self._grammars

    def grammar_tokenizer(self) -> Any:
        """The model's transformers tokenizer, for grammars (None: this backend drafts unconstrained)."""
        return None

    def propose(self, *args, **kwargs) -> Proposal:
        """Propose up to ``max_draft_tokens`` tokens after ``tokens`` on the calling thread (the
        arguments of :meth:`prepare`); drafting stops early at the first token whose confidence is
        below ``confidence_threshold`` (that token is included)."""
        return self.run(self.prepare(*args, **kwargs))

    def prepare(
        self,
        session_id: str,
        tokens: Sequence[int],
        max_draft_tokens: int,
        confidence_threshold: float = 0.0,
        sampling: Sampling = Sampling(),
        return_distributions: bool = False,
        yield_cores: bool = False,
    ) -> ProposeJob:
        """Validate a Propose request (raises InvalidArgument) without touching the model, so a
        malformed or oversized request never costs the compute thread any time."""
        t0 = time.perf_counter_ns()
        issued = self.store.stamp()  # first: a Release handled after this point wins over this call
        info = self.model_info
        validate_session_id(session_id)
        validate_context(len(tokens), info.max_context, "tokens")
        tokens = list(tokens)
        validate_tokens(tokens, info.vocab_size)
        if not 1 <= max_draft_tokens <= self.max_draft_tokens:
            raise InvalidArgument(f"max_draft_tokens must be in [1, {self.max_draft_tokens}], got {max_draft_tokens}")
        if not 0.0 <= confidence_threshold <= 1.0:
            raise InvalidArgument(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
        sampling.validate()
        validate_tokens([t for t, _ in sampling.logit_bias], info.vocab_size, what="logit_bias", allow_empty=True)
        grammars = None
        if sampling.grammar and type(self).grammar_tokenizer is not Proposer.grammar_tokenizer:
            if sampling.output_start > len(tokens):
                raise InvalidArgument(f"output_start {sampling.output_start} is past the {len(tokens)} tokens")
            grammars = self.grammars
            grammars.check(sampling.grammar)  # here, off the model's thread (the first loads the tokenizer)
        return ProposeJob(session_id, tokens, max_draft_tokens, confidence_threshold, sampling,
                          return_distributions and not sampling.greedy, time.perf_counter_ns() - t0, yield_cores,
                          issued, grammars=grammars)

    def run(self, job: ProposeJob) -> Proposal:
        """Draft for one validated request on its own (step after step)."""
        return run_alone(self, job)

    def step(self, jobs: list[ProposeJob]) -> StepResult:
        """Advance every job; the default drafts each job whole with :meth:`_propose` (backends
        without a model to batch, such as n-gram)."""
        outcomes: list = []
        for job in jobs:
            try:
                if not job.begin(self.model_info.max_context):
                    outcomes.append(job.proposal())
                    continue
                proposal = self._propose(job.session_id, job.tokens, job.k, job.confidence_threshold, job.sampling,
                                         job.return_distributions)
                if proposal.stop_reason is StopReason.MAX_TOKENS and job.k < job.max_draft_tokens:
                    proposal.stop_reason = StopReason.CONTEXT_LIMIT
                proposal.compute_ns = time.perf_counter_ns() - job.started_ns + job.prepare_ns
                proposal.queue_ns = job.queue_ns
                outcomes.append(proposal)
            except Exception as exc:  # noqa: BLE001 - that job's error
                outcomes.append(exc)
        return StepResult(outcomes)

    def _propose(
        self,
        session_id: str,
        tokens: list[int],
        k: int,
        threshold: float,
        sampling: Sampling,
        return_distributions: bool,
    ) -> Proposal:
        """Propose up to ``k`` tokens (validated: 1 <= k, fits the context)."""
        raise NotImplementedError


# A draft step's rows at the services' default settings (max_batch_rows, shared_prefill_rows)
DEFAULT_BUDGET = Budget.of(256, 64, 1)


def budget_of(settings: Any) -> Budget:
    """The planner's budget of a draft service's settings (``max_batch_rows``, ``shared_prefill_rows``)."""
    return Budget.of(settings.max_batch_rows, settings.shared_prefill_rows, 1)


@dataclass
class Planned:
    """A job's part of a draft step: its sequence so far (request tokens + drafted), the first
    ``cached`` in its cache, computed up to ``end``; ``logits`` 0 for a prefill chunk (the job does
    not advance this step)."""

    index: int  # of the job in the step's list
    session: Session
    sequence: list[int]
    cached: int
    end: int
    logits: int
    guess: list[int] = field(default_factory=list)  # tokens decoded ahead by lookup (llama.cpp backend)

    def request(self) -> ForwardRequest:
        tokens = self.sequence if self.end == len(self.sequence) else self.sequence[:self.end]
        return ForwardRequest(self.session, tokens, self.logits)


@dataclass
class DraftPlan:
    """A draft step's plan (see specdec.engine.planner): ``shared`` in one pass, each of ``alone``
    (sampling jobs) in a pass of its own; ``outcomes``: per job, PENDING or already decided."""

    shared: list[Planned]
    alone: list[Planned]
    outcomes: list

    @property
    def planned(self) -> list[Planned]:
        return self.shared + self.alone


def plan_drafts(jobs: list[ProposeJob], kv: KVManager, budget: Budget, max_context: int) -> DraftPlan:
    """Plan a batched draft step (under the model's lock): each job (the first call of each session)
    advances by one draft token, and its first step also computes the tokens its cache missed, in
    chunks when they pass the budget. A job with no room to draft is answered at once; one whose
    session was released since the call was made gets Cancelled; one the store has no room for
    this step (every session taken by it) waits for the next."""
    seen: set[str] = set()
    taken: set[str] = set()  # sessions this step computes for
    outcomes: list = [PENDING] * len(jobs)
    sessions: dict[int, tuple[Session, list[int], int]] = {}  # job index -> (session, sequence, cached)
    needs: list[Need] = []
    for i, job in enumerate(jobs):
        if job.session_id in seen:
            continue  # a second call on one session waits for the next step
        seen.add(job.session_id)
        if not job.begin(max_context):
            outcomes[i] = job.proposal()
            continue
        try:
            session = kv.session(job.session_id, job.issued, keep=taken)
        except (Cancelled, ResourceExhausted) as exc:  # released since the call was made; no slot
            outcomes[i] = exc
            continue
        except SessionsFull:  # never evicting a session of this step: the next step
            continue
        taken.add(job.session_id)
        sequence = job.tokens + job.drafted
        sessions[i] = (session, sequence, kv.reusable(session, sequence, 1))
        needs.append(Need(i, sessions[i][2], len(sequence), 1, alone=not job.sampling.greedy))
    step = plan(needs, budget)

    def planned(slot: Slot) -> Planned:
        return Planned(slot.index, *sessions[slot.index], slot.end, slot.logits)

    return DraftPlan([planned(s) for s in step.shared], [planned(s) for s in step.alone], outcomes)
