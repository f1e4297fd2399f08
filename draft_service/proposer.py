"""The proposer interface every draft backend implements, and the request checks they share."""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec import sampling as sm
from specdec.engine import ModelInfo, validate_context, validate_session_id, validate_tokens
from specdec.errors import InvalidArgument
from specdec.sessions import SessionStore


class StopReason(enum.Enum):
    """Why drafting stopped (mirrors DraftStopReason in the proto)."""

    MAX_TOKENS = 1
    LOW_CONFIDENCE = 2
    EOS = 3
    CONTEXT_LIMIT = 4
    NO_CANDIDATE = 5


@dataclass
class ProposeJob:
    """A validated Propose request, ready for the compute thread."""

    session_id: str
    tokens: list[int]  # [n] committed tokens
    max_draft_tokens: int
    confidence_threshold: float
    sampling: sm.Sampling
    return_distributions: bool
    prepare_ns: int = 0


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


class Proposer(abc.ABC):
    """A draft backend. Subclasses implement :meth:`_propose`; :meth:`propose` validates first."""

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
        return self.store.release(session_id)

    def propose(
        self,
        session_id: str,
        tokens: Sequence[int],
        max_draft_tokens: int,
        confidence_threshold: float = 0.0,
        sampling: sm.Sampling = sm.Sampling(),
        return_distributions: bool = False,
    ) -> Proposal:
        """Propose up to ``max_draft_tokens`` tokens after ``tokens``; stop early at the first token
        whose confidence is below ``confidence_threshold`` (that token is included)."""
        return self.run(self.prepare(session_id, tokens, max_draft_tokens, confidence_threshold, sampling,
                                     return_distributions))

    def prepare(
        self,
        session_id: str,
        tokens: Sequence[int],
        max_draft_tokens: int,
        confidence_threshold: float = 0.0,
        sampling: sm.Sampling = sm.Sampling(),
        return_distributions: bool = False,
    ) -> ProposeJob:
        """Validate a Propose request (raises InvalidArgument) without touching the model, so a
        malformed or oversized request never costs the compute thread any time."""
        t0 = time.perf_counter_ns()
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
        return ProposeJob(session_id, tokens, max_draft_tokens, confidence_threshold, sampling,
                          return_distributions and not sampling.greedy, time.perf_counter_ns() - t0)

    def run(self, job: ProposeJob) -> Proposal:
        """Draft for a validated request (on the compute thread)."""
        t0 = time.perf_counter_ns()
        info = self.model_info
        # Leave room for the target's next token after the draft.
        room = info.max_context - len(job.tokens) - 1
        if room <= 0:
            return Proposal([], [], StopReason.CONTEXT_LIMIT, compute_ns=time.perf_counter_ns() - t0 + job.prepare_ns)
        k = min(job.max_draft_tokens, room)
        proposal = self._propose(job.session_id, job.tokens, k, job.confidence_threshold, job.sampling,
                                 job.return_distributions)
        if proposal.stop_reason is StopReason.MAX_TOKENS and k < job.max_draft_tokens:
            proposal.stop_reason = StopReason.CONTEXT_LIMIT
        proposal.compute_ns = time.perf_counter_ns() - t0 + job.prepare_ns
        return proposal

    @abc.abstractmethod
    def _propose(
        self,
        session_id: str,
        tokens: list[int],
        k: int,
        threshold: float,
        sampling: sm.Sampling,
        return_distributions: bool,
    ) -> Proposal:
        """Propose up to ``k`` tokens (validated: 1 <= k, fits the context)."""


def draft_loop(
    next_probs,
    k: int,
    first_position: int,
    threshold: float,
    sampling: sm.Sampling,
    eos: set[int],
    return_distributions: bool,
) -> Proposal:
    """The drafting loop shared by model backends.

    ``next_probs(drafted)`` returns the draft's transformed distribution [V] (torch) for the token
    after ``tokens + drafted``; it is called once per proposed token.
    """
    drafted: list[int] = []
    confidences: list[float] = []
    dists: list[tuple[list[int], list[float]]] = []
    reason = StopReason.MAX_TOKENS
    for i in range(k):
        probs = next_probs(drafted)
        if sampling.greedy:
            token = int(probs.argmax())
        else:
            token = sm.sample(probs, sampling.seed, first_position + i, sm.STREAM_DRAFT)
        drafted.append(token)
        confidences.append(float(probs[token]))
        if return_distributions:
            dists.append(sm.to_sparse(probs))
        if token in eos:
            reason = StopReason.EOS
            break
        if confidences[-1] < threshold:
            reason = StopReason.LOW_CONFIDENCE
            break
    return Proposal(drafted, confidences, reason, dists)
