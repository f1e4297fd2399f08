"""The speculative loop: draft -> verify -> accept -> adapt k, one :class:`Step` at a time.

Greedy output equals plain greedy decoding of the target token for token: the target decides
every token (accepted draft tokens are exactly its argmax), the draft only decides how many land
per target pass. Sampling uses the lossless rejection scheme (see specdec.sampling), run inside
the target service so only sparse draft distributions cross the wire.

Overlapped mode (greedy requests): while the target verifies block i, the draft already drafts
block i + 1 after the sequence plus block i, as if the target accepted all of it; its first token
is its guess of the target's own (bonus) token. When the target does accept the whole block and
its bonus token equals that guess, the rest of the pre-draft is the next block's draft at once,
with no draft wait; otherwise the pre-draft is cancelled and the next block is drafted from the
true sequence (the draft service crops its cache to the common prefix, as after any rejection).
The output is the same either way: the target still decides every token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from orchestrator import generation_metrics as metrics
from orchestrator.clients import Proposed
from orchestrator.controller import Controller
from orchestrator.controller_inputs import Load
from orchestrator.detokenizer import Detokenizer
from orchestrator.generation import (
    BadRequest,
    DraftHealth,
    GenerationParams,
    GenerationResult,
    ModelLimits,
    TargetBusy,
    TargetUnavailable,
)
from orchestrator.replicas import DraftPool, TargetPool
from orchestrator.schemas import Step
from orchestrator.step_accounting import GenerationStats, StepInProgress
from specdec.params import Sampling

logger = logging.getLogger(__name__)

# A draft whose cache lacks more than this many tokens of the sequence catches up in the background
# (the first step's prompt, or the tokens of plain steps) instead of holding up the step: more than a
# steady-state Propose ever misses (the target's own token; all of a draft after a pre-draft).
CATCH_UP_IN_BACKGROUND = 16
MIN_CATCH_UP_CHUNK = 32  # a catch-up chunk that misses its deadline halves, down to this


class SpeculativeRequest:
    """One generation: the sequence, the draft's view of it, pre-draft and catch-up state, and a
    method per stage of a step (choose k, get a draft, verify, accept, settle the pre-draft,
    record). :func:`generate` drives it."""

    def __init__(self, params: GenerationParams, draft: DraftPool, target: TargetPool, controller: Controller,
                 limits: ModelLimits, draft_health: DraftHealth, decode: Callable[[list[int]], str],
                 in_progress: Callable[[], int], background: set[asyncio.Task]) -> None:
        self.params, self.draft, self.target, self.controller = params, draft, target, controller
        self.limits, self.draft_health, self.in_progress = limits, draft_health, in_progress
        self.background = background  # keeps the Release task of close() referenced until it has run
        self.session_id = uuid.uuid4().hex
        self.seq = list(params.prompt_ids)
        self.start = len(self.seq)
        self.stats = GenerationStats()
        self.detok = Detokenizer(decode, params.stop)
        speculative = params.mode == "speculative"
        self.can_overlap = speculative and params.overlap is not False and params.sampling.greedy
        self.draft_ok = speculative  # cleared when the draft rejects this request's input
        self.used_draft = False  # even a failed call may have created a draft session
        self.finish = "length"
        self.t_start = time.perf_counter()
        self.t_last_step = self.t_start
        # RPCs in flight, shielded from cancellation: when the client goes away mid-call, the Release
        # must reach each service after its call, or the call would re-create the session.
        self.inflight: set[asyncio.Future] = set()
        self.predraft: asyncio.Future | None = None  # overlapped: Propose of the next block, sent with this Verify
        self.catching_up: asyncio.Future | None = None  # a Propose bringing the draft's cache up to date, off the critical path
        self.draft_seen = 0  # leading tokens of seq the draft's cache holds (as far as this loop knows)
        self.catch_up_from = 0  # draft_seen before the catch-up in flight
        self.catch_up_chunk = params.draft_catch_up_chunk  # tokens a catch-up call brings the draft
        self.ready: Proposed | None = None  # overlapped: the next block's draft, from that pre-draft

    # -- calls -----------------------------------------------------------------------------------

    def track(self, coro: Any) -> asyncio.Future:
        future = asyncio.ensure_future(coro)
        self.inflight.add(future)
        future.add_done_callback(self.inflight.discard)
        # a dropped pre-draft may fail unobserved: its failure is not the request's
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    async def call(self, coro: Any) -> Any:
        return await asyncio.shield(self.track(coro))

    def draft_failed(self, exc: grpc.aio.AioRpcError) -> str:
        error = f"{exc.code().name}: {exc.details()}"
        metrics.DRAFT_FALLBACKS.labels(exc.code().name.lower()).inc()
        self.stats.draft_fallbacks += 1
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            self.draft_ok = False  # this input will not suit the draft; the service is fine
        elif exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy is not down: skip this step only
            self.draft_health.failed(error)
        return error

    def drop_predraft(self) -> None:
        if self.predraft is not None:
            self.predraft.cancel()  # the draft service drops it before its next draft step
            self.stats.predrafts_dropped += 1
            self.predraft = None

    # -- the stages of a step --------------------------------------------------------------------

    def remaining(self) -> int:
        generated = len(self.seq) - self.start
        return min(self.params.max_tokens - generated, self.limits.target_max_context - len(self.seq))

    def overlap_now(self) -> bool:
        """auto (None): overlapped for a lone request whose draft computes on another host. On a
        shared host the overlapped verify gives up cores to the draft, and since a verify costs
        about one plain step, alternating is faster there (docs/benchmarks.md, "Overlap on shared
        cores")."""
        return self.can_overlap and (self.params.overlap is True
                                     or (self.in_progress() <= 1 and not self.limits.draft_shares_host))

    def choose_k(self, step: StepInProgress, remaining: int, overlap: bool) -> None:
        """1. Choose k: each step yields accepted + 1 tokens, so never draft past what is left. The
        controller prices k for the load it is given: the streams in progress, whether this step
        runs overlapped, where each party computes."""
        limits = self.limits
        if self.draft_ok and self.draft_health.usable() and len(self.seq) < limits.draft_max_context - 1:
            load = Load(streams=self.in_progress(), overlap=overlap, topology=limits.topology)
            step.k = min(self.controller.next_k(load), remaining - 1, limits.target_max_draft, limits.draft_max_draft)
        if self.catching_up is not None:
            self._collect_catch_up(step)
        if (self.catching_up is None and step.k > 0 and self.ready is None
                and len(self.seq) - self.draft_seen > CATCH_UP_IN_BACKGROUND):
            self._catch_up(step)

    def _catch_up(self, step: StepInProgress) -> None:
        """1.1 The draft is far behind (the prompt at the first step, or plain steps since its last
        Propose). Its catch-up is a prefill, a chunk per call (:meth:`_catch_up_call`):

        - a probe skips it (a probe is worth a short Propose, not a prefill of everything missed);
        - a draft on another host catches up in the background while the steps go on plainly
          (greedy only: the plain steps it causes depend on timing, and a seeded sample depends on
          the k schedule; greedy output never does);
        - a draft on the target's host catches up before this step's Propose (:meth:`prefill_draft`),
          after the prompt's own pass (greedy: its first step is plain, alone: beside the draft's
          prefill on the same cores the first token comes several times later than plain
          decoding's, docs/benchmarks.md, "The first token"). In the background there, plain steps
          and the prefill share the cores: a long prompt's catch-up stretches over most of the
          answer, which then drafts little; waited for, with the cores to itself, it is done
          before the first Propose and the answer drafts as a short prompt's does
          (docs/benchmarks.md, "Continuous batching");
        - a sampled request on another host catches up before its Propose too."""
        p, limits = self.params, self.limits
        if self.controller.probing:
            step.k = 0
        elif limits.draft_shares_host:
            if self.stats.iterations == 0 and p.sampling.greedy:
                step.k = 0
        elif p.sampling.greedy:
            self._start_catch_up(step)

    def _collect_catch_up(self, step: StepInProgress) -> None:
        if not self.catching_up.done():
            step.k = 0
            return
        try:
            self.catching_up.result()
            self.draft_health.succeeded()
        except grpc.aio.AioRpcError as exc:
            step.k = 0  # no Propose right after
            self.draft_seen = self.catch_up_from  # what the draft holds for sure
            if not self._shrink_catch_up(exc):
                # reported with this step, which runs without a draft because of it
                step.draft_error = self.draft_failed(exc)
        except asyncio.CancelledError:
            self.draft_seen = self.catch_up_from
        self.catching_up = None

    def _start_catch_up(self, step: StepInProgress) -> None:
        """The background catch-up: a one-token Propose whose answer only fills the draft's cache,
        a chunk at a time (each call a bounded number of rows within the usual deadline; the
        draft's other sessions draft between them; the next starts where this one ended)."""
        step.k = 0
        end = min(len(self.seq), self.draft_seen + self.catch_up_chunk)
        self.catching_up = self.track(self._catch_up_call(end, self.limits.draft_shares_host))
        self.used_draft = True
        self.catch_up_from, self.draft_seen = self.draft_seen, end
        self.stats.draft_catch_ups += 1

    def _catch_up_call(self, end: int, yield_cores: bool) -> Any:
        """A one-token Propose on seq[:end], for the cache it fills. Short of the sequence's end it
        drafts greedily and unconstrained (its token is discarded; a grammar starts at the output)."""
        p = self.params
        sampling = p.sampling if end == len(self.seq) else Sampling()
        return self.draft.propose(self.session_id, list(self.seq[:end]), 1, p.confidence_threshold, sampling,
                                  yield_cores=yield_cores)

    async def prefill_draft(self, step: StepInProgress, yield_cores: bool) -> bool:
        """2.0 A draft far behind catches up before this step's Propose, a chunk per call as in the
        background (:meth:`_catch_up`). False when the draft failed (reported with the step)."""
        while len(self.seq) - self.draft_seen > self.catch_up_chunk:
            end = self.draft_seen + self.catch_up_chunk
            self.used_draft = True
            self.stats.draft_catch_ups += 1
            try:
                await self.call(self._catch_up_call(end, yield_cores))
            except grpc.aio.AioRpcError as exc:
                if self._shrink_catch_up(exc):
                    continue
                step.draft_error = self.draft_failed(exc)
                return False
            self.draft_seen = end
        return True

    def _shrink_catch_up(self, exc: grpc.aio.AioRpcError) -> bool:
        """A catch-up chunk past its deadline is too large for the draft's speed now, not a draft
        that is down: halve the chunk (True) until the floor, where it fails as any call does."""
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or self.catch_up_chunk <= MIN_CATCH_UP_CHUNK:
            return False
        self.catch_up_chunk = max(self.catch_up_chunk // 2, MIN_CATCH_UP_CHUNK)
        return True

    async def fetch_draft(self, step: StepInProgress) -> None:
        """2. Fetch the draft (a failure only costs this step its draft): the pre-draft when the
        last step left one, else a Propose now."""
        step.predrafted = self.ready is not None and step.k > 0
        if step.predrafted:
            step.proposal = _tokens(self.ready, 0, step.k)
            self.stats.predrafted += 1
        elif step.k > 0:
            t_draft = time.perf_counter()
            self.used_draft = True
            p = self.params
            # Alone, the target idles while the draft drafts: the draft may take every core.
            busy = self.in_progress() > 1 or self.target.in_flight > 0
            if await self.prefill_draft(step, self.limits.draft_shares_host and busy):
                try:
                    step.proposal = await self.call(self.draft.propose(
                        self.session_id, self.seq, step.k, p.confidence_threshold, p.sampling,
                        yield_cores=self.limits.draft_shares_host and busy))
                    self.draft_health.succeeded()
                except grpc.aio.AioRpcError as exc:
                    step.draft_error = self.draft_failed(exc)
            # the wait for the draft: a failed call's too (up to its deadline), and any catch-up before it
            step.draft_ms = (time.perf_counter() - t_draft) * 1e3
        step.draft_wait_ms = 0.0 if step.predrafted else step.draft_ms
        if self.ready is not None and not step.predrafted:
            self.stats.predrafts_dropped += 1  # the controller chose a plain step
        self.ready = None
        step.tokens = step.proposal.tokens if step.proposal else []

    def start_predraft(self, step: StepInProgress, remaining: int) -> None:
        """3. (overlapped) The draft drafts the next block while the target verifies this one, as
        if this one were accepted whole (its first token: a guess of the bonus token)."""
        limits, p = self.limits, self.params
        pre_k = min(step.k + 1, remaining - len(step.tokens) - 1, limits.draft_max_draft)
        if step.tokens and pre_k >= 2 and len(self.seq) + len(step.tokens) < limits.draft_max_context - 1:
            self.predraft = self.track(self.draft.propose(self.session_id, self.seq + step.tokens, pre_k,
                                                          p.confidence_threshold, p.sampling,
                                                          yield_cores=limits.draft_shares_host))

    async def verify(self, step: StepInProgress) -> None:
        """3. Verify in one target pass."""
        p = self.params
        try:
            try:
                step.verified = await verify_when_admitted(self.call, functools.partial(
                    self.target.verify, self.session_id, self.seq, step.tokens, p.sampling,
                    step.proposal.distributions if step.proposal else (),
                    yield_cores=self.limits.draft_shares_host and (self.predraft is not None
                                                                   or self.draft.in_flight > 0),
                    logprobs=p.logprobs, processed_logprobs=p.processed_logprobs))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or not step.tokens:
                    raise
                # The draft's output, not the user's input, was refused (say, ids outside the
                # target's vocabulary): verify this step without it, and stop drafting for this request.
                logger.warning("target refused the draft (%s); continuing without drafts", exc.details())
                step.draft_error = f"target refused the draft: {exc.details()}"
                metrics.DRAFT_FALLBACKS.labels("refused_by_target").inc()
                self.stats.draft_fallbacks += 1
                self.draft_ok = False
                self.drop_predraft()
                step.proposal, step.tokens = None, []
                step.verified = await self.call(self.target.verify(self.session_id, self.seq, [], p.sampling,
                                                                   logprobs=p.logprobs, processed_logprobs=p.processed_logprobs))
        except grpc.aio.AioRpcError as exc:
            self.drop_predraft()
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(exc.details()) from exc
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise TargetBusy(f"target service is busy: {exc.details()}") from exc
            logger.warning("request %s: the target failed on every replica: %s: %s", self.session_id,
                           exc.code().name, exc.details())
            raise TargetUnavailable(f"target service: {exc.code().name}: {exc.details()}") from exc
        metrics.PREFIX_TOKENS.labels("cached").inc(step.verified.cached_tokens)
        metrics.PREFIX_TOKENS.labels("computed").inc(max(len(self.seq) - step.verified.cached_tokens, 0))

    def accept(self, step: StepInProgress, remaining: int) -> None:
        """4. Accept: the accepted draft prefix, then the target's own token (cut at EOS, the
        request's length and the context), and the text they add."""
        v, tokens = step.verified, step.tokens
        new = tokens[: v.num_accepted] + [v.next_token]
        if tokens:  # the draft's cache holds seq and the drafted tokens the target accepted
            self.draft_seen = len(self.seq) + v.num_accepted
        step.kind = "plain" if not tokens else ("bonus" if v.num_accepted == len(tokens) else "correction")
        if not self.params.ignore_eos:
            eos_at = next((i for i, t in enumerate(new) if t in self.limits.eos_token_ids), None)
            if eos_at is not None:
                new = new[: eos_at + 1]
                self.finish = "stop"
        step.new = new[:remaining]
        self.seq.extend(step.new)
        step.done = (self.finish == "stop" or len(self.seq) - self.start >= self.params.max_tokens
                     or len(self.seq) >= self.limits.target_max_context)
        step.text = self.detok.push(step.new, final=step.done)
        if self.detok.stopped:
            self.finish, step.done = "stop", True

    async def settle_predraft(self, step: StepInProgress) -> None:
        """4.1 Overlapped: keep the pre-draft if the target took the whole block and its own token
        is the pre-draft's first; otherwise drop it (the next Propose crops)."""
        if self.predraft is None:
            return
        if step.kind != "bonus" or step.done:
            self.drop_predraft()
            return
        t_wait = time.perf_counter()
        try:
            pre = await asyncio.shield(self.predraft)
            self.draft_health.succeeded()
            if pre.tokens[:1] == [step.verified.next_token] and len(pre.tokens) > 1:
                self.ready = _tokens(pre, 1, len(pre.tokens))
            else:
                self.stats.predrafts_dropped += 1
        except grpc.aio.AioRpcError as exc:
            step.draft_error = self.draft_failed(exc)
            self.stats.predrafts_dropped += 1
        step.draft_wait_ms += (time.perf_counter() - t_wait) * 1e3  # the draft was slower than the target
        self.predraft = None

    def record(self, step: StepInProgress) -> Step:
        """5. Adapt k and account: the controller, the request's stats and the metrics each see the
        step once; the :class:`Step` is what every client gets."""
        v, proposal, stats = step.verified, step.proposal, self.stats
        step_ms = (time.perf_counter() - step.t_start) * 1e3
        catch_up = len(self.seq) - len(step.new) - proposal.cached_tokens if proposal and not step.predrafted else 0
        self.controller.observe(step.observation(warm=stats.iterations > 0, draft_catch_up=catch_up))
        # The step's time split as the stream lived it: draft time is what it waited for drafts.
        overhead_ms = max(step_ms - step.draft_wait_ms - v.wall_ms, 0.0)
        stats.record_step(step, overhead_ms)
        now = time.perf_counter()
        model = self.params.model_name
        if stats.iterations == 1:
            stats.first_token_ms = (now - self.t_start) * 1e3
            metrics.TTFT.labels(model).observe(now - self.t_start)
            metrics.QUEUE_TIME.labels(model).observe(self.params.queued_s + v.queue_ms / 1e3)
        else:
            metrics.ITL.labels(model).observe(now - self.t_last_step)
        self.t_last_step = now
        metrics.count_step(self.params.mode, len(step.new), len(step.tokens), v.num_accepted, model)
        return step.event(stats.iterations - 1, overhead_ms)

    def result(self) -> GenerationResult:
        stats = self.stats
        stats.elapsed_ms = (time.perf_counter() - self.t_start) * 1e3
        metrics.E2E.labels(self.params.model_name).observe(stats.elapsed_ms / 1e3)
        if stats.elapsed_ms > 0:
            metrics.TOKENS_PER_SECOND.labels(self.params.mode).observe(stats.tokens / (stats.elapsed_ms / 1e3))
        text, text_tokens = self.detok.final()
        return GenerationResult(self.finish, text, stats, text_tokens)

    def close(self) -> None:
        """Free both caches now, even when cancelled; never let cleanup fail the request."""
        self.drop_predraft()
        if self.catching_up is not None:
            self.catching_up.cancel()  # the session is released next: its cache is of no more use
        clients = [self.target] + ([self.draft] if self.used_draft else [])
        task = asyncio.get_running_loop().create_task(_release(clients, self.session_id, set(self.inflight)))
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def generate(
    params: GenerationParams,
    draft: DraftPool,
    target: TargetPool,
    controller: Controller,
    limits: ModelLimits,
    draft_health: DraftHealth,
    decode: Callable[[list[int]], str],
    is_disconnected: Callable[[], Any] | None = None,
    in_progress: Callable[[], int] = lambda: 1,
    *,
    background: set[asyncio.Task],
) -> AsyncIterator[Step | GenerationResult]:
    """Run the loop; yield a :class:`Step` per iteration, then a GenerationResult.

    ``in_progress``: generations the server is running now, this one included (overlap ``None``:
    overlapped while it is 1 and the draft does not share the target's host). ``background``: where
    the Release calls still running after the request ended are kept (``Runtime.background``): the
    event loop keeps only weak references to tasks, so an unreferenced one could be collected
    before it runs.

    Raises TargetUnavailable or BadRequest when the target fails.
    """
    req = SpeculativeRequest(params, draft, target, controller, limits, draft_health, decode, in_progress, background)
    metrics.ACTIVE.inc()
    metrics.RUNNING.labels(params.model_name).inc()
    metrics.PROMPT_TOKENS.labels(params.model_name).inc(len(params.prompt_ids))
    try:
        while True:
            step = StepInProgress(t_start=time.perf_counter())
            if is_disconnected is not None and await is_disconnected():
                req.finish = "cancelled"
                break
            remaining = req.remaining()
            if remaining <= 0:
                req.finish = "length"
                break
            overlap = req.overlap_now()
            req.choose_k(step, remaining, overlap)
            metrics.K_CHOSEN.observe(max(step.k, 0))
            await req.fetch_draft(step)
            if overlap:
                req.start_predraft(step, remaining)
            await req.verify(step)
            req.accept(step, remaining)
            await req.settle_predraft(step)
            yield req.record(step)
            if step.done:
                break
        yield req.result()
    finally:
        metrics.ACTIVE.dec()
        metrics.RUNNING.labels(params.model_name).dec()
        req.close()


def _tokens(p: Proposed, start: int, end: int) -> Proposed:
    """Tokens [start, end) of a pre-draft: without its first (the bonus guess the target confirmed),
    or the first k of the next step. Compute is shared out by tokens; wall_ms stays the call's."""
    if (start, end) == (0, len(p.tokens)):
        return p
    n = len(p.tokens[start:end])
    return dataclasses.replace(p, tokens=p.tokens[start:end], confidences=p.confidences[start:end],
                               distributions=p.distributions[start:end], compute_ms=p.compute_ms * n / len(p.tokens),
                               stop_reason=p.stop_reason if end >= len(p.tokens) else "max_tokens")


# A target whose queue is full answers RESOURCE_EXHAUSTED at once; a stream already under way waits
# a little and tries again (the queue drains within a few forward passes) before giving up with 429.
BUSY_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4, 0.8)


async def verify_when_admitted(call: Callable[[Any], Any], make: Callable[[], Any]) -> Any:
    for delay in (*BUSY_RETRY_DELAYS_S, None):
        try:
            return await call(make())
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or delay is None:
                raise
            await asyncio.sleep(delay)


async def _release(clients: list, session_id: str, inflight: set[asyncio.Future]) -> None:
    pending = [future for future in inflight if not future.done()]
    if pending:  # their failures were already handled, or nobody is waiting for them any more
        await asyncio.wait(pending)
    for client in clients:
        try:
            await client.release(session_id)
        except Exception as exc:  # the session will expire by TTL anyway
            logger.info("release of %s on %s failed (its idle TTL will free it): %s", session_id, client.service, exc)
