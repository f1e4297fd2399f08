"""The planner (specdec.engine.planner): which sessions a step computes and how many rows of each,
without a model: its rules one by one, and the invariants any plan keeps (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.engine.planner import Budget, Need, Plan, Slot, plan


def verify(index: int, cached: int, tokens: int, draft: int = 4, alone: bool = False) -> Need:
    """A Verify's need: ``tokens`` committed, the first ``cached`` in cache, a ``draft``."""
    return Need(index, cached, tokens + draft, draft + 1, alone)


def test_decode_sized_work_shares_the_pass_in_order():
    needs = [verify(0, 99, 100), verify(1, 49, 50), verify(2, 9, 10)]
    step = plan(needs, Budget(256))
    assert step.shared == [Slot(0, 104, 5), Slot(1, 54, 5), Slot(2, 14, 5)] and step.alone == []


def test_a_long_prefill_is_chunked_with_what_is_left_and_gets_no_logits():
    needs = [verify(0, 99, 100), verify(1, 0, 1000)]
    step = plan(needs, Budget(256))
    assert step.shared == [Slot(0, 104, 5), Slot(1, 251, 0)]  # 256 - 5 rows of its committed tokens


def test_the_last_chunk_carries_the_rows_that_want_logits():
    step = plan([verify(0, 990, 1000)], Budget(256))
    assert step.shared == [Slot(0, 1004, 5)]  # whole: the 10 missed tokens and the draft


def test_a_chunk_never_reaches_the_rows_that_want_logits():
    """A prefill whose rows wanting logits would pass the budget stops short of them."""
    step = plan([verify(0, 0, 300, draft=4)], Budget(256, verify_rows=8))
    assert step.shared == [Slot(0, 256, 0)]
    step = plan([verify(0, 256, 300, draft=4)], Budget(256))
    assert step.shared == [Slot(0, 304, 5)]
    # the budget would hold the whole prefill but for the 5 rows wanting logits: it stops before them
    step = plan([verify(0, 0, 254, draft=4)], Budget(256, verify_rows=8))
    assert step.shared == [Slot(0, 253, 0)]


def test_shared_prefill_rows_caps_a_chunk_only_beside_decoding_sessions():
    beside = plan([verify(0, 99, 100), verify(1, 0, 1000)], Budget(256, shared_prefill_rows=32))
    assert beside.shared == [Slot(0, 104, 5), Slot(1, 32, 0)]
    alone = plan([verify(1, 0, 1000)], Budget(256, shared_prefill_rows=32))
    assert alone.shared == [Slot(1, 256, 0)]


def test_a_waiting_prefill_keeps_min_chunk_rows_for_itself():
    """Decode-sized work never takes the last min_chunk rows while a long prefill waits."""
    needs = [verify(i, 59, 60, draft=4) for i in range(4)] + [verify(9, 0, 500)]  # 4 x 5 rows
    step = plan(needs, Budget(36, verify_rows=8))  # 36 - 16 held back: four decodes of 5 rows fit
    assert [s.index for s in step.shared] == [0, 1, 2, 3, 9]
    assert step.shared[-1] == Slot(9, 16, 0)


def test_sampling_jobs_run_alone_chunked_as_if_nothing_else_waited():
    needs = [verify(0, 0, 1000, alone=True), verify(1, 99, 100)]
    step = plan(needs, Budget(256, shared_prefill_rows=32))
    assert step.alone == [Slot(0, 256, 0)]  # the same chunk whatever runs beside it
    assert step.shared == [Slot(1, 104, 5)]


def test_sampling_jobs_share_the_row_budget_in_order():
    """As many alone passes as the budget holds, one at least; a later, smaller one does not
    overtake one that does not fit."""
    needs = [verify(0, 0, 100, alone=True), verify(1, 0, 100, alone=True), verify(2, 0, 2, alone=True)]
    step = plan(needs, Budget(128))
    assert step.alone == [Slot(0, 104, 5)]
    huge = plan([verify(0, 0, 1000, alone=True)], Budget(128))
    assert huge.alone == [Slot(0, 128, 0)]


def test_budget_of_a_service_holds_its_longest_verify():
    assert Budget.of(8, 4, longest_final=33) == Budget(49, 16)
    assert Budget.of(256, 0, longest_final=1) == Budget(256, 0)


needs_lists = st.lists(
    st.tuples(st.integers(0, 600), st.integers(1, 600), st.integers(1, 9), st.booleans()), max_size=12,
).map(lambda rows: [Need(i, min(c, n - 1), n + f - 1, f, a) for i, (c, n, f, a) in enumerate(rows)])


@settings(max_examples=300, deadline=None)
@given(needs=needs_lists, max_rows=st.integers(26, 300), shared=st.sampled_from([0, 16, 64]))
def test_every_plan_keeps_the_invariants(needs, max_rows, shared):
    budget = Budget(max_rows, shared)
    step: Plan = plan(needs, budget)
    by_index = {n.index: n for n in needs}
    indices = [s.index for s in step.slots]
    assert len(indices) == len(set(indices))  # a session once a step
    for slot in step.slots:
        need = by_index[slot.index]
        assert need.cached < slot.end <= need.length
        # logits only with the job's last piece; a chunk stops short of the rows wanting logits
        assert (slot.logits, slot.end) == (need.final, need.length) or (slot.logits == 0 and slot.end <= need.chunk_end)
        assert need.alone == (slot in step.alone)
    shared_rows = sum(s.end - by_index[s.index].cached for s in step.shared)
    assert shared_rows <= max_rows
    for slot in step.alone:
        assert slot.end - by_index[slot.index].cached <= max_rows
    # the oldest job that is decode-sized and batched always runs (no stream starves)
    first = next((n for n in needs if not n.alone and n.rows <= budget.verify_rows), None)
    if first is not None and first.rows <= max_rows - budget.min_chunk:
        assert first.index in indices
    if any(n.alone for n in needs):
        assert step.alone  # one alone pass at least
