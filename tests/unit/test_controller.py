"""k controllers, without any model."""

from __future__ import annotations

import random

import pytest

from orchestrator.controller import (
    AcceptanceController,
    CostController,
    FixedController,
    HFController,
    make_controller,
)
from orchestrator.controller_inputs import Load, StepObservation, Topology, compute_site
from orchestrator.cost_fits import CostCurve, LinearFit
from orchestrator.cost_model import CostModel


def step(k, proposed, accepted, draft_ms=10.0, verify_ms=40.0, warm=True, **load):
    return StepObservation(k=k, proposed=proposed, accepted=accepted, draft_ms=draft_ms, verify_ms=verify_ms,
                           draft_compute_ms=draft_ms * 0.9, warm=warm, **load)


def test_fixed_never_moves():
    c = FixedController(3, 8)
    for accepted in (0, 3, 1):
        c.observe(step(3, 3, accepted))
        assert c.next_k() == 3


def test_hf_heuristic_plus_two_minus_one():
    c = HFController(4, 8)
    c.observe(step(4, 4, 4))
    assert c.next_k() == 6
    c.observe(step(6, 6, 6))
    assert c.next_k() == 8  # clamped at max_k
    c.observe(step(8, 8, 2))
    assert c.next_k() == 7
    for _ in range(10):
        c.observe(step(c.k, c.k, 0))
    assert c.next_k() == 1  # floor 1


def test_acceptance_rule_grows_then_follows_rate():
    c = AcceptanceController(2, 8)
    c.observe(step(2, 2, 2))
    assert c.next_k() == 3
    for _ in range(6):
        c.observe(step(c.k, c.k, 0))  # nothing accepted: rate collapses
    assert c.next_k() == 1
    for _ in range(20):
        c.observe(step(4, 4, 3))  # 75 % acceptance with a rejection every time: a/(1-a) = 3
    assert c.next_k() == 3


def geometric_tokens(alpha: float, k: int) -> float:
    """Expected tokens of a step drafting k when every draft token is accepted with chance alpha."""
    return sum(alpha**j for j in range(k + 1))


def test_expected_tokens_without_position_counts_are_geometric():
    """Before any step, every position's acceptance is the per-step rate: the survival chances are
    alpha^j, and a step drafting k is expected to land sum(alpha^j, j = 0..k) tokens."""
    for successes, failures in ((0.0, 1.0), (1.0, 0.0), (1.0, 1.0)):
        c = CostController(4, 8)
        c.own.successes, c.own.failures = successes, failures
        alpha = c.alpha
        assert sum(c.survival(5)) == pytest.approx(geometric_tokens(alpha, 5))
    assert sum(c.survival(2)) == pytest.approx(1.75)


def test_cost_controller_picks_long_drafts_when_cheap_and_accepted():
    c = CostController(2, 8)
    for _ in range(30):
        # verify barely grows with k, drafting is cheap, everything is accepted
        k = c.next_k()
        c.observe(step(k, k, k, draft_ms=2.0 * k + 0.5, verify_ms=40 + 1.0 * k))
    assert c.next_k() >= 6


def test_cost_controller_turns_speculation_off_when_it_does_not_pay():
    c = CostController(4, 8, probe_every=1000)
    for _ in range(40):
        k = c.next_k()
        # drafting costs as much as verifying and nothing is ever accepted
        c.observe(step(k, k, 0, draft_ms=35.0 * k, verify_ms=40 + 5.0 * k))
    assert c.alpha < 0.7  # learned from the rejections before it stopped drafting
    assert c.next_k() == 0


def test_cost_controller_probes_after_choosing_zero_ever_more_rarely():
    """After k = 0 it probes with one draft token in place of the 3rd plain step, then of the 6th,
    12th, ...: each probe that still leaves k = 0 best doubles the gap (up to MAX_PROBE_GAP)."""
    c = CostController(4, 8, probe_every=3)
    ks = []
    for _ in range(200):
        k = c.next_k()
        ks.append(k)
        c.observe(step(k, k, 0, draft_ms=35.0 * max(k, 1), verify_ms=40 + 5.0 * k))
    first_plain = ks.index(0)
    probes = [i for i in range(first_plain, len(ks)) if ks[i] > 0]
    assert set(ks[first_plain:]) == {0, 1}
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] == [6, 12, 24] and max(gaps) == CostController.MAX_PROBE_GAP
    assert probes[0] - first_plain == 2


def test_probe_gap_resets_once_speculation_pays_again():
    """The same draft costs throughout: nothing accepted (the probes grow apart), then everything
    (an accepted probe brings drafting back, and the gap starts again from probe_every)."""
    c = CostController(4, 8, probe_every=3)
    for _ in range(10):  # cheap drafts, accepted: the controller learns the costs
        k = c.next_k()
        c.observe(step(k, k, k, draft_ms=2 + 8.0 * k, verify_ms=40 + 3.0 * k))
    for _ in range(80):
        k = c.next_k()
        c.observe(step(k, k, 0, draft_ms=2 + 8.0 * k, verify_ms=40 + 3.0 * k))
    assert c._probe_gap > 3
    ks = []
    for _ in range(150):
        k = c.next_k()
        ks.append(k)
        c.observe(step(k, k, k, draft_ms=2 + 8.0 * k, verify_ms=40 + 3.0 * k))
    assert min(ks[-20:]) > 0 and c._probe_gap == 3


def test_cost_model_fits_verify_and_draft_lines():
    m = CostModel(decay=1.0)
    for k, ms in [(0, 30), (2, 40), (4, 50), (8, 70)]:
        m.observe_verify(k, ms)
    assert m.verify_ms(6) == pytest.approx(60, rel=1e-6)
    assert m.verify_ms(0) == pytest.approx(30, rel=1e-6)
    for k in (2, 4, 6):
        m.observe_draft(k, 10.0 * k)
    assert m.draft_ms(3) == pytest.approx(30.0, rel=1e-6) and m.draft_ms(0) == 0.0


def test_draft_catch_up_is_not_a_per_token_cost():
    m = CostModel(decay=1.0)
    m.observe_draft(4, 40.0)
    m.observe_draft(1, 400.0, catch_up=60)  # a probe after plain steps re-reads 60 tokens
    assert m.draft_ms(4) == pytest.approx(40.0, rel=1e-6)


def test_cost_controller_resumes_drafting_when_probes_are_accepted():
    """After a stretch of plain decoding, accepted probes bring speculation back even though
    each probe's draft call first catches up on the tokens it missed."""
    c = CostController(4, 8, probe_every=4)
    for _ in range(10):  # drafting is cheap and accepted: the controller learns the costs
        k = c.next_k()
        c.observe(step(k, k, k, draft_ms=2 + 8.0 * k, verify_ms=40 + 3.0 * k))
    for _ in range(12):  # then a stretch where nothing is accepted: it stops drafting
        k = c.next_k()
        c.observe(step(k, k, 0, draft_ms=2 + 8.0 * k, verify_ms=40 + 3.0 * k))
    ks = []
    for _ in range(40):  # text becomes predictable again; probes pay a catch-up
        k = c.next_k()
        ks.append(k)
        obs = step(k, k, k, draft_ms=(2 + 8.0 * k) + (150.0 if k == 1 else 0.0), verify_ms=40 + 3.0 * k)
        obs.draft_catch_up = 20 if k == 1 else 2
        c.observe(obs)
    assert ks[-1] >= 4


def test_first_step_costs_do_not_count():
    c = CostController(4, 8)
    c.observe(step(4, 4, 4, verify_ms=900.0, warm=False))  # prompt prefill
    assert c.costs.verify_ms(4) is None
    assert c.alpha > 0.8  # but its acceptance does


def test_make_controller():
    assert isinstance(make_controller("cost", 4, 8), CostController)
    with pytest.raises(ValueError, match="unknown controller"):
        make_controller("magic", 4, 8)


def _serve(c: CostController, steps: int, sessions: int, alpha_hits: bool = True) -> list[int]:
    """Run ``steps`` steps of a controller at a load of ``sessions`` streams batched together,
    with costs like the embedded pair on 2 cores: a verify pass costs 25 ms + 1.4 ms per row across
    all sessions, a draft step 12 ms + 2 ms per session in it; everything is accepted."""
    ks = []
    for _ in range(steps):
        k = c.next_k()
        ks.append(k)
        rows = sessions * (k + 1)
        c.observe(step(k, k, k if alpha_hits else 0, draft_ms=k * (12 + 2.0 * sessions), verify_ms=25 + 1.4 * rows,
                       verify_rows=rows, verify_sessions=sessions, draft_sessions=sessions))
    return ks


def test_cost_model_prices_rows_across_the_batch():
    m = CostModel(decay=1.0, share_decay=0.0)
    for rows, sessions in [(2, 1), (5, 1), (16, 8), (40, 8)]:
        m.observe_verify(0, 25 + 1.4 * rows, rows=rows, sessions=sessions)
    # the last pass had 8 sessions: a k of 4 means 8 x 5 rows
    assert m.verify_ms(4) == pytest.approx(25 + 1.4 * 40, rel=1e-6)
    assert m.verify_ms(0) == pytest.approx(25 + 1.4 * 8, rel=1e-6)
    for sessions in (1, 8):
        m.observe_draft(4, 4 * (12 + 2.0 * sessions), sessions=sessions)
    assert m.draft_ms(3) == pytest.approx(3 * (12 + 2.0 * 8), rel=1e-6)


def test_k_falls_as_the_load_rises():
    """Shared costs: at one stream long drafts pay; with 32 streams in every pass the rows of a
    draft cost more than its accepted tokens bring, and the controller decodes plainly."""
    costs = CostModel()
    alone = _serve(CostController(4, 8, costs), 30, sessions=1)
    assert alone[-1] >= 4
    busy = _serve(CostController(4, 8, costs, probe_every=1000), 60, sessions=32)
    assert busy[-1] < alone[-1]
    crowded = CostModel()
    ks = _serve(CostController(4, 8, crowded, probe_every=1000), 60, sessions=64, alpha_hits=False)
    assert ks[-1] == 0


def _cpu_bound_costs(target_host, draft_host, streams=16):
    """A batch of 16 sessions where rows are nearly free on the clock (25 ms + 0.5 ms per row) but
    not on the CPU (20 ms + 4 ms of CPU per row; a draft step of 16 sessions costs 30 ms of CPU)."""
    m = CostModel(decay=1.0, share_decay=0.0)
    for rows in (16, 32, 48, 80):
        m.observe_verify(0, 25 + 0.5 * rows, rows=rows, sessions=16, cpu_ms=20 + 4.0 * rows)
    for sessions in (8, 16):
        m.observe_draft(2, 2 * 10.0, sessions=sessions, step_cpu_ms=30.0 * sessions / 16)
    load = Load(streams=streams, topology=Topology(target_host, draft_host))
    c = CostController(4, 8, m)
    c.own.successes, c.own.failures = 90.0, 10.0  # alpha 0.9
    return m, c, load


def test_saturated_shared_cores_make_plain_decoding_win():
    """On one 2-core host every draft token's CPU is taken from the target: with 16 streams the
    machine, not any one stream's latency, sets the pace, and plain decoding wins on CPU per token,
    although each stream's wall-time model alone favours drafting."""
    m, c, load = _cpu_bound_costs(("host-a", 2.0), ("host-a", 2.0))
    wall_only = max(range(9), key=lambda k: geometric_tokens(0.9, k) / (m.verify_ms(k) + m.draft_ms(k)))
    assert wall_only >= 3
    assert m.cpu_round_ms(0, load) == pytest.approx((20 + 4.0 * 16) / 2)
    assert c.next_k(load) == 0


def test_separate_hosts_keep_drafting():
    """The same CPU costs with the draft on a host of its own: drafting takes nothing from the
    target, and a short draft still pays."""
    m, c, load = _cpu_bound_costs(("host-a", 2.0), ("host-b", 2.0))
    assert m.cpu_round_ms(2, load) == pytest.approx((20 + 4.0 * 48) / 2)
    assert c.next_k(load) >= 1

def test_one_stream_on_shared_cores_is_paced_by_its_wall_time():
    m, c, load = _cpu_bound_costs(("host-a", 2.0), ("host-a", 2.0), streams=1)
    m.verify_sessions = m.draft_sessions = 1.0  # nobody else in the passes
    assert all(m.cpu_round_ms(k, load) < m.verify_ms(k) + m.draft_ms(k) for k in range(9))
    assert c.next_k(load) >= 4


@pytest.mark.parametrize("hosts, limit, streams, drafts", [
    ((("h", 2.0), ("h", 2.0)), 1, 2, False),  # shared cores, two streams: plain decoding
    ((("h", 2.0), ("h", 2.0)), 1, 1, True),  # shared cores, one stream: the cost model decides
    ((("h", 2.0), ("h", 2.0)), 0, 8, True),  # limit off
    ((("h", 2.0), ("other", 2.0)), 1, 8, True),  # the draft has its own host
    ((None, None), 1, 8, True),  # hosts unknown
])
def test_shared_host_stream_limit(hosts, limit, streams, drafts):
    """``shared_host_max_streams``: with the draft on the target's cores and more generations in
    progress than the limit, the cost controller decodes plainly (and does not probe); otherwise
    the cost model alone decides (here cheap, well-accepted drafts: it drafts)."""
    m = CostModel(shared_host_max_streams=limit)
    load = Load(streams=streams, topology=Topology(*hosts))
    c = CostController(4, 8, m, probe_every=2)
    for _ in range(20):
        k = c.next_k(load)
        c.observe(step(k, k, k, draft_ms=2.0 * k + 0.5, verify_ms=40 + 1.0 * k))
    picks = [c.next_k(load) for _ in range(6)]
    assert (max(picks) > 0) is drafts
    assert not c.probing


def test_a_service_computes_on_its_hosts_cores_or_on_its_device():
    """Info's device as well as its host: only services at the same site share compute."""
    assert compute_site("h", "cpu", 2.0) == compute_site("h", "", 2.0) == ("h", 2.0)
    assert compute_site("h", "cuda:0", 16.0) == compute_site("h", "cuda", 16.0) == ("h/cuda:0", 1.0)
    assert compute_site("h", "cuda:1", 16.0) == ("h/cuda:1", 1.0)
    assert compute_site("", "cuda:0", 2.0) is None  # host unknown: no CPU term, nothing shared


def test_a_gpu_target_beside_a_cpu_draft_keeps_drafting_under_load():
    """On one host, a target on its GPU and a llama.cpp draft on the host's cores: the draft's CPU
    is not the target's, so the shared-host stream limit does not stop speculation and the
    draft's CPU costs load only the host's cores."""
    m, c, load = _cpu_bound_costs(compute_site("host-a", "cuda:0", 2.0), compute_site("host-a", "cpu", 2.0))
    m.shared_host_max_streams = 1
    assert m.speculation_allowed(load)
    assert m.cpu_round_ms(2, load) == pytest.approx(20 + 4.0 * 48)  # one device, one pass at a time
    assert c.next_k(load) >= 1
    cpu_only = Topology(compute_site("host-a", "cpu", 2.0), compute_site("host-a", "cpu", 2.0))
    assert not m.speculation_allowed(Load(streams=load.streams, topology=cpu_only))


def test_unknown_hosts_mean_no_cpu_term():
    m, _, load = _cpu_bound_costs(None, None)
    assert m.cpu_round_ms(3, load) == 0.0
    assert m.round_ms(3, load) == pytest.approx(m.verify_ms(3) + m.draft_ms(3))


@pytest.mark.parametrize("rtt_ms", [0.0, 5.0, 20.0])
def test_a_far_draft_costs_a_round_trip_per_call_not_per_token(rtt_ms):
    """A Propose of k tokens costs rtt + k * step. Priced per token alone (wall / tokens), a 20 ms
    round trip made one-token drafts look 3x dearer than they are and pushed k to 0, where a
    measured run showed k = 4 still 1.3x faster than plain decoding."""
    costs = CostModel()
    c = CostController(4, 8, costs)
    chosen = []
    rng = random.Random(rtt_ms)
    for _ in range(60):
        k = c.next_k()
        chosen.append(k)
        if k == 0:
            c.observe(StepObservation(k=0, proposed=0, accepted=0, draft_ms=0, verify_ms=37, draft_catch_up=0))
            continue
        accepted = next((j for j in range(k) if rng.random() > 0.94), k)  # 94 % per token
        c.observe(StepObservation(k=k, proposed=k, accepted=accepted, draft_ms=rtt_ms + 2 + 10.5 * k,
                                  verify_ms=37 + 4.5 * k, draft_catch_up=1))
    assert costs.draft_ms(4) == pytest.approx(rtt_ms + 2 + 42, rel=0.1)
    assert costs.draft_call.intercept() == pytest.approx(rtt_ms + 2, abs=1.5)
    assert min(chosen[-20:]) >= 4


def test_a_predrafted_step_does_not_feed_the_draft_cost():
    """A pre-draft ran next to the previous Verify and drafted one token more than it gave: its wall
    time is not what a Propose costs, so only fresh drafts train the draft fit (verify still counts)."""
    costs = CostModel()
    c = CostController(4, 8, costs)
    for k in (2, 4, 2, 4):
        c.observe(StepObservation(k=k, proposed=k, accepted=k, draft_ms=2 + 10 * k, verify_ms=40, draft_catch_up=1))
    before = costs.draft_ms(4)
    c.observe(StepObservation(k=4, proposed=4, accepted=4, draft_ms=500, verify_ms=40, draft_catch_up=0, predrafted=True))
    assert costs.draft_ms(4) == before == pytest.approx(42, rel=0.05)
    assert costs.verify.count > 4  # the Verify of that step was observed


def test_verify_cost_follows_a_curve_not_a_line():
    """The target's pass is steep from 1 to 5 rows (MKL) and flat beyond (oneDNN): the model reads
    the measured curve, so long drafts are priced at the flat part's cost, and drafting k = 8
    beats k = 4 where a line through the same points would say otherwise."""
    m = CostModel(decay=1.0)
    measured = {1: 57.0, 5: 85.0, 7: 92.0, 9: 99.0}
    for rows, ms in measured.items():
        m.observe_verify(rows - 1, ms)
    assert m.verify_ms(0) == pytest.approx(57.0) and m.verify_ms(8) == pytest.approx(99.0)
    assert m.verify_ms(5) == pytest.approx(88.5)  # between 5 and 7 rows
    assert m.verify_ms(11) == pytest.approx(109.5)  # beyond: along the last segment
    assert m.verify_ms(1) == pytest.approx(64.0)  # between 1 and 5 rows
    line = LinearFit(1.0)
    for rows, ms in measured.items():
        line.add(rows, ms)
    assert line.predict(9, 0.1) - line.predict(5, 0.1) > 1.5 * (m.verify_ms(8) - m.verify_ms(4))
    for k in (2, 4, 8):
        m.observe_draft(k, 8.0 * k)
    c = CostController(4, 8, m)
    c.own.successes, c.own.failures = 95.0, 5.0
    assert c.next_k() == 8


def test_a_cost_curve_never_gets_cheaper_beyond_what_it_measured():
    curve = CostCurve(1.0)
    curve.add(4, 80.0)
    curve.add(5, 70.0)  # noise: 5 rows measured cheaper than 4
    assert curve.predict(9, 0.1) == pytest.approx(70.0)
    assert curve.predict(4.5, 0.1) == pytest.approx(75.0)
    assert curve.predict(1, 0.1) == pytest.approx(80.0)  # nor more expensive for fewer
    assert CostCurve(1.0).predict(3, 0.1) is None


def test_position_acceptance_prices_long_drafts_that_survive_their_hard_tokens():
    """Drafts fail at their first or second token now and then and otherwise run through: per-step
    alpha (accepted / (accepted + rejections)) is ~0.8, which prices an 8th token at 0.17 tokens,
    but a draft that got past position 2 is always accepted. The per-position estimate sees that and
    drafts long; the geometric one would stop at 2-3."""
    costs = CostModel(decay=1.0)
    for rows, ms in {1: 57.0, 3: 62.0, 5: 85.0, 9: 99.0}.items():
        costs.observe_verify(rows - 1, ms)
    for k in (2, 4, 8):
        costs.observe_draft(k, 2 + 8.0 * k)
    c = CostController(8, 8, costs)
    for step in range(40):
        accepted = 0 if step % 3 == 0 else 1 if step % 3 == 1 else 8
        c.observe(StepObservation(k=8, proposed=8, accepted=accepted, draft_ms=66, verify_ms=99))
    assert c.alpha < 0.85
    assert c.acceptance_at(1) == c.alpha and c.acceptance_at(5) > 0.95
    geometric = max(range(9), key=lambda k: geometric_tokens(c.alpha, k) / costs.round_ms(k))
    assert geometric <= 3 and c.next_k() == 8


def test_cost_prices_a_long_k_at_the_draft_length_it_is_expected_to_reach():
    """Half the drafts stop after 2 tokens (low confidence), the rest run to k = 8, and every draft
    token is accepted. Asking for 8 then costs ~5 drafted tokens and 6 verified rows, and lands ~6
    tokens: the choice is priced at the expected draft length, not at k."""
    costs = CostModel(decay=1.0)
    for rows in (1, 3, 9):
        costs.observe_verify(rows - 1, 50.0 + rows)  # verify: 50 ms + 1 ms per row
    for k in (2, 8):
        costs.observe_draft(k, 2.0 + 12.0 * k)  # draft: 2 ms per call + 12 ms per token
    c = CostController(8, 8, costs)
    for i in range(200):
        n = 8 if i % 2 else 2
        c.observe(StepObservation(k=8, proposed=n, accepted=n, draft_ms=2 + 12.0 * n, verify_ms=51.0 + n))
    assert c.continue_at(1) == 1.0 and c.continue_at(2) == pytest.approx(1.0, abs=0.05)
    assert c.continue_at(3) == pytest.approx(0.5, abs=0.08)  # recent steps weigh more, and a prior of "goes on"
    assert all(c.continue_at(j) == pytest.approx(1.0, abs=0.05) for j in range(4, 9))
    assert c.next_k() == 8
    drafted = sum(c.reach(8)[1:])
    assert drafted == pytest.approx(2 + 6 * 0.5, abs=0.5)
    assert c.last_choice[8] == pytest.approx((1 + drafted) / (50 + drafted + 1 + 2 + 12 * drafted), rel=0.05)
    # priced at k itself the same step would look a third dearer
    assert c.last_choice[8] > 1.25 * (1 + drafted) / (50 + 9 + 2 + 12 * 8)


def test_positions_seldom_reached_inherit_the_acceptance_of_those_before_them():
    """Drafts of 8 fail at position 1 two times in three and otherwise run through: positions
    9-16, never reached, are priced like position 8 (~1), not at alpha, so a controller allowed 16
    tokens drafts that far when a token is cheap."""
    costs = CostModel(decay=1.0)
    for rows in (1, 9, 17):
        costs.observe_verify(rows - 1, 50.0 + rows)
    for k in (2, 8):
        costs.observe_draft(k, 2.0 + 4.0 * k)
    c = CostController(8, 16, costs)
    for step in range(60):
        accepted = 0 if step % 3 else 8
        c.observe(StepObservation(k=8, proposed=8, accepted=accepted, draft_ms=34, verify_ms=59))
    assert c.alpha < 0.9
    assert c.acceptance_at(1) == c.alpha  # its own rate (1/3) is below alpha
    assert c.acceptance_at(12) == pytest.approx(c.acceptance_at(8), abs=0.02) and c.acceptance_at(12) > 0.95
    assert c.next_k() == 16


def test_a_new_request_starts_from_what_earlier_requests_of_the_pair_did():
    """Requests share the cost model's draft history: after one request saw long drafts accepted,
    the next one drafts long from its first step, where a request with no history starts from
    alpha's prior of 0.8 and drafts shorter. The new request's own counts weigh at most
    HISTORY_PRIOR steps, so its own text takes over quickly."""
    def costs_model() -> CostModel:
        costs = CostModel(decay=1.0)
        for rows in (1, 9, 17):
            costs.observe_verify(rows - 1, 50.0 + rows)
        for k in (2, 8):
            costs.observe_draft(k, 2.0 + 8.0 * k)
        return costs

    shared = costs_model()
    first = CostController(4, 16, shared)
    for _ in range(30):
        k = 16
        first.observe(StepObservation(k=k, proposed=k, accepted=k, draft_ms=2 + 8.0 * k, verify_ms=50.0 + k))
    second = CostController(4, 16, shared)
    blind = CostController(4, 16, costs_model())
    assert second.alpha > 0.95 and blind.alpha == pytest.approx(0.8)
    assert second.next_k() == 16 and blind.next_k() < 16
    assert max(second.own.reached) <= CostController.HISTORY_PRIOR + 1e-9
    for _ in range(10):  # its own text fails at the first token every time
        second.observe(StepObservation(k=4, proposed=4, accepted=0, draft_ms=34, verify_ms=55))
    assert second.alpha < 0.5


def test_a_stale_draft_cost_is_explored_again(monkeypatch):
    """A burst of slow Proposes priced drafting out (k = 0); no Propose confirms the cost after
    that, so once it is older than DRAFT_COST_TTL_S the controller drafts again to re-measure."""
    import time as _time

    now = [1000.0]
    monkeypatch.setattr(_time, "monotonic", lambda: now[0])
    costs = CostModel(decay=1.0)
    c = CostController(4, 8, costs, probe_every=1000)
    for k in (2, 4, 6):  # the draft looked as dear as 60 ms a token
        c.observe(StepObservation(k=k, proposed=k, accepted=k, draft_ms=60.0 * k, verify_ms=40 + 2.0 * k))
    assert c.next_k() == 0
    now[0] += CostModel.DRAFT_COST_TTL_S / 2
    assert c.next_k() == 0
    now[0] += CostModel.DRAFT_COST_TTL_S
    assert costs.draft_ms(4) is None and c.next_k() >= 1
    c.observe(StepObservation(k=4, proposed=4, accepted=4, draft_ms=4 * 8.0, verify_ms=48))
    # the stale fits were dropped: the new measurement alone prices the draft
    assert costs.draft_ms(4) == pytest.approx(32.0, rel=0.01) and c.next_k() >= 4
