"""Overlapped speculation: the next block is drafted while the current one is verified.

The loop runs against a real target engine (a tiny Llama, in process) and a scripted draft that
knows the target's greedy continuation and errs where told, with a delay so that Propose and
Verify really are in flight together. The output must equal plain greedy decoding whatever the
pre-drafts did; the accounting must show pre-drafts used, dropped and cancelled.
"""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.clients import Proposed
from orchestrator.controller import CostController, make_controller
from orchestrator.controller_inputs import Load, StepObservation
from orchestrator.cost_model import CostModel
from orchestrator.generation import DraftHealth, GenerationParams, ModelLimits
from orchestrator.loop import generate
from orchestrator.schemas import Step
from specdec.engine.sessions import SessionStore
from specdec.models import load_hf
from specdec.params import Sampling
from target_service.verify import TargetEngine
from tests.support import PROMPT, EngineTarget, greedy_reference

N = 24


@pytest.fixture(scope="module")
def engine(tiny_models):
    return TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(8, 1 << 30, 0), max_draft_tokens=8)


@pytest.fixture(scope="module")
def reference(engine):
    return greedy_reference(engine.lm.model, PROMPT, N + 12)


class ScriptedDraft:
    """Proposes the target's own greedy continuation, except at the absolute positions in ``wrong``
    (a different token there), after ``delay_s``; records every call and every cancellation."""

    service = "draft"
    in_flight = 0  # Proposes of the pool in flight (other streams' too), as DraftPool counts them

    def __init__(self, reference: list[int], wrong: set[int], delay_s: float = 0.01) -> None:
        self.full = PROMPT + reference
        self.wrong, self.delay_s = wrong, delay_s
        self.calls: list[tuple[int, int]] = []  # (len(tokens), k)
        self.yield_cores: list[bool] = []  # per call: whether it asked to leave the target its cores
        self.cancelled = 0
        self.running = 0
        self.max_running = 0

    async def propose(self, session_id, tokens, k, threshold, sampling, yield_cores=False):
        self.calls.append((len(tokens), k))
        self.yield_cores.append(yield_cores)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        # a draft continues whatever it is given: it follows the reference only while its input does
        on_track = list(tokens) == self.full[: len(tokens)]
        out = []
        for pos in range(len(tokens), len(tokens) + k):
            if not on_track or pos >= len(self.full) or pos in self.wrong:
                out.append(1 if self.full[pos % len(self.full)] != 1 else 2)
                on_track = False
            else:
                out.append(self.full[pos])
        return Proposed(out, [0.9] * k, "max_tokens", [], len(tokens), 1.0, self.delay_s * 1e3)

    async def release(self, session_id: str) -> bool:
        return True


class SlowTarget(EngineTarget):
    """The in-process engine, taking ``delay_s`` like a real forward pass (so the pre-draft overlaps it)."""

    def __init__(self, engine, delay_s: float = 0.02) -> None:
        super().__init__(engine)
        self.delay_s = delay_s

    async def verify(self, *args, **kwargs):
        await asyncio.sleep(self.delay_s)
        return await super().verify(*args, **kwargs)


async def run(engine, draft, params, controller, shared_host=True, target=None, in_progress=1):
    limits = ModelLimits(engine.lm.max_context, 8, 1000, 8, set(), draft_shares_host=shared_host)
    target = target or SlowTarget(engine)
    background: set[asyncio.Task] = set()
    events = [e async for e in generate(params, draft, target, controller, limits, DraftHealth(1.0), lambda ids: "",
                                        in_progress=lambda: in_progress, background=background)]
    await asyncio.gather(*background)  # the sessions' Releases
    steps = [e for e in events if isinstance(e, Step)]
    return steps, events[-1].stats


@pytest.mark.parametrize("wrong", [set(), {len(PROMPT) + 5}, {len(PROMPT) + i for i in (2, 3, 9, 14, 15, 20)}],
                         ids=["all-accepted", "one-rejection", "many-rejections"])
async def test_overlapped_output_equals_plain_greedy(engine, reference, wrong):
    draft = ScriptedDraft(reference, wrong)
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, overlap=True)
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8))
    assert [t for s in steps for t in s.tokens] == reference[:N]
    # pre-drafts were used, and they really ran while the target verified
    assert stats.predrafted > 0 and draft.max_running == 1
    assert any(s.predrafted for s in steps) and not steps[0].predrafted
    assert stats.iterations < N  # speculation paid: fewer target passes than tokens
    if wrong:
        # a rejection drops the pre-draft of the block after it
        assert stats.predrafts_dropped > 0
        assert any(s.next_kind == "correction" for s in steps)


async def test_a_predraft_whose_guess_is_not_the_bonus_token_is_dropped(engine, reference):
    """Block 0 (positions P..P+2) is accepted whole; the pre-draft's first token guesses the bonus
    at P+3 wrongly, so its tokens were drafted after the wrong sequence: the next block is drafted
    afresh."""
    P = len(PROMPT)
    draft = ScriptedDraft(reference, {P + 3})
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=12, ignore_eos=True, overlap=True)
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8))
    assert [t for s in steps for t in s.tokens] == reference[:12]
    assert steps[0].next_kind == "bonus" and not steps[1].predrafted
    assert draft.calls[:3] == [(P, 3), (P + 3, 4), (P + 4, 3)]  # fresh, pre-draft, fresh again
    assert steps[2].predrafted  # and from there on the pipeline runs again
    assert stats.predrafts_dropped >= 1


@pytest.mark.parametrize("shared_host", [True, False])
async def test_a_verify_next_to_a_predraft_on_the_same_host_yields_cores(engine, reference, shared_host):
    draft, target = ScriptedDraft(reference, {len(PROMPT) + 5}), SlowTarget(engine)
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, overlap=True)
    _, stats = await run(engine, draft, params, make_controller("fixed", 3, 8), shared_host, target)
    # every pre-draft ran next to a Verify, which yielded cores when the two share a host
    launched = stats.predrafted + stats.predrafts_dropped
    assert launched > 0 and target.yield_cores.count(True) == (launched if shared_host else 0)
    assert target.yield_cores[0] == shared_host  # the first block's Verify already has the second's pre-draft


@pytest.mark.parametrize("overlap, in_progress, shared_host, overlapped", [
    (None, 1, False, True), (None, 2, False, False), (None, 1, True, False), (True, 2, True, True),
    (False, 1, False, False)])
async def test_auto_overlaps_only_a_request_alone_with_the_draft_on_another_host(
        engine, reference, overlap, in_progress, shared_host, overlapped):
    """auto (None) overlaps a lone request when the draft has cores of its own; on the target's
    host the overlapped verify would give up cores to the draft, which measured slower."""
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, overlap=overlap)
    steps, stats = await run(engine, ScriptedDraft(reference, set()), params, make_controller("cost", 3, 8),
                             shared_host, in_progress=in_progress)
    assert (stats.predrafted > 0) == overlapped
    assert [t for s in steps for t in s.tokens] == reference[:N]


async def test_a_failing_predraft_costs_drafts_not_the_request(engine, reference):
    """The draft dies while pre-drafting: the request goes on without drafts (the draft's usual
    fallback), with the same output."""
    import grpc

    class Dies(ScriptedDraft):
        async def propose(self, session_id, tokens, k, threshold, sampling, yield_cores=False):
            if len(self.calls) >= 1:
                self.calls.append((len(tokens), k))
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "connection refused")
            return await super().propose(session_id, tokens, k, threshold, sampling, yield_cores)

    draft = Dies(reference, set())
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, overlap=True)
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8))
    assert [t for s in steps for t in s.tokens] == reference[:N]
    assert draft.calls[:2] == [(len(PROMPT), 3), (len(PROMPT) + 3, 4)]  # the first block, then its pre-draft
    assert "UNAVAILABLE" in steps[0].draft_error and stats.draft_fallbacks >= 1
    assert steps[1].k == 0 and not steps[1].draft  # the draft is left alone for its retry interval


async def test_alternating_makes_no_predraft(engine, reference):
    draft = ScriptedDraft(reference, {len(PROMPT) + 5})
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, overlap=False)
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8))
    assert [t for s in steps for t in s.tokens] == reference[:N]
    assert stats.predrafted == 0 and stats.predrafts_dropped == 0
    assert len(draft.calls) == stats.iterations  # one Propose per step, after the sequence the target confirmed


async def test_a_rejection_cancels_the_predraft_in_flight(engine, reference):
    """With a draft slower than the target, the pre-draft is still running when Verify reports a
    rejection: it is cancelled, not waited for."""
    draft = ScriptedDraft(reference, {len(PROMPT) + 1}, delay_s=0.3)
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=6, ignore_eos=True, overlap=True)
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8))
    assert [t for s in steps for t in s.tokens] == reference[:6]
    assert steps[0].next_kind == "correction"
    assert draft.cancelled >= 1 and stats.predrafts_dropped >= 1


async def test_sampling_requests_do_not_overlap(engine, reference):
    draft = ScriptedDraft(reference, set())
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=8, ignore_eos=True, overlap=True,
                              sampling=Sampling(temperature=0.8, seed=3))

    class Dist(ScriptedDraft):
        async def propose(self, *args, **kwargs):
            p = await super().propose(*args, **kwargs)
            p.distributions = [([t], [1.0]) for t in p.tokens]
            return p

    draft = Dist(reference, set())
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8))
    assert stats.predrafted == 0 and len(draft.calls) == stats.iterations


def _costs(verify_ms: dict[int, float], draft_ms_per_token: float) -> CostModel:
    costs = CostModel()
    for _ in range(20):
        for k, ms in verify_ms.items():
            costs.observe_verify(k, ms)
        costs.observe_draft(4, 4 * draft_ms_per_token)
    return costs


def _steps(controller: CostController, alpha_runs: int) -> None:
    for _ in range(alpha_runs):  # all accepted: alpha near 1
        controller.observe(StepObservation(k=4, proposed=4, accepted=4, draft_ms=0, verify_ms=0, warm=False))


def test_overlapped_cost_model_prefers_longer_drafts_when_the_draft_is_far():
    """A draft 20 ms away per call costs an alternating stream its round trip every step; an
    overlapped one hides it behind the verify, so its best k and its expected rate are higher."""
    verify = {0: 30.0, 1: 33.0, 2: 36.0, 4: 42.0, 8: 54.0}
    costs = _costs(verify, draft_ms_per_token=12.0)
    alternating, overlapped = CostController(4, 8, costs), CostController(4, 8, costs)
    for c, load in ((alternating, Load()), (overlapped, Load(overlap=True))):
        _steps(c, 30)
        c.next_k(load)
    best_alt = max(alternating.last_choice.values())
    best_ovl = max(overlapped.last_choice.values())
    assert best_ovl > best_alt
    # k = 0 is plain decoding either way
    assert alternating.last_choice[0] == pytest.approx(overlapped.last_choice[0])
    # with every draft rejected, overlap buys nothing: the expected step is verify + draft
    stuck = CostController(4, 8, costs)
    for _ in range(30):
        stuck.observe(StepObservation(k=4, proposed=4, accepted=0, draft_ms=0, verify_ms=0, warm=False))
    assert stuck.round_ms(4, load=Load(overlap=True)) == pytest.approx(costs.verify_ms(4) + costs.draft_ms(4), rel=0.02)


# ---- the draft catches up in the background -------------------------------------------------------

LONG_PROMPT = [(7 * i + 3) % 23 + 2 for i in range(40)]  # more than CATCH_UP_IN_BACKGROUND tokens


class LongPromptDraft(ScriptedDraft):
    def __init__(self, reference: list[int], delay_s: float) -> None:
        super().__init__([], set(), delay_s)
        self.full = LONG_PROMPT + reference


@pytest.mark.parametrize("overlap", [True, None])
def test_the_first_token_does_not_wait_for_the_draft_prefill(engine, overlap):
    """A prompt of 40 tokens and a draft on another host that takes 150 ms a call: the first steps
    run plainly while one background Propose fills the draft's cache, drafting starts once it is
    back, and the output is plain greedy decoding."""
    reference = greedy_reference(engine.lm.model, LONG_PROMPT, N)
    draft = LongPromptDraft(reference, delay_s=0.15)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=N, ignore_eos=True, overlap=overlap)
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 4, 8), shared_host=False,
                                   target=SlowTarget(engine, 0.02)))
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == reference
    # the catch-up, from the first step (another host): the whole prompt
    assert draft.calls[0] == (len(LONG_PROMPT), 1)
    assert stats.draft_catch_ups == 1
    ks = [s.k for s in steps]
    lead = next(i for i, k in enumerate(ks) if k > 0)
    assert lead >= 2  # several plain steps (20 ms each) went by while the draft (150 ms) prefilled
    assert steps[0].tokens and steps[0].k == 0
    assert all(k > 0 for k in ks[lead:-1])  # then it drafts (the last step may have 1 token left)


def test_sampling_drafts_from_the_first_step(engine):
    """Seeded sampling keeps the synchronous Propose: its k schedule must not depend on timing."""
    reference = greedy_reference(engine.lm.model, LONG_PROMPT, N)
    draft = LongPromptDraft(reference, delay_s=0.05)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=8, ignore_eos=True,
                              sampling=Sampling(temperature=0.9, seed=3))
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 3, 8)))
    assert stats.draft_catch_ups == 0 and steps[0].k == 3


@pytest.mark.parametrize("shared_host", [False, True])
def test_a_long_prompt_catches_up_a_chunk_per_call(engine, shared_host):
    """A prompt longer than the catch-up chunk reaches the draft a chunk per Propose (each a bounded
    prefill within the usual deadline), each call starting where the last ended (in the background
    from another host; before the second step's Propose on the target's); then it drafts, and the
    output is plain greedy decoding."""
    reference = greedy_reference(engine.lm.model, LONG_PROMPT, N)
    draft = LongPromptDraft(reference, delay_s=0.02)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=N, ignore_eos=True, overlap=False,
                              draft_catch_up_chunk=16)
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 4, 8), shared_host=shared_host,
                                   target=SlowTarget(engine, 0.01)))
    assert [t for s in steps for t in s.tokens] == reference
    chunks = [n for n, k in draft.calls if k == 1]
    if shared_host:
        assert steps[0].k == 0 and steps[1].k == 4 and steps[1].draft  # waited for, then drafted at once
    assert chunks[:2] == [16, 32] and stats.draft_catch_ups == len(chunks) == 2
    assert all(0 < b - a <= 16 for a, b in zip([0, *chunks], chunks, strict=False))
    assert stats.draft_fallbacks == 0 and any(s.k > 0 and s.accepted for s in steps)


def test_a_catch_up_chunk_past_its_deadline_halves_and_never_marks_the_draft_down(engine, monkeypatch):
    """The draft is slow, not down: a chunk that misses its deadline is sent again at half the size
    (down to the floor), no fallback is counted, the draft stays usable for every request."""
    import grpc

    from orchestrator import loop

    monkeypatch.setattr(loop, "MIN_CATCH_UP_CHUNK", 4)

    class Slow(LongPromptDraft):
        held = 0

        async def propose(self, session_id, tokens, k, threshold, sampling, yield_cores=False):
            if len(tokens) - self.held > 20:  # more rows than it computes within the deadline
                self.calls.append((len(tokens), k))
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "Deadline Exceeded")
            self.held = len(tokens)
            return await super().propose(session_id, tokens, k, threshold, sampling, yield_cores)

    reference = greedy_reference(engine.lm.model, LONG_PROMPT, N)
    draft = Slow(reference, delay_s=0.01)
    health = DraftHealth(60.0)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=N, ignore_eos=True, overlap=False,
                              draft_catch_up_chunk=32)
    limits = ModelLimits(engine.lm.max_context, 8, 1000, 8, set(), draft_shares_host=False)

    async def go():
        return [e async for e in generate(params, draft, SlowTarget(engine, 0.01), make_controller("fixed", 4, 8),
                                          limits, health, lambda ids: "", in_progress=lambda: 1, background=set())]

    events = asyncio.run(go())
    steps, stats = [e for e in events if isinstance(e, Step)], events[-1].stats
    assert [t for s in steps for t in s.tokens] == reference
    assert [n for n, k in draft.calls[:3]] == [32, 16, 32]  # 32 new tokens missed the deadline, 16 a call made it
    assert stats.draft_fallbacks == 0 and health.usable() and not any(s.draft_error for s in steps)
    assert any(s.k > 0 and s.accepted for s in steps)  # it speculated once caught up


def test_a_catch_up_that_misses_its_deadline_at_the_floor_is_a_fallback(engine, monkeypatch):
    """Halving stops at the floor: a draft too slow even for that fails as any call does (a
    fallback, the draft left alone for its retry interval), and the output stays plain greedy."""
    import grpc

    from orchestrator import loop

    monkeypatch.setattr(loop, "MIN_CATCH_UP_CHUNK", 8)

    class Hopeless(LongPromptDraft):
        async def propose(self, session_id, tokens, k, threshold, sampling, yield_cores=False):
            self.calls.append((len(tokens), k))
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "Deadline Exceeded")

    reference = greedy_reference(engine.lm.model, LONG_PROMPT, 12)
    draft = Hopeless(reference, delay_s=0.0)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=12, ignore_eos=True, draft_catch_up_chunk=32)
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 4, 8), shared_host=False,
                                   target=SlowTarget(engine, 0.01)))
    assert [t for s in steps for t in s.tokens] == reference
    assert [n for n, _ in draft.calls] == [32, 16, 8]  # halved to the floor, then given up
    assert stats.draft_fallbacks == 1 and all(s.k == 0 for s in steps)


def test_a_sampled_request_waits_for_a_chunked_catch_up_then_drafts(engine):
    """Sampling keeps its k schedule free of timing: its first step waits for the chunks, then
    drafts at its k."""
    reference = greedy_reference(engine.lm.model, LONG_PROMPT, N)
    draft = LongPromptDraft(reference, delay_s=0.01)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=8, ignore_eos=True,
                              sampling=Sampling(temperature=0.9, seed=3), draft_catch_up_chunk=16)
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 3, 8)))
    assert draft.calls[:3] == [(16, 1), (32, 1), (40, 3)]
    assert stats.draft_catch_ups == 2 and steps[0].k == 3


@pytest.mark.parametrize("in_flight, shared_host, yields", [(1, True, True), (1, False, False), (0, True, False)])
def test_a_verify_yields_cores_while_another_streams_propose_runs_on_its_host(engine, reference,
                                                                              in_flight, shared_host, yields):
    """Any Propose of this orchestrator in flight (another stream's, here) makes even a plain step's
    Verify leave the draft a core, but only when the draft shares the target's host."""
    draft = ScriptedDraft(reference, set())
    draft.in_flight = in_flight
    target = SlowTarget(engine, 0.0)
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=6, ignore_eos=True, mode="autoregressive")
    steps, _ = asyncio.run(run(engine, draft, params, make_controller("fixed", 0, 8), shared_host, target))
    assert [t for s in steps for t in s.tokens] == reference[:6]
    assert target.yield_cores == [yields] * 6


def test_a_failing_catch_up_costs_drafts_not_the_request(engine):
    """The background catch-up fails (the draft is down): the request goes on plainly, with the
    same output, and the draft is left alone for its retry interval."""
    import grpc

    class Down(LongPromptDraft):
        async def propose(self, session_id, tokens, k, threshold, sampling, yield_cores=False):
            self.calls.append((len(tokens), k))
            await asyncio.sleep(0.03)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")

    reference = greedy_reference(engine.lm.model, LONG_PROMPT, 12)
    draft = Down(reference, delay_s=0.0)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=12, ignore_eos=True)
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 4, 8), shared_host=False,
                                   target=SlowTarget(engine, 0.01)))
    assert [t for s in steps for t in s.tokens] == reference
    assert draft.calls == [(len(LONG_PROMPT), 1)]  # one catch-up; after its failure no Propose for 1 s
    assert stats.draft_catch_ups == 1 and stats.draft_fallbacks == 1
    assert all(s.k == 0 for s in steps)
    # the step that learnt of the failure reports it, as any step that lost its draft does
    assert [s.draft_error for s in steps if s.draft_error] == ["UNAVAILABLE: down"]


@pytest.mark.parametrize("overlap, in_progress, shared_host", [
    (True, 1, True), (False, 1, True), (False, 2, True), (True, 1, False)])
def test_a_propose_yields_cores_only_while_the_target_computes_on_its_host(engine, reference, overlap, in_progress,
                                                                          shared_host):
    """Alternating and alone, the target idles while the draft drafts: that Propose may use every
    core. A pre-draft runs beside a Verify and other streams' Verifies run beside any Propose: those
    leave the target its cores, on a shared host only."""
    draft = ScriptedDraft(reference, {len(PROMPT) + 5})
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, overlap=overlap)
    steps, stats = asyncio.run(run(engine, draft, params, make_controller("fixed", 3, 8), shared_host,
                                   in_progress=in_progress))
    assert [t for s in steps for t in s.tokens] == reference[:N]
    assert len(draft.yield_cores) == len(draft.calls) > 1
    if not shared_host:
        assert not any(draft.yield_cores)
    elif overlap:
        # the first block's Propose runs alone; every later call is a pre-draft beside a Verify, or a
        # fresh draft after a dropped one
        assert draft.yield_cores[0] is False and stats.predrafted > 0
        assert draft.yield_cores.count(True) == stats.predrafted + stats.predrafts_dropped
    else:
        assert draft.yield_cores == [in_progress > 1] * len(draft.calls)


def test_a_propose_yields_cores_while_another_streams_verify_runs(engine, reference):
    """A Verify of this orchestrator in flight (another stream's, here) makes even an alternating
    Propose of a lone request leave the target its cores."""
    target = SlowTarget(engine)
    target.in_flight = 1
    draft = ScriptedDraft(reference, set())
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=8, ignore_eos=True, overlap=False)
    steps, _ = asyncio.run(run(engine, draft, params, make_controller("fixed", 3, 8), target=target))
    assert [t for s in steps for t in s.tokens] == reference[:8]
    assert draft.yield_cores and all(draft.yield_cores)


@pytest.mark.parametrize("shared_host", [True, False])
async def test_the_prompt_prefill_runs_before_the_drafts_catch_up_on_a_shared_host(engine, shared_host):
    """A long prompt leaves the draft far behind. On the target's host the prompt's own pass goes
    first, alone (beside the draft's prefill the first token would come later), then the draft
    catches up before the next step's Propose; on another host it catches up in the background
    from the first step."""
    reference = greedy_reference(engine.lm.model, LONG_PROMPT, 16)

    class CountingTarget(SlowTarget):
        verifies = 0

        async def verify(self, *args, **kwargs):
            result = await super().verify(*args, **kwargs)
            self.verifies += 1
            return result

    target = CountingTarget(engine)

    class Draft(LongPromptDraft):
        seen_verifies: list[int] = []  # verifies answered when each Propose was sent

        async def propose(self, *args, **kwargs):
            self.seen_verifies.append(target.verifies)
            return await super().propose(*args, **kwargs)

    draft = Draft(reference, delay_s=0.01)
    params = GenerationParams(prompt_ids=LONG_PROMPT, max_tokens=16, ignore_eos=True, overlap=False)
    steps, stats = await run(engine, draft, params, make_controller("fixed", 3, 8), shared_host=shared_host,
                             target=target)
    assert [t for s in steps for t in s.tokens] == reference[:16]
    if shared_host:  # 41 tokens behind, within one chunk: the step's own Propose carries them
        assert stats.draft_catch_ups == 0 and draft.calls[0] == (len(LONG_PROMPT) + 1, 3)
        assert steps[0].k == 0 and steps[1].k == 3
    else:
        assert stats.draft_catch_ups == 1 and draft.calls[0] == (len(LONG_PROMPT), 1)
    assert draft.seen_verifies[0] == (1 if shared_host else 0)
    assert steps[0].k == 0 and any(s.k for s in steps)  # speculation still starts once the draft caught up
