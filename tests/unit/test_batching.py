"""Continuous batching: ragged forward passes over many sessions give the same results as one
session at a time; the scheduler batches whatever waits, chunks long prefills, and keeps order."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec import sampling as sm
from specdec.engine.compute import PENDING, ComputeThread
from specdec.engine.executor import ForwardRequest
from specdec.engine.sessions import SessionStore
from specdec.models import load_hf
from target_service.verify import TargetEngine
from tests.support import greedy_reference

ARCHS = ["gpt2", "llama"]
PROMPTS = [[7, 3, 12, 5, 9, 20, 2, 11], [1, 2, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 2, 3], [5]]


@pytest.fixture(scope="module", params=ARCHS)
def loaded(tiny_models, request):
    return load_hf(tiny_models[f"{request.param}-target"])


def engine_of(loaded, max_batch_rows: int = 256) -> TargetEngine:
    return TargetEngine(loaded, SessionStore(16, 1 << 30, 0), max_draft_tokens=8, max_batch_rows=max_batch_rows)


def test_one_ragged_pass_equals_separate_passes(loaded):
    """Sessions at different lengths, some extending a cache and some starting cold, in one pass."""
    engine = engine_of(loaded)
    lm = engine.lm
    sessions = [lm.session(f"s{i}") for i in range(len(PROMPTS))]
    lm.forward_batch([ForwardRequest(sessions[0], PROMPTS[0][:5], 1), ForwardRequest(sessions[2], PROMPTS[2][:9], 1)])
    requests = [ForwardRequest(s, p + [4, 4], 3) for s, p in zip(sessions, PROMPTS, strict=True)]
    results = lm.forward_batch(requests)
    assert [r.cached for r in results] == [5, 0, 9, 0]
    for prompt, result in zip(PROMPTS, results, strict=True):
        with torch.inference_mode():
            ref = loaded.model(input_ids=torch.tensor([prompt + [4, 4]])).logits[0, -3:]
        torch.testing.assert_close(result.logits, ref, rtol=1e-4, atol=1e-5)
        assert result.logits.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_batched_greedy_decoding_equals_plain_greedy(loaded):
    """Every session decodes by repeated batched steps with drafts; each equals plain greedy."""
    engine = engine_of(loaded)
    refs = [greedy_reference(loaded.model, p, 10) for p in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    for step in range(6):
        jobs = []
        for i, seq in enumerate(seqs):
            ref_next = refs[i][len(seq) - len(PROMPTS[i]):]
            draft = ref_next[:2] + [0] if step % 2 else [1, 2]  # right drafts on odd steps, wrong on even
            jobs.append(engine.prepare(f"g{i}", seq, draft[: max(0, min(3, len(ref_next) - 1))]))
        result = engine.step(jobs)
        assert result.sessions == len(jobs)
        for i, (job, v) in enumerate(zip(jobs, result.outcomes, strict=True)):
            assert v.batch_sessions == len(jobs) and v.batch_rows == result.rows
            seqs[i] += job.draft[: v.num_accepted] + [v.next_token]
    for seq, prompt, ref in zip(seqs, PROMPTS, refs, strict=True):
        assert seq[len(prompt):] == ref[: len(seq) - len(prompt)]


def test_long_prefill_is_chunked_and_short_jobs_go_first(loaded):
    engine = engine_of(loaded, max_batch_rows=32)
    long_prompt = [(i * 7) % 40 + 1 for i in range(80)]
    jobs = [engine.prepare("long", long_prompt), engine.prepare("short", PROMPTS[0], [1, 2])]
    first = engine.step(jobs)
    assert first.outcomes[0] is PENDING and first.outcomes[1] is not PENDING  # the short one is served at once
    steps = 1
    while (outcome := engine.step(jobs[:1]).outcomes[0]) is PENDING:
        steps += 1
        assert steps < 20
    assert steps == 2  # 80 tokens in three passes of at most 32 rows: 22 (beside the short job), 32, 26
    assert outcome.next_token == greedy_reference(loaded.model, long_prompt, 1)[0]
    assert engine.store.get_or_create("long", lambda: None).tokens == long_prompt


def test_a_prefill_beside_decodes_takes_a_small_chunk_and_alone_a_large_one(loaded):
    """shared_prefill_rows bounds a long prefill's chunk in a pass that also decodes for other
    sessions (their next token stays close); alone, the prefill uses the whole max_batch_rows."""
    engine = TargetEngine(loaded, SessionStore(16, 1 << 30, 0), max_draft_tokens=8, max_batch_rows=128,
                          shared_prefill_rows=16)
    long_prompt = [(i * 7) % 40 + 1 for i in range(90)]
    short = engine.prepare("short", PROMPTS[0], [1, 2])
    first = engine.step([engine.prepare("long", long_prompt), short])
    assert first.outcomes[0] is PENDING and first.rows == len(PROMPTS[0]) + 2 + 16
    second = engine.step([engine.prepare("long", long_prompt)])  # alone: the remaining 74 rows at once
    assert second.outcomes[0] is not PENDING and second.rows == 90 - 16
    assert second.outcomes[0].next_token == greedy_reference(loaded.model, long_prompt, 1)[0]


def test_two_calls_on_one_session_never_share_a_pass(loaded):
    engine = engine_of(loaded)
    a = engine.prepare("same", PROMPTS[0])
    b = engine.prepare("same", PROMPTS[0] + [3])
    result = engine.step([a, b])
    assert result.outcomes[0] is not PENDING and result.outcomes[1] is PENDING
    assert engine.step([b]).outcomes[0].cached_tokens == len(PROMPTS[0])


def test_sampling_in_a_batch_is_reproducible(loaded):
    engine = engine_of(loaded)
    s = sm.Sampling(temperature=0.8, seed=11)
    alone = [engine.verify(f"alone{i}", p, sampling=s).next_token for i, p in enumerate(PROMPTS)]
    batched = engine.step([engine.prepare(f"b{i}", p, sampling=s) for i, p in enumerate(PROMPTS)])
    assert [v.next_token for v in batched.outcomes] == alone


def test_sampling_passes_count_against_the_row_budget(loaded):
    """Six sampling requests, each a pass of its own, and a greedy one: a step computes the greedy
    request's token and as many sampling passes as its row budget holds (one at least), not all of
    them; each sampled token is still the one it gets alone."""
    s = sm.Sampling(temperature=0.8, seed=4)
    prompts = [[(7 * i + j) % 40 + 2 for j in range(30)] for i in range(6)]
    alone = [engine_of(loaded, 32).verify(f"a{i}", p, sampling=s).next_token for i, p in enumerate(prompts)]
    engine = engine_of(loaded, max_batch_rows=32)
    jobs = [engine.prepare(f"s{i}", p, sampling=s) for i, p in enumerate(prompts)] + [engine.prepare("g", [1, 2, 3])]
    got: dict[int, int] = {}
    steps = 0
    while len(got) < len(jobs):
        waiting = [i for i in range(len(jobs)) if i not in got]
        result = engine.step([jobs[i] for i in waiting])
        steps += 1
        assert result.rows <= engine.max_batch_rows + 30, result.rows  # the budget, plus one pass at most
        if steps == 1:
            assert result.outcomes[-1] is not PENDING  # the greedy request got its token at once
        for i, outcome in zip(waiting, result.outcomes, strict=True):
            if outcome is not PENDING:
                got[i] = outcome.next_token
    assert [got[i] for i in range(len(prompts))] == alone
    assert steps >= 3  # spread over steps, not one pass of 180 rows


def test_scheduler_batches_what_waits(loaded):
    """Calls from many threads meet in shared passes; every answer is the one it gets alone."""
    engine = engine_of(loaded)
    compute = ComputeThread(max_queued=16, service="test-batching")
    stop = threading.Event()
    expected = [engine.verify(f"ref{i}", p, [1, 2]) for i, p in enumerate(PROMPTS * 3)]

    def call(i: int, prompt: list[int]):
        return compute.submit(engine, engine.prepare(f"c{i}", prompt, [1, 2]))

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(call, i, p) for i, p in enumerate(PROMPTS * 3)]
        pool.submit(lambda: [f.result() for f in futures] and stop.set())
        compute.serve(stop)
    got = [f.result() for f in futures]
    assert [(v.num_accepted, v.next_token) for v in got] == [(v.num_accepted, v.next_token) for v in expected]
    stats = compute.snapshot()
    assert stats.calls == 12 and stats.forwards < 12 and stats.sessions == 12  # fewer passes than calls
    assert max(v.batch_sessions for v in got) > 1
    assert stats.rows == sum(len(p) + 2 for p in PROMPTS * 3)  # every session cold: its tokens and its draft


# ---- drafting in batches ------------------------------------------------------------------------

def _draft_all_in_steps(proposer, jobs):
    """Step the jobs together until each has its proposal; returns (proposals, steps taken)."""
    outcomes, steps = [PENDING] * len(jobs), 0
    while any(o is PENDING for o in outcomes):
        open_ = [i for i, o in enumerate(outcomes) if o is PENDING]
        result = proposer.step([jobs[i] for i in open_])
        steps += 1
        for i, o in zip(open_, result.outcomes, strict=True):
            outcomes[i] = o
    return outcomes, steps


def test_transformers_drafts_in_batches_equal_drafts_alone(tiny_models):
    from draft_service.backends.hf import TransformersProposer

    proposer = TransformersProposer(load_hf(tiny_models["llama-draft"]), SessionStore(16, 1 << 30, 0), 8)
    asks = [(PROMPTS[0], 5, 0.0), (PROMPTS[1], 3, 0.0), (PROMPTS[2], 8, 0.5), (PROMPTS[3], 6, 0.0)]
    alone = [proposer.propose(f"a{i}", p, k, t) for i, (p, k, t) in enumerate(asks)]
    jobs = [proposer.prepare(f"b{i}", p, k, t) for i, (p, k, t) in enumerate(asks)]
    together, steps = _draft_all_in_steps(proposer, jobs)
    assert [p.tokens for p in together] == [p.tokens for p in alone]
    assert [p.stop_reason for p in together] == [p.stop_reason for p in alone]
    assert steps == max(len(p.tokens) for p in alone)  # k batched steps, not the sum of all drafts
    assert together[0].batch_sessions > 1


def test_draft_sampling_passes_count_against_a_row_budget(tiny_models):
    """Sampling drafts each run a pass of their own: one step holds as many of them as its row
    budget allows (one at least, in order), and each draft is still the one it gets alone."""
    from draft_service.backends.hf import TransformersProposer
    from specdec.engine.planner import Budget

    proposer = TransformersProposer(load_hf(tiny_models["llama-draft"]), SessionStore(16, 1 << 30, 0), 8,
                                    budget=Budget(40))
    s = sm.Sampling(temperature=0.9, seed=2)
    prompts = [[(5 * i + j) % 40 + 2 for j in range(30)] for i in range(5)]
    alone = [proposer.propose(f"a{i}", p, 3, 0.0, s) for i, p in enumerate(prompts)]
    jobs = [proposer.prepare(f"b{i}", p, 3, 0.0, s) for i, p in enumerate(prompts)] + \
        [proposer.prepare("g", [1, 2, 3], 3, 0.0)]
    outcomes, first_rows = [PENDING] * len(jobs), None
    while any(o is PENDING for o in outcomes):
        open_ = [i for i, o in enumerate(outcomes) if o is PENDING]
        result = proposer.step([jobs[i] for i in open_])
        first_rows = result.rows if first_rows is None else first_rows
        assert result.rows <= 40 + 30 + 3, result.rows  # the budget, one pass past it, the greedy draft
        for i, o in zip(open_, result.outcomes, strict=True):
            outcomes[i] = o
    assert first_rows < 5 * 30  # not every sampling prefill in the first step
    assert [p.tokens for p in outcomes[:5]] == [p.tokens for p in alone]


@pytest.mark.embedded
def test_llamacpp_drafts_in_batches_equal_drafts_alone():
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.models import embedded_gguf_path

    proposer = LlamaCppProposer(str(embedded_gguf_path()), 8, 64 << 20, 0, 16)
    prompts = [[504, 1296, 3003, 4683, 359], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9000, 42, 17], [360, 1080, 2300, 28]]
    alone = [proposer.propose(f"a{i}", p, 6) for i, p in enumerate(prompts)]
    jobs = [proposer.prepare(f"b{i}", p, 6) for i, p in enumerate(prompts)]
    together, steps = _draft_all_in_steps(proposer, jobs)
    # llama.cpp may sum a batch in another order than a single row; a draft that differs is only
    # slower, never wrong, but on these prompts the greedy drafts agree
    assert [p.tokens for p in together] == [p.tokens for p in alone]
    assert steps == 6 and all(p.batch_sessions == 4 for p in together)
    # the sequences stay separate: continuing one session reuses only its own cache
    again = proposer.propose("b0", prompts[0] + together[0].tokens[:2], 2)
    assert again.cached_tokens == len(prompts[0]) + 1


def _copy_task(tokenizer) -> list[int]:
    """A prompt whose continuation copies text from it: lookup guesses have something to find."""
    text = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
            "    return total / len(values)\n\n\ndef spread(values):\n    low = min(values)\n    high = max(values)\n"
            "    return high - low\n")
    return tokenizer(f"Copy this code exactly:\n\n{text}\nThe copy:\n\n{text[:40]}")["input_ids"]


@pytest.mark.embedded
def test_llamacpp_lookup_guesses_draft_what_single_passes_draft(monkeypatch):
    """Lookup guesses change how many passes a draft takes, not what it drafts: on text that
    copies the prompt, the draft with guesses equals the draft without, in fewer llama.cpp passes;
    the cache keeps only what was drafted, so the next call reuses it."""
    from draft_service.backends.llamacpp import LOOKUP_TOKENS, LlamaCppProposer
    from draft_service.settings import DraftSettings
    from specdec.models import embedded_gguf_path, load_tokenizer

    prompt = _copy_task(load_tokenizer("embedded"))
    on = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16, lookup_ngram=3)
    off = LlamaCppProposer.from_settings(DraftSettings(lookup_ngram=0))  # the setting reaches the backend
    assert off.lookup_ngram == 0 and on.lookup_ngram == 3
    passes = {"n": 0}
    decode = on._ll.llama_decode

    def counted(*args):
        passes["n"] += 1
        return decode(*args)

    monkeypatch.setattr(on._ll, "llama_decode", counted)  # one module: counts both proposers' passes

    def taken() -> float:
        return LOOKUP_TOKENS.labels("taken")._value.get()

    seq_on, seq_off, drafted = list(prompt), list(prompt), 0
    before = taken()
    on_passes = off_passes = 0
    for _ in range(4):
        passes["n"] = 0
        a = on.propose("s", seq_on, 16)
        on_passes += passes["n"]
        passes["n"] = 0
        b = off.propose("s", seq_off, 16)
        off_passes += passes["n"]
        assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
        assert a.cached_tokens == b.cached_tokens  # the guessed rows the draft did not keep left the cache
        seq_on, seq_off, drafted = seq_on + a.tokens, seq_off + b.tokens, drafted + len(a.tokens)
    assert off_passes == drafted  # one pass per draft token without guesses
    assert on_passes < 0.7 * drafted and taken() - before > 0.4 * drafted
    # a call after a guessed draft finds it cached (all but the last drafted token at least)
    again = on.propose("s", seq_on + [seq_on[-1]], 1)
    assert again.cached_tokens >= len(seq_on) - 1


@pytest.mark.embedded
def test_llamacpp_guesses_only_for_greedy_jobs_and_batches_them_with_others(monkeypatch):
    """A sampling job never guesses (its draws must not depend on how passes are cut); a greedy
    job with a guess shares its pass with others, each drafting as alone."""
    from draft_service.backends.llamacpp import LOOKUP_TOKENS, LlamaCppProposer
    from specdec.models import embedded_gguf_path, load_tokenizer

    prompt = _copy_task(load_tokenizer("embedded"))
    proposer = LlamaCppProposer(str(embedded_gguf_path()), 8, 64 << 20, 0, 16, lookup_ngram=3)
    guessed = LOOKUP_TOKENS.labels("guessed")
    start = guessed._value.get()
    sampled = proposer.propose("t", prompt, 8, 0.0, sm.Sampling(temperature=1.0, seed=3), True)
    assert sampled.steps == len(sampled.tokens) and guessed._value.get() == start
    others = [[504, 1296, 3003, 4683, 359], [9000, 42, 17]]
    alone = [proposer.propose(f"a{i}", p, 12) for i, p in enumerate([prompt, *others])]
    assert guessed._value.get() > start
    jobs = [proposer.prepare(f"b{i}", p, 12) for i, p in enumerate([prompt, *others])]
    taken = LOOKUP_TOKENS.labels("taken")
    before = taken._value.get()
    together, steps = _draft_all_in_steps(proposer, jobs)
    assert taken._value.get() - before >= 4  # the copying job's guesses ran in the shared passes
    assert together[0].tokens == alone[0].tokens
    # The others share passes of up to 14 rows with it; llama.cpp may round a row differently in a
    # larger batch, which can flip a near tie late in a draft (only slower, never wrong): their
    # drafts start the same.
    assert all(t.tokens[:4] == a.tokens[:4] and len(t.tokens) == 12 for t, a in zip(together[1:], alone[1:], strict=True))
    assert steps == 12  # the others still drafted one token per pass
    again = proposer.propose("b1", others[0] + together[1].tokens[:2], 2)
    assert again.cached_tokens == len(others[0]) + 1  # each session kept its own cache


@pytest.mark.embedded
def test_llamacpp_guess_never_evicts_another_session():
    """A guess takes cache room only when the pool has it free: in a pass with room for the job's
    own rows and nothing more, the job drafts without guessing and the other session keeps its
    cache; with room, the same pass guesses."""
    from draft_service.backends.llamacpp import LOOKUP_TOKENS, LlamaCppProposer
    from draft_service.backends.ngram import find_continuation
    from specdec.models import embedded_gguf_path, load_tokenizer

    prompt = _copy_task(load_tokenizer("embedded"))
    while not find_continuation(prompt, 2, 3, 3):  # end it where its last 3 tokens occurred before
        prompt = prompt[:-1]
    guessed = LOOKUP_TOKENS.labels("guessed")
    for room, guesses in ((1, False), (64, True)):
        proposer = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16, lookup_ngram=3)
        proposer.propose("other", [504, 1296, 3003, 4683, 359, 17, 42, 9000], 1)
        proposer.propose("copy", prompt[:-1], 1)  # its cache holds all of the prompt but the last token
        proposer.store.max_bytes = proposer.store.nbytes + room * proposer.bytes_per_token
        start = guessed._value.get()
        job = proposer.prepare("copy", prompt, 16)
        proposer.step([job])  # one pass: the prompt's last token (+ a guess when there is room)
        assert (guessed._value.get() > start) == guesses and "other" in proposer.store


@pytest.mark.embedded
@pytest.mark.parametrize("cap", [2, 16])
def test_llamacpp_guesses_grow_while_taken_up_to_the_cap(cap):
    """A guess starts at 2 tokens and doubles while taken whole, never past lookup_max_tokens."""
    from draft_service.backends.llamacpp import FIRST_GUESS, LlamaCppProposer
    from specdec.models import embedded_gguf_path, load_tokenizer

    prompt = _copy_task(load_tokenizer("embedded"))
    proposer = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16, lookup_ngram=3, lookup_max_tokens=cap)
    proposer.propose("s", prompt, 1)  # the prompt is cached: each pass below decodes 1 row + its guess
    job = proposer.prepare("s", prompt, 16)
    rows = []  # per pass
    while True:
        result = proposer.step([job])
        rows.append(result.rows)
        if result.outcomes[0] is not PENDING:
            break
    guesses = [r - 1 for r in rows[1:]]  # the first pass also re-decodes the prompt's last token
    assert max(guesses) == min(cap, 2 * FIRST_GUESS)  # a 16-token draft has room to double once
    assert FIRST_GUESS in guesses


# ---- more sessions waiting than the store holds ---------------------------------------------------

def test_a_step_never_evicts_a_session_it_computes_for(loaded):
    """max_sessions 2 and four sessions waiting: a step computes for two (creating a third would
    evict one of them, whose cache it was about to fill outside the budget); the other two wait for
    the next step. Every answer is the one it gets alone."""
    engine = TargetEngine(loaded, SessionStore(2, 1 << 30, 0), max_draft_tokens=8)
    alone = [engine_of(loaded).verify(f"r{i}", p, [1, 2]) for i, p in enumerate(PROMPTS)]
    jobs = [engine.prepare(f"s{i}", p, [1, 2]) for i, p in enumerate(PROMPTS)]
    first = engine.step(jobs)
    assert [o is PENDING for o in first.outcomes] == [False, False, True, True]
    assert engine.store.evictions == 0 and len(engine.store) == 2
    second = engine.step(jobs[2:])
    assert all(o is not PENDING for o in second.outcomes)
    assert engine.store.evictions == 2  # the finished sessions made room, once each
    got = first.outcomes[:2] + second.outcomes
    assert [(v.num_accepted, v.next_token) for v in got] == [(v.num_accepted, v.next_token) for v in alone]


def test_a_draft_step_never_evicts_a_session_it_drafts_for(tiny_models):
    from draft_service.backends.hf import TransformersProposer

    loaded = load_hf(tiny_models["llama-draft"])
    alone = [TransformersProposer(loaded, SessionStore(16, 1 << 30, 0), 8).propose(f"a{i}", p, 4, 0.0)
             for i, p in enumerate(PROMPTS)]
    proposer = TransformersProposer(loaded, SessionStore(2, 1 << 30, 0), 8)
    jobs = [proposer.prepare(f"b{i}", p, 4, 0.0) for i, p in enumerate(PROMPTS)]
    together, _ = _draft_all_in_steps(proposer, jobs)
    assert [p.tokens for p in together] == [p.tokens for p in alone]
    # two drafts at a time, each session made once: before, every step created the four in turn,
    # each evicting another, and each draft re-prefilled its prompt at every token
    assert proposer.store.evictions == 2


@pytest.mark.embedded
def test_llamacpp_sampling_drafts_count_against_the_decode_batch():
    """Each sampling job is decoded on its own (llama.cpp's batched kernels move its logits), but
    its rows count against the step's decode batch with everyone else's: five 30-token sampling
    prompts with a 64-row batch take several steps, never one of 150 rows; each draft is the one
    it gets alone."""
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.models import embedded_gguf_path

    proposer = LlamaCppProposer(str(embedded_gguf_path()), 8, 64 << 20, 0, 16, n_batch=64)
    s = sm.Sampling(temperature=0.9, seed=2)
    prompts = [[(97 * i + 13 * j) % 5000 + 10 for j in range(30)] for i in range(5)]
    alone = [proposer.propose(f"a{i}", p, 3, 0.0, s) for i, p in enumerate(prompts)]
    jobs = [proposer.prepare(f"b{i}", p, 3, 0.0, s) for i, p in enumerate(prompts)]
    outcomes, rows = [PENDING] * len(jobs), []
    while any(o is PENDING for o in outcomes):
        open_ = [i for i, o in enumerate(outcomes) if o is PENDING]
        result = proposer.step([jobs[i] for i in open_])
        rows.append(result.rows)
        for i, o in zip(open_, result.outcomes, strict=True):
            outcomes[i] = o
    assert max(rows) <= 64, rows
    assert [p.tokens for p in outcomes] == [p.tokens for p in alone]


def _long_prompt(n: int) -> list[int]:
    return [(7 * j) % 40 + 2 for j in range(n)]


def test_a_drafts_long_prompt_is_prefilled_in_chunks_and_drafts_as_whole(tiny_models):
    """The draft plans with the target's planner: a prompt past the row budget is prefilled over
    several steps (no pass over the budget, no logits before the last chunk), beside a short
    draft that keeps getting a token every step, and drafts what an unchunked prefill drafts."""
    from draft_service.backends.hf import TransformersProposer
    from specdec.engine.planner import Budget

    loaded = load_hf(tiny_models["llama-draft"])
    prompt = _long_prompt(80)  # the tiny models' context is 96
    whole = TransformersProposer(loaded, SessionStore(16, 1 << 30, 0), 8, budget=Budget(256)).propose("w", prompt, 4, 0.0)
    proposer = TransformersProposer(loaded, SessionStore(16, 1 << 30, 0), 8, budget=Budget(24))
    jobs = [proposer.prepare("long", prompt, 4, 0.0), proposer.prepare("short", PROMPTS[0], 4, 0.0)]
    outcomes, rows = [PENDING, PENDING], []
    while PENDING in outcomes:
        open_ = [i for i, o in enumerate(outcomes) if o is PENDING]
        result = proposer.step([jobs[i] for i in open_])
        rows.append(result.rows)
        for i, o in zip(open_, result.outcomes, strict=True):
            outcomes[i] = o
    assert max(rows) <= 24 and len(rows) > 4, rows  # 80 rows of prefill, at most 24 a step
    assert outcomes[0].tokens == whole.tokens and outcomes[0].steps == 4  # drafting steps only
    assert outcomes[1].tokens == proposer.propose("again", PROMPTS[0], 4, 0.0).tokens


@pytest.mark.embedded
def test_llamacpp_long_prompt_is_prefilled_in_chunks_and_drafts_as_whole():
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.engine.planner import Budget
    from specdec.models import embedded_gguf_path, load_tokenizer

    # text the model continues with confidence: llama.cpp sums a 40-row chunk in another order than
    # a 160-row pass, which moves near-ties (a draft that differs there is only slower, never wrong)
    text = " ".join(["one, two, three, four, five, six, seven, eight, nine, ten."] * 8)
    prompt = load_tokenizer(str(embedded_gguf_path())).encode(text)
    whole = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16, lookup_ngram=0).propose("w", prompt, 4)
    proposer = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16, lookup_ngram=0, budget=Budget(40))
    job, rows = proposer.prepare("c", prompt, 4), []
    outcome = PENDING
    while outcome is PENDING:
        result = proposer.step([job])
        rows.append(result.rows)
        outcome = result.outcomes[0]
    assert max(rows) <= 40 and len(rows) >= len(prompt) // 40 + 1, rows
    assert outcome.tokens == whole.tokens and outcome.cached_tokens == 0
    again = proposer.propose("c", prompt + outcome.tokens[:2], 2)  # the chunks left the sequence whole
    assert again.cached_tokens == len(prompt) + 1

