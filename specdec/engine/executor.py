"""The executor: :class:`Executor` runs one step's forward requests (many sessions, one packed pass)
on the forward path chosen once, at load (specdec's runner with its kernels where it covers the
architecture, else transformers' own forward with ragged attention), each session's KV on the
engine's KV manager (specdec.engine.kv).

Engines never import grpc; servicers translate their results and map :mod:`specdec.errors`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.engine.requests import max_context_of
from specdec.engine.sessions import Session, SessionStore, common_prefix_len
from specdec.model.linears import FastLinears
from specdec.model.ragged import (
    ATTENTION_PATHS,
    RaggedBatch,
    Segment,
    SessionKV,
    attention_path,
    kv_geometry,
    ragged_attention_on,
)
from specdec.model.runner import RunnerBatch, runner_for

logger = logging.getLogger(__name__)

# Where a pass's logits go, whatever device computed them: sampling (its seeded CPU generators),
# verification and every per-token read run there, on one copy of the kept rows per pass (rows x
# vocabulary floats, a few hundred KB), not on one device sync per token read.
HOST = torch.device("cpu")


@dataclass
class ForwardRequest:
    """One session's part of a batched forward pass."""

    session: Session
    tokens: list[int]  # the sequence the session's cache must cover afterwards
    logits: int  # logits wanted for the last this-many tokens (0: none, e.g. a prefill chunk)


@dataclass
class ForwardResult:
    logits: torch.Tensor | None  # [logits, V] fp32 on HOST; row i predicts the token after tokens[:len - logits + i + 1]
    cached: int  # leading tokens reused from the session's cache
    rows: int  # tokens computed for this session


class Executor:
    """A transformers causal LM whose sessions keep their own KV buffers (:class:`SessionKV`).

    :meth:`forward_batch` runs ONE forward pass over the new tokens of many sessions (a ragged,
    packed batch; see specdec.model.ragged): each session reuses the longest common prefix of its cache
    with the requested sequence, crops the rest (a length change, no copy) and computes only the
    new suffix, at its own positions. :meth:`extend` is the single-session form. Callers hold
    :attr:`lock` around either: one forward at a time per model.

    The model may sit on any device: the KV buffers and every tensor a pass creates live there,
    and the logits a pass keeps come back to :data:`HOST` in one copy (none on the CPU).
    ``attention``: how a packed pass attends (``segments`` or ``varlen``, see
    specdec.model.ragged.attention_path; None picks by device).
    """

    def __init__(self, model: Any, store: SessionStore, pack_weights: bool = True, use_runner: bool = True,
                 attention: str | None = None, native: bool = True, quant: dict[int, tuple[str, Any]] | None = None
                 ) -> None:
        self.model = model
        self.store = store
        self.lock = threading.Lock()
        self.vocab_size = int(model.config.vocab_size)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.attention = attention or attention_path(self.device)
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
        self.fast_linears = FastLinears.of(model, pack_weights, native=native, quant=quant)
        logger.info("%d fp32 linear layers on the %s kernel (%d served by their packed weight alone)",
                    self.fast_linears.count, self.fast_linears.kernel, self.fast_linears.released)
        # specdec's own forward for the architectures it covers (specdec.model.runner), else transformers'
        self.runner = runner_for(model, self.fast_linears, native) if use_runner and self.device.type == "cpu" else None
        self.geometry = kv_geometry(model)
        layers, kv_heads, head_dim = self.geometry
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * param.element_size()
        self.model_max_context = max_context_of(model.config)
        self._warm_up()

    @property
    def max_context(self) -> int:
        """Longest sequence a session may hold: the model's context, or fewer tokens when the KV
        budget holds fewer, so clients learn up front that a longer sequence is their input's
        problem (INVALID_ARGUMENT, HTTP 400), not a server fault."""
        return max(2, min(self.model_max_context, self.store.max_bytes // self.bytes_per_token))

    def _warm_up(self) -> None:
        """One forward through the batched path (the first call pays one-off set-up costs)."""
        session = Session("warm-up", self._new_kv())
        session.cache.ensure(2, 2)
        self._forward([(session, 0, [0, 0], 1)])

    def _new_kv(self) -> SessionKV:
        return SessionKV(*self.geometry, self.dtype, self.device)

    def session(self, session_id: str, issued: int | None = None, keep: Collection[str] = ()) -> Session:
        """The session with a KV cache (see SessionStore.get_or_create for ``issued`` and ``keep``)."""
        session = self.store.get_or_create(session_id, lambda: None, issued, keep)
        if session.cache is None:
            session.cache = self._new_kv()
        return session

    def extend(self, session: Session, tokens: list[int], extra: Sequence[int] = ()) -> tuple[torch.Tensor, int]:
        """Forward the uncached part of ``tokens + extra`` for one session.

        Returns:
            logits: [len(extra) + 1, V] fp32; row i predicts the token after ``(tokens + extra)[:len(tokens) + i]``.
            cached: how many leading tokens were reused from the session's cache.
        """
        result = self.forward_batch([ForwardRequest(session, list(tokens) + list(extra), len(extra) + 1)])[0]
        if isinstance(result, BaseException):
            raise result
        return result.logits, result.cached

    def forward_batch(self, requests: list[ForwardRequest]) -> list[ForwardResult | BaseException]:
        """One forward pass over the new tokens of every request (distinct sessions).

        A request that cannot run (its KV reservation refused) gets its exception in its slot and
        the others go ahead; a failed forward fails every request in it and resets their sessions
        (their caches may be half-written), so the next call re-prefills instead of reusing them.
        """
        results: list[ForwardResult | BaseException | None] = [None] * len(requests)
        plan: list[tuple[Session, int, list[int], int]] = []
        where: list[int] = []
        pinned = {r.session.session_id for r in requests}
        for i, r in enumerate(requests):
            session, tokens = r.session, r.tokens
            if session.cache is None:
                session.cache = self._new_kv()
            kv: SessionKV = session.cache
            # At least the tokens whose logits are wanted are recomputed.
            cached = min(common_prefix_len(session.tokens, tokens), kv.length, len(tokens) - r.logits)
            if cached == len(tokens):
                results[i] = ForwardResult(None, cached, 0)
                continue
            try:
                capacity = kv.capacity_for(len(tokens), self.max_context)
                # Room first: a refusal here leaves the session exactly as it was.
                self.store.reserve(session, capacity * self.bytes_per_token - session.nbytes, pinned)
            except BaseException as exc:  # noqa: BLE001 - delivered to that request's caller
                results[i] = exc
                continue
            kv.crop(cached)
            kv.ensure(len(tokens), self.max_context)
            self.store.update(session, tokens[:cached], kv.capacity * self.bytes_per_token)
            plan.append((session, cached, tokens, r.logits))
            where.append(i)
        if plan:
            try:
                logits = self._forward(plan)
            except BaseException as exc:
                for session, *_ in plan:
                    # The buffers may be half-written: they no longer match session.tokens.
                    session.cache.clear()
                    self.store.reset(session)
                for i in where:
                    results[i] = exc
                return results  # type: ignore[return-value]
            for i, (session, cached, tokens, _), out in zip(where, plan, logits, strict=True):
                session.cache.length = len(tokens)
                self.store.update(session, tokens, session.cache.capacity * self.bytes_per_token)
                results[i] = ForwardResult(out, cached, len(tokens) - cached)
        return results  # type: ignore[return-value]

    def _forward(self, plan: list[tuple[Session, int, list[int], int]]) -> list[torch.Tensor | None]:
        """The packed forward of ``plan``: (session, cached, tokens, logits wanted) per session."""
        segments, ids, positions, keep, spans = [], [], [], [], []
        offset = 0
        for session, cached, tokens, want in plan:
            new = tokens[cached:]
            segments.append(Segment(session.cache, cached, len(new), offset))
            ids.extend(new)
            positions.extend(range(cached, len(tokens)))
            offset += len(new)
            spans.append((len(keep), want))
            keep.extend(range(offset - want, offset))
        if self.runner is not None:
            with torch.inference_mode():
                logits = self.runner.forward(RunnerBatch(
                    torch.tensor(ids, dtype=torch.long, device=self.device),
                    torch.tensor(positions, dtype=torch.long, device=self.device), segments,
                    torch.tensor(keep, dtype=torch.long, device=self.device)))
            return [logits[first : first + want] if want else None for first, want in spans]
        batch = RaggedBatch(segments, self.attention)
        with torch.inference_mode(), self.fast_linears.active(), ragged_attention_on(self.model):
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
                past_key_values=batch,
                use_cache=True,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                specdec_batch=batch,
            )
        # One copy to the host for every request of the pass (a no-op on the CPU); the dtype
        # conversion after it, so a bf16 model moves half the bytes.
        logits = out.logits[0].to(HOST).float() if keep else None
        return [logits[first : first + want] if want else None for first, want in spans]


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block on ``n`` torch threads when that is fewer than now (0: unchanged).

    Measured through the services on 2 shared cores (embedded pair): a 2-thread Verify of 5 rows
    with a draft computing next to it took 105 ms against 48 ms alone, as its OpenMP threads wait
    for each other behind the draft; on 1 thread it took 88 ms. Switching costs microseconds.
    """
    before = torch.get_num_threads()
    if not 0 < n < before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
