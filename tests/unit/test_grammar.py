"""Structured output inside the engines (specdec.grammar): the matcher's masks, and speculation
under a grammar computing what plain decoding under it computes (greedy: token for token;
sampling: the target's masked law), on tiny models with the embedded model's BPE tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch
from scipy.stats import chi2 as chi2_law

from draft_service.backends.hf import TransformersProposer
from specdec import grammar as gr
from specdec import sampling as sm
from specdec.errors import InvalidArgument
from specdec.models import load_tokenizer
from target_service.verify import TargetEngine
from tests.support import BPE_VOCAB

EOS = 2  # the embedded tokenizer's <|im_end|> (and the tiny models' eos)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def grammars(tok):
    return gr.Grammars(lambda: tok, BPE_VOCAB, [EOS])


@pytest.fixture(scope="module")
def engines(bpe_engines):
    return bpe_engines


def allowed_text(tok, mask: torch.Tensor) -> set[str]:
    return {tok.decode([i]) for i in mask.nonzero().flatten().tolist()}


def test_masks_of_a_pass_are_each_prefixs_mask_and_the_matcher_ends_where_it_began(tok, grammars):
    grammar = gr.from_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    ids = tok.encode('{"n":12}')
    state = grammars.state("pass", grammar, 0, ids[:2])
    rows = state.masks(ids[2:])
    assert len(rows) == len(ids) - 1  # every draft token accepted: k + 1 rows
    for i in range(len(rows)):
        fresh = gr.Grammars(grammars._tokenizer, BPE_VOCAB, [EOS]).state("x", grammar, 0, ids[:2 + i])
        assert torch.equal(rows[i], fresh.mask()), i
    assert state.consumed == ids[:2]  # rolled back
    assert torch.equal(state.mask(), rows[0])
    # the last row follows the closing brace: the output is complete, only EOS may follow
    assert rows[-1].nonzero().flatten().tolist() == [EOS]


def test_a_pass_stops_after_the_first_refused_draft_token(tok, grammars):
    grammar = gr.from_regex("[0-9]{3}")
    state = grammars.state("refused", grammar, 0, [])
    draft = tok.encode("1") + tok.encode("x") + tok.encode("2")
    rows = state.masks(draft)
    assert len(rows) == 2  # the row that verifies "x" is the last
    assert not rows[1][draft[1]] and rows[0][draft[0]]


def test_sync_rolls_back_to_the_common_prefix_and_refuses_what_the_grammar_refuses(tok, grammars):
    grammar = gr.from_choice(["yes", "no"])
    prompt = tok.encode("Answer:")
    assert grammars.state("sync", grammar, len(prompt), prompt + tok.encode("yes")).consumed == tok.encode("yes")
    assert grammars.state("sync", grammar, len(prompt), prompt + tok.encode("no")).consumed == tok.encode("no")
    assert grammars.state("sync", grammar, len(prompt), prompt + tok.encode("maybe")) is None
    # after the end: one EOS, then nothing
    state = grammars.state("sync", grammar, len(prompt), prompt + tok.encode("no") + [EOS])
    assert state is not None and state.mask().nonzero().flatten().tolist() == [EOS]
    assert grammars.state("sync", grammar, len(prompt), prompt + tok.encode("no") + [EOS, EOS]) is None
    assert grammars.state("sync", grammar, len(prompt), prompt + tok.encode("yes")).consumed == tok.encode("yes")


def test_a_grammar_that_does_not_compile_is_invalid_argument(grammars):
    with pytest.raises(InvalidArgument, match="does not compile"):
        grammars.check(gr.from_json_schema({"type": "bogus"}))
    with pytest.raises(InvalidArgument, match="does not compile"):
        grammars.check(gr.from_regex("(unclosed"))
    with pytest.raises(InvalidArgument, match="over the"):
        grammars.check("x" * (gr.MAX_GRAMMAR_BYTES + 1))


def decode(target: TargetEngine, draft: TransformersProposer | None, sid: str, prompt: list[int], n: int,
           sampling: sm.Sampling, k: int = 4) -> list[int]:
    """Up to n tokens (ending at EOS): with ``draft``, each step drafts up to k tokens and verifies
    them in one pass; without, plain steps."""
    seq = list(prompt)
    while len(seq) - len(prompt) < n and (len(seq) == len(prompt) or seq[-1] != EOS):
        proposal = draft.propose(sid, seq, k, 0.0, sampling, return_distributions=True) if draft else None
        tokens = proposal.tokens if proposal else []
        v = target.verify(sid, seq, tokens, sampling, proposal.distributions if proposal else ())
        seq += tokens[:v.num_accepted] + [v.next_token]
        if EOS in seq[len(prompt):]:
            seq = seq[:seq.index(EOS, len(prompt)) + 1]
    target.release(sid)
    if draft:
        draft.release(sid)
    return seq[len(prompt):]


@pytest.mark.parametrize("pattern", [r"[a-z]{2,6}( [a-z]{2,6}){0,5}\.", r"\{\"id\":[0-9]{1,4},\"ok\":(true|false)\}"])
def test_speculative_greedy_under_a_grammar_equals_plain_greedy_under_it(engines, tok, pattern):
    target, draft = engines
    prompt = tok.encode("Say something:")
    sampling = sm.Sampling(grammar=gr.from_regex(pattern), output_start=len(prompt))
    plain = decode(target, None, "plain", prompt, 40, sampling)
    fast = decode(target, draft, "spec", prompt, 40, sampling)
    assert fast == plain
    assert plain[-1] == EOS and re.fullmatch(pattern, tok.decode(plain[:-1])), tok.decode(plain)
    # and the grammar changed the output: unconstrained, the random model does not write this
    free = decode(target, None, "free", prompt, len(plain), sm.Sampling())
    assert free != plain


@pytest.mark.slow
def test_speculative_sampling_under_a_grammar_keeps_the_targets_masked_law(engines, tok):
    """Chi-square over 300 seeded requests: the first token under speculation is distributed as the
    target's masked, renormalised distribution p' (not the draft's q', nor the unmasked p)."""
    target, draft = engines
    prompt = tok.encode("Pick:")
    words = ["red", "green", "blue", "black", "white"]
    grammar = gr.from_choice(words)
    n = 300
    counts = torch.zeros(BPE_VOCAB)
    for seed in range(n):
        sampling = sm.Sampling(temperature=1.0, seed=seed, grammar=grammar, output_start=len(prompt))
        proposal = draft.propose(f"s{seed}", prompt, 3, 0.0, sampling, return_distributions=True)
        v = target.verify(f"s{seed}", prompt, proposal.tokens, sampling, proposal.distributions)
        counts[proposal.tokens[0] if v.num_accepted else v.next_token] += 1
        target.release(f"s{seed}")
        draft.release(f"s{seed}")
    # p' exactly: the target's own row at the prompt, masked (any tokenisation of the words: "b", "bl", "blue" ...)
    with torch.no_grad():
        row = target.loaded.model(torch.tensor([prompt])).logits[0, -1]
    mask = gr.Grammars(lambda: tok, BPE_VOCAB, [EOS]).state("ref", grammar, len(prompt), prompt).mask()
    p = torch.softmax(gr.apply(row, mask), dim=-1)
    support = p.nonzero().flatten().tolist()
    assert {tok.encode(w)[0] for w in words} <= set(support)
    assert set(counts.nonzero().flatten().tolist()) <= set(support)  # never a token the grammar refuses
    # tokens expected fewer than 5 times share one bucket (the chi-square approximation needs >= 5)
    big = [t for t in support if p[t] * n >= 5]
    small = [t for t in support if p[t] * n < 5]
    observed = [float(counts[t]) for t in big] + ([float(counts[small].sum())] if small else [])
    expected = [float(p[t]) * n for t in big] + ([float(p[small].sum()) * n] if small else [])
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    p_value = float(chi2_law.sf(chi2, len(observed) - 1))
    assert p_value > 0.01, (observed, expected, p_value)
    # and unmasked, the first row's law would be a different one: most of its mass is elsewhere
    assert float(torch.softmax(row, dim=-1)[support].sum()) < 0.5


def test_the_draft_samples_under_the_grammar_and_reports_the_masked_distribution(engines, tok):
    _, draft = engines
    prompt = tok.encode("Number:")
    sampling = sm.Sampling(temperature=1.0, seed=7, grammar=gr.from_regex("[0-9]{4}"), output_start=len(prompt))
    proposal = draft.propose("digits", prompt, 6, 0.0, sampling, return_distributions=True)
    draft.release("digits")
    text = tok.decode(proposal.tokens)
    assert re.fullmatch(r"[0-9]{1,4}", text.removesuffix(tok.decode([EOS]))), text
    for ids, probs in proposal.distributions:
        assert all(tok.decode([i]).isdigit() or i == EOS for i in ids)
        assert abs(sum(probs) - 1) < 1e-4


def test_committed_tokens_the_grammar_refuses_are_invalid_argument_at_the_target(engines, tok):
    target, draft = engines
    prompt = tok.encode("Digits:")
    sampling = sm.Sampling(grammar=gr.from_regex("[0-9]+"), output_start=len(prompt))
    with pytest.raises(InvalidArgument, match="do not follow"):
        target.verify("bad", prompt + tok.encode("abc"), (), sampling)
    target.release("bad")
    # the draft proposes nothing after them (a pre-draft past a rejection may ask)
    assert draft.propose("bad", prompt + tok.encode("abc"), 4, 0.0, sampling).tokens == []
    draft.release("bad")
    with pytest.raises(InvalidArgument, match="output_start"):
        target.verify("bad", prompt, (), sm.Sampling(grammar=sampling.grammar, output_start=len(prompt) + 1))


def test_json_from_a_schema_parses(engines, tok):
    target, draft = engines
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"], "additionalProperties": False}
    prompt = tok.encode("JSON:")
    sampling = sm.Sampling(temperature=0.7, seed=3, grammar=gr.from_json_schema(schema), output_start=len(prompt))
    out = decode(target, draft, "json", prompt, 60, sampling)
    assert out[-1] == EOS, tok.decode(out)
    value = json.loads(tok.decode(out[:-1]))
    assert set(value) == {"a", "b"} and isinstance(value["a"], int) and len(value["b"]) <= 5
