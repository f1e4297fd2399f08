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

from specdec.engine.kv import KVManager
from specdec.engine.requests import max_context_of
from specdec.engine.sessions import Session, SessionStore
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
    """Runs a step's forward requests on one model: ONE packed forward pass over the new tokens of
    many sessions (a ragged batch; see specdec.model.ragged), each session's cache on the KV
    manager (:attr:`kv`): the longest common prefix of its cache with the requested sequence is
    reused, the rest cropped (a length change, no copy), and only the new suffix computed, at its
    own positions. Callers hold :attr:`lock` around :meth:`forward_batch` / :meth:`extend`: one
    forward at a time per model.

    The forward path is chosen once, at load: specdec's runner (specdec.model.runner, its linears
    on specdec.native's kernels) where it covers the architecture on the CPU, else transformers'
    own forward with ragged attention and the fast linears. The executor takes the model over: its
    linear layers are packed and their row-major weights freed (specdec.model.linears).

    The model may sit on any device: the KV buffers and every tensor a pass creates live there,
    and the logits a pass keeps come back to :data:`HOST` in one copy (none on the CPU).
    ``attention``: how a packed pass attends (``segments`` or ``varlen``, see
    specdec.model.ragged.attention_path; None picks by device).
    """

    def __init__(self, model: Any, store: SessionStore, pack_weights: bool = True, use_runner: bool = True,
                 attention: str | None = None, native: bool = True, quant: dict[int, tuple[str, Any]] | None = None
                 ) -> None:
        self.model = model
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
        self.kv = KVManager(store, self._new_kv, 2 * layers * kv_heads * head_dim * param.element_size(),
                            max_context_of(model.config))
        self._warm_up()

    @property
    def max_context(self) -> int:
        """Longest sequence a session may hold (see KVManager.max_context)."""
        return self.kv.max_context

    @property
    def bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    def _warm_up(self) -> None:
        """One forward through the batched path (the first call pays one-off set-up costs)."""
        session = Session("warm-up", self._new_kv())
        session.cache.ensure(2, 2)
        self._forward([(session, 0, [0, 0], 1)])

    def _new_kv(self) -> SessionKV:
        return SessionKV(*self.geometry, self.dtype, self.device)

    def session(self, session_id: str, issued: int | None = None, keep: Collection[str] = ()) -> Session:
        """The session with a KV cache (see SessionStore.get_or_create for ``issued`` and ``keep``)."""
        return self.kv.session(session_id, issued, keep)

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

    def run(self, shared: list[ForwardRequest], alone: list[ForwardRequest] = (), threads: int = 0
            ) -> list[ForwardResult | BaseException]:
        """A step's plan: ``shared`` as one batched pass, then each of ``alone`` in a pass of its own
        (a batched pass may round a row's logits differently from a pass alone: harmless for argmax,
        but it would move a seeded sampling request's draws with the load). ``threads``: torch
        threads of these passes (0: unchanged; fewer when a draft computes on this host meanwhile).
        The results come in the order of ``shared + alone``."""
        with torch_threads(threads):
            results = self.forward_batch(shared) if shared else []
            for request in alone:
                results += self.forward_batch([request])
        return results

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
            if r.session.cache is None:
                r.session.cache = self._new_kv()
            cached = self.kv.reusable(r.session, r.tokens, r.logits)  # the rows wanting logits are computed
            if cached == len(r.tokens):
                results[i] = ForwardResult(None, cached, 0)
                continue
            try:
                self.kv.open(r.session, r.tokens, cached, pinned)
            except BaseException as exc:  # noqa: BLE001 - delivered to that request's caller
                results[i] = exc
                continue
            plan.append((r.session, cached, r.tokens, r.logits))
            where.append(i)
        if plan:
            try:
                logits = self._forward(plan)
            except BaseException as exc:
                for session, *_ in plan:
                    self.kv.fail(session)
                for i in where:
                    results[i] = exc
                return results  # type: ignore[return-value]
            for i, (session, cached, tokens, _), out in zip(where, plan, logits, strict=True):
                self.kv.commit(session, tokens)
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
            logits = self._run_runner(ids, positions, segments, keep)
        else:
            logits = self._run_transformers(ids, positions, segments, keep)
        return [logits[first : first + want] if want else None for first, want in spans]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _run_runner(self, ids: list[int], positions: list[int], segments: list[Segment], keep: list[int]
                    ) -> torch.Tensor:
        with torch.inference_mode():
            return self.runner.forward(RunnerBatch(self._tensor(ids), self._tensor(positions), segments,
                                                   self._tensor(keep)))

    def _run_transformers(self, ids: list[int], positions: list[int], segments: list[Segment], keep: list[int]
                          ) -> torch.Tensor | None:
        batch = RaggedBatch(segments, self.attention)
        with torch.inference_mode(), self.fast_linears.active(), ragged_attention_on(self.model):
            out = self.model(
                input_ids=self._tensor(ids)[None],
                position_ids=self._tensor(positions)[None],
                past_key_values=batch,
                use_cache=True,
                logits_to_keep=self._tensor(keep),
                specdec_batch=batch,
            )
        # One copy to the host for every request of the pass (a no-op on the CPU); the dtype
        # conversion after it, so a bf16 model moves half the bytes.
        return out.logits[0].to(HOST).float() if keep else None


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block on ``n`` torch threads when that is fewer than now (0: unchanged).

    A pass whose OpenMP threads share the cores with a computing draft waits for them at every
    op's barrier, so fewer threads finish it sooner (docs/performance.md, "Overlapped
    speculation"). Switching costs microseconds.
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
