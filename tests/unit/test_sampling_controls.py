"""Penalties, logit_bias and min_p under speculation (specdec.sampling.process): the function
itself against a row-by-row reference; greedy speculation equal to plain decoding with each
control on; the law of sampled output (two positions, chi-square) equal to the target's processed
distribution with all of them on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chi2 as chi2_law

from specdec import sampling as sm
from specdec.errors import InvalidArgument
from specdec.models import load_tokenizer
from tests.unit.test_grammar import decode


def reference(row: torch.Tensor, s: sm.Sampling, history: list[int]) -> torch.Tensor:
    """One row processed the slow, obvious way."""
    row = row.clone()
    for t, b in s.logit_bias:
        row[t] += b
    output = history[s.output_start:]
    for t in set(history):
        if s.repetition_penalty != 1:
            row[t] = row[t] / s.repetition_penalty if row[t] > 0 else row[t] * s.repetition_penalty
    for t in set(output):
        row[t] -= s.frequency_penalty * output.count(t) + s.presence_penalty
    return row


def test_process_gives_each_row_its_own_history():
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 3
    tokens, draft = [1, 5, 5, 7, 2], [5, 9, 1]
    s = sm.Sampling(temperature=1.0, output_start=2, presence_penalty=0.5, frequency_penalty=0.3,
                    repetition_penalty=1.4, logit_bias=((3, 2.0), (9, -100.0)))
    out = sm.process(logits, s, tokens, draft)
    for i in range(4):
        assert torch.allclose(out[i], reference(logits[i], s, tokens + draft[:i]), atol=1e-6), i
    assert sm.process(logits, sm.Sampling(), tokens, draft) is logits  # nothing set: untouched


def test_min_p_keeps_the_tokens_near_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    p = sm.probabilities(logits, sm.Sampling(temperature=1.0, min_p=0.19))
    assert (p > 0).tolist() == [True, True, True, False, False]
    assert torch.isclose(p.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("bad", [{"presence_penalty": 3.0}, {"frequency_penalty": float("nan")},
                                 {"repetition_penalty": 0.0}, {"min_p": 1.5}, {"logit_bias": ((1, 101.0),)}])
def test_out_of_range_controls_are_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        sm.Sampling(**bad).validate()


# The tiny random models seldom repeat a token, so penalties (> 0) would rarely bite; negative ones
# (and a repetition penalty below 1) favour the history's tokens instead, which the near-tied top
# logits (~0.2 apart) then pick: every control changes the output, as the test checks.
CONTROLS = {
    "frequency_penalty": {"frequency_penalty": -1.5},
    "presence_penalty": {"presence_penalty": -2.0},
    "repetition_penalty": {"repetition_penalty": 0.5},
    "logit_bias": None,  # built from the plain output: see the test
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_greedy_speculation_with_a_control_equals_plain_decoding_with_it(bpe_engines, control):
    target, draft = bpe_engines
    tok = load_tokenizer("embedded")
    prompt = tok.encode("The story begins with a long walk")
    free = decode(target, None, "free", prompt, 24, sm.Sampling(output_start=len(prompt)))
    fields = CONTROLS[control] or {"logit_bias": ((free[0], -100.0), (free[1], -100.0))}
    s = sm.Sampling(output_start=len(prompt), **fields)
    plain = decode(target, None, "plain", prompt, 24, s)
    fast = decode(target, draft, "spec", prompt, 24, s, k=6)
    assert fast == plain
    assert plain != free  # the control changed the output
    if control == "logit_bias":
        assert free[0] not in plain and free[1] not in plain


@pytest.mark.slow
def test_sampling_with_every_control_keeps_the_targets_processed_law(bpe_engines):
    """Chi-square over 300 seeded requests of the first two tokens (top-k 3: at most 9 pairs) against
    the target's own processed rows, each with its history: the second position's penalties count the
    first token, which the draft proposed or the target replaced."""
    target, draft = bpe_engines
    tok = load_tokenizer("embedded")
    prompt = tok.encode("Colours: red, blue, red, green,")
    # history-favouring values (see CONTROLS): the prompt's tokens enter the top 3 at the first
    # position, and whichever token comes first is favoured at the second
    red = tok.encode(" red")[0]
    with torch.no_grad():
        row0 = target.loaded.model(torch.tensor([prompt])).logits[0, -1]
    s0 = sm.Sampling(temperature=1.0, top_k=3, min_p=0.05, output_start=len(prompt) - 4, presence_penalty=-1.0,
                     frequency_penalty=-0.5, repetition_penalty=0.7)
    penalised = sm.process(row0[None], s0, prompt)[0]
    # the bias that makes " red" tie the top token once penalised: a law spread over several pairs
    s0 = dataclasses.replace(s0, logit_bias=((red, float(penalised.max() - penalised[red])),))
    n = 300
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        s = sm.Sampling(**{**s0.__dict__, "seed": seed})
        seq = list(prompt)
        while len(seq) < len(prompt) + 2:
            proposal = draft.propose(f"c{seed}", seq, 3, 0.0, s, return_distributions=True)
            v = target.verify(f"c{seed}", seq, proposal.tokens, s, proposal.distributions)
            seq += proposal.tokens[:v.num_accepted] + [v.next_token]
        pair = tuple(seq[len(prompt):len(prompt) + 2])
        counts[pair] = counts.get(pair, 0) + 1
        target.release(f"c{seed}")
        draft.release(f"c{seed}")

    def law(history: list[int]) -> torch.Tensor:
        with torch.no_grad():
            row = target.loaded.model(torch.tensor([history])).logits[0, -1:]
        return sm.probabilities(sm.process(row, s0, history)[0], s0)

    first = law(prompt)
    exact = {}
    for a in first.nonzero().flatten().tolist():
        second = law(prompt + [a])
        for b in second.nonzero().flatten().tolist():
            exact[(a, b)] = float(first[a] * second[b])
    assert set(counts) <= set(exact), "a pair the processed law gives probability 0"
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * n >= 5]
    small = [c for c in cells if exact[c] * n < 5]
    observed = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    expected = [exact[c] * n for c in big] + ([sum(exact[c] for c in small) * n] if small else [])
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    p_value = float(chi2_law.sf(chi2, len(observed) - 1))
    assert p_value > 0.01, (observed, expected, p_value)
    # the controls matter here: without them the law of the pairs is another one
    plain_first = sm.probabilities(target.loaded.model(torch.tensor([prompt])).logits[0, -1].detach(),
                                   sm.Sampling(temperature=1.0, top_k=3))
    assert not torch.allclose(plain_first, first, atol=0.05)
