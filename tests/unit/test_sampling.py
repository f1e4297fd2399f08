"""Verification math on hand-built distributions (no models)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec import sampling as sm
from specdec.errors import InvalidArgument


def one_hot_logits(ids: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits [len(ids), vocab] whose argmax at row i is ids[i]."""
    logits = torch.zeros(len(ids), vocab)
    for i, t in enumerate(ids):
        logits[i, t] = 5.0
    return logits


def test_greedy_perfect_match_gives_bonus():
    # target argmax after each draft token, plus the bonus position
    assert sm.verify_greedy([3, 1, 4, 1], [3, 1, 4]) == (3, 1)


def test_greedy_early_mismatch_gives_correction():
    assert sm.verify_greedy([3, 5, 4, 1], [3, 1, 4]) == (1, 5)  # second token rejected, target says 5
    assert sm.verify_greedy([7, 1, 4, 1], [3, 1, 4]) == (0, 7)  # first token rejected


def test_greedy_empty_draft_is_a_plain_step():
    assert sm.verify_greedy([6], []) == (0, 6)


def test_probabilities_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = sm.probabilities(logits, sm.Sampling(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = sm.probabilities(logits, sm.Sampling(temperature=1.0, top_p=0.8))
    # 0.5 + 0.3 reaches 0.8: the tail is dropped
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = sm.probabilities(logits, sm.Sampling(temperature=1.0, top_p=0.81))
    assert p[2] > 0 and p[3] == 0
    cold = sm.probabilities(logits, sm.Sampling(temperature=0.1))
    assert cold[0] > 0.99


def _top_p_by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p the plain way: the whole vocabulary sorted."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (probs.cumsum(-1) - probs) >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def test_top_p_over_a_large_vocabulary_keeps_the_smallest_set_reaching_it():
    """Over more than TOP_P_PREFIX tokens the cut is looked for among the top ones first."""
    vocab = 5000
    probs = torch.full((vocab,), 0.05 / (vocab - 3))
    probs[:3] = torch.tensor([0.5, 0.3, 0.15])
    logits = torch.log(probs)[torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    top3 = torch.topk(logits, 3).indices
    for top_p, kept in ((0.4, 1), (0.7, 2), (0.9, 3)):
        p = sm.probabilities(logits, sm.Sampling(temperature=1.0, top_p=top_p))
        assert set(torch.nonzero(p).flatten().tolist()) == set(top3[:kept].tolist())
        assert torch.isclose(p.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0, 12.0])  # flat (the whole vocabulary sorted) to peaked
def test_top_p_keeps_what_sorting_the_whole_vocabulary_keeps(scale):
    gen = torch.Generator().manual_seed(int(scale * 10))
    for top_p in (0.5, 0.9, 0.95):
        logits = torch.randn(4, 49152, generator=gen) * scale
        want = _top_p_by_sort(logits, top_p)
        got = sm._top_p(logits, top_p)
        for row, (w, g) in enumerate(zip(want, got, strict=True)):
            # rows whose cut lies within fp32 rounding of top_p may fall either way: skip those (a
            # cumulative sum over 49,152 probabilities in fp32 differs by up to ~2e-5 between
            # summation orders, which differ between CPUs' vector widths)
            cum = torch.softmax(torch.sort(logits[row], descending=True).values, -1).cumsum(-1)
            if (cum - top_p).abs().min() < 1e-4:
                continue
            assert torch.equal(torch.isfinite(g), torch.isfinite(w)), (scale, top_p, row)
            assert torch.equal(g[torch.isfinite(g)], w[torch.isfinite(w)])
        # a row's cut is its own: the same rows alone
        assert torch.equal(got, torch.stack([sm._top_p(r, top_p) for r in logits]))


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=1.5), dict(top_k=-1)]
)
def test_sampling_validation(kwargs):
    with pytest.raises(InvalidArgument):
        sm.Sampling(**kwargs).validate()


def _sparse(rows) -> list[tuple[list[int], list[float]]]:
    """Dense draft rows as the draft sends them (verify_sampling's q)."""
    return [sm.to_sparse(row) for row in rows]


def test_rejection_accepts_when_draft_equals_target():
    p = torch.softmax(torch.randn(4, 8), dim=-1)
    draft = [int(p[i].argmax()) for i in range(3)]
    n, _ = sm.verify_sampling(p, _sparse(p[:3]), draft, seed=1, first_position=10)
    assert n == 3  # p/q == 1: always accepted


def test_rejection_rejects_token_target_never_emits():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    n, nxt = sm.verify_sampling(p, _sparse(q), [0], seed=0, first_position=0)
    assert (n, nxt) == (0, 1)  # p(0) == 0: rejected, residual max(0, p - q) is all on token 1


def test_seeded_sampling_is_deterministic():
    p = torch.softmax(torch.randn(3, 50), dim=-1)
    q = torch.softmax(torch.randn(2, 50), dim=-1)
    draft = [int(torch.multinomial(q[i], 1)) for i in range(2)]
    runs = {sm.verify_sampling(p, _sparse(q), draft, seed=42, first_position=7) for _ in range(5)}
    assert len(runs) == 1
    draws = {tuple(sm.sample(p[0], s, 3, sm.STREAM_TARGET) for s in range(20))}
    assert len({d for run in draws for d in run}) > 1  # different seeds differ


def test_sparse_round_trip():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75])
    ids, probs = sm.to_sparse(p)
    assert ids == [1, 3]
    assert torch.equal(sm.to_dense(ids, probs, 4), p)


def test_speculative_sampling_matches_target_distribution():
    """Chi-square: the first token emitted by draft-then-verify is distributed as p, not q."""
    torch.manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(2, vocab) * 1.5, dim=-1)  # target at draft position and bonus
    q = torch.softmax(torch.randn(1, vocab) * 1.5, dim=-1)  # a different draft distribution
    n_draws = 6000
    counts = torch.zeros(vocab)
    for seed in range(n_draws):
        x = sm.sample(q[0], seed, 0, sm.STREAM_DRAFT)
        n, nxt = sm.verify_sampling(p, _sparse(q), [x], seed=seed, first_position=0)
        counts[x if n == 1 else nxt] += 1
    expected = p[0] * n_draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) ~ 0.001
    assert chi2 < 20.5, (counts, expected)
    # and it is clearly not q's distribution
    chi2_q = float(((counts - q[0] * n_draws) ** 2 / (q[0] * n_draws)).sum())
    assert chi2_q > 100
    assert math.isclose(float(counts.sum()), n_draws)


def test_draft_draws_are_fresh_in_every_round():
    """A redraft of a position in a later round (after a rejection) draws new numbers: the draft's
    draws are keyed by the round's start as well as by position."""
    q = torch.full((10,), 0.1)
    same = sum(sm.sample(q, sm.draft_seed(s, 10), 12, sm.STREAM_DRAFT) == sm.sample(q, sm.draft_seed(s, 11), 12,
                                                                                     sm.STREAM_DRAFT)
               for s in range(400))
    assert same < 0.2 * 400  # independent draws agree ~10 % of the time; the same key would agree always
    assert sm.draft_seed(7, 10) == sm.draft_seed(7, 10) and sm.draft_seed(7, 10) != sm.draft_seed(8, 10)


def test_a_drafts_proposal_keeps_its_most_probable_tokens_renormalised():
    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(5)), -1)
    q = sm.proposal(probs, support=100)
    kept = torch.nonzero(q).flatten()
    assert len(kept) == 100 and set(kept.tolist()) == set(torch.topk(probs, 100).indices.tolist())
    assert torch.isclose(q.sum(), torch.tensor(1.0))
    assert torch.allclose(q[kept], probs[kept] / probs[kept].sum())
    small = sm.probabilities(torch.randn(5000), sm.Sampling(temperature=1.0, top_k=50))
    assert sm.proposal(small, support=100) is small  # a support this small already: unchanged
    ids, _ = sm.to_sparse(sm.proposal(probs))
    assert len(ids) == sm.DRAFT_SUPPORT


def test_sampling_against_a_truncated_proposal_keeps_the_targets_law():
    """The draft samples from its top tokens only; verification against that q still yields p."""
    gen = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(2, 12, generator=gen), -1)
    q_full = torch.softmax(torch.randn(12, generator=gen), -1)
    q = sm.proposal(q_full, support=4)
    counts = torch.zeros(12)
    trials = 6000
    for seed in range(trials):
        x = sm.sample(q, seed, 0, sm.STREAM_DRAFT)
        n, nxt = sm.verify_sampling(p, _sparse([q]), [x], seed=seed, first_position=0)
        counts[x if n == 1 else nxt] += 1
    # the first token's law is p[0] (chi-square-like bound: 5 standard deviations a token)
    expected = p[0] * trials
    assert torch.all((counts - expected).abs() <= 5 * torch.sqrt(expected * (1 - p[0])) + 1)
