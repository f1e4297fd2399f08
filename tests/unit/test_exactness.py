"""Verification computes exactly what plain decoding computes, over hundreds of prompts.

For every prompt (random token ids of random length) the target engine first decodes plainly, one
row a step: the reference. Then the same engine verifies drafts built from that reference and
spoiled at random places, so k runs over 1-16 and the accepted length over 0..k; sessions share
each pass in random groups of one to four (ragged rows, a prefill beside verifies), as under load.
Every Verify must accept exactly the draft's agreeing prefix and answer the reference's next
token, so the decoded text equals the plain one token for token. The linears, attention and
logits run on the same code as in the services (specdec.model.runner on specdec.native where it
builds): tiny checkpoints for hundreds of prompts, the embedded target for dozens.
"""

from __future__ import annotations

import random

import pytest

from specdec.engine.compute import PENDING
from specdec.engine.sessions import SessionStore
from specdec.models import load_hf
from target_service.verify import TargetEngine

MAX_K = 16


def plain(engine: TargetEngine, sid: str, prompt: list[int], n: int) -> list[int]:
    """n tokens of plain greedy decoding: a pass of one new row per token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(engine.verify(sid, seq).next_token)
    engine.release(sid)
    return seq[len(prompt):]


def spoiled_draft(rng: random.Random, continuation: list[int], vocab: int, most: int) -> tuple[list[int], int]:
    """A draft of 1..``most`` tokens following ``continuation``, spoiled at one random place half
    the time; and how many of its tokens agree with the continuation before the first that doesn't."""
    k = rng.randint(1, most)
    draft = continuation[:k]
    if rng.random() < 0.5:
        j = rng.randrange(k)
        draft[j] = (draft[j] + rng.randrange(1, vocab)) % vocab
    agreeing = next((i for i, (d, c) in enumerate(zip(draft, continuation, strict=False)) if d != c), k)
    return draft, agreeing


def speculate(engine: TargetEngine, streams: dict[str, tuple[list[int], list[int]]], n: int, vocab: int,
              rng: random.Random) -> None:
    """Decode every stream's n tokens by verification, the streams in shared passes; each Verify
    is checked against the stream's plain reference as it lands, so the tokens decoded are the
    reference's, token for token."""
    seqs = {sid: list(prompt) for sid, (prompt, _) in streams.items()}
    while True:
        active = [sid for sid, (prompt, _) in streams.items() if len(seqs[sid]) - len(prompt) < n]
        if not active:
            break
        rng.shuffle(active)
        group = active[:rng.randint(1, 4)]
        jobs, expected = [], []
        for sid in group:
            prompt, reference = streams[sid]
            done = len(seqs[sid]) - len(prompt)
            # (up to the n-th token: the reference holds n + 1)
            draft, agreeing = spoiled_draft(rng, reference[done:], vocab, min(MAX_K, n - done))
            jobs.append(engine.prepare(sid, seqs[sid], draft))
            expected.append((draft, agreeing, reference[done + agreeing]))
        outcomes = [PENDING] * len(jobs)
        while any(o is PENDING for o in outcomes):  # a prompt's prefill may take more than one pass
            waiting = [i for i, o in enumerate(outcomes) if o is PENDING]
            for i, o in zip(waiting, engine.step([jobs[i] for i in waiting]).outcomes, strict=True):
                outcomes[i] = o
        for sid, v, (draft, agreeing, next_token) in zip(group, outcomes, expected, strict=True):
            assert not isinstance(v, BaseException), v
            assert (v.num_accepted, v.next_token) == (agreeing, next_token), (sid, seqs[sid], draft)
            seqs[sid] += draft[:agreeing] + [next_token]
    for sid in streams:
        engine.release(sid)


def check(engine: TargetEngine, prompts: int, n: int, max_prompt: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = engine.lm.model.config.vocab_size
    for first in range(0, prompts, 8):  # eight streams at a time
        streams = {}
        for i in range(first, min(first + 8, prompts)):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, max_prompt))]
            streams[f"s{i}"] = (prompt, plain(engine, f"plain-{i}", prompt, n + 1))
        speculate(engine, streams, n, vocab, rng)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_verification_equals_plain_decoding_on_300_prompts(tiny_models, arch):
    engine = TargetEngine(load_hf(tiny_models[f"{arch}-target"]), SessionStore(16, 1 << 30, 0),
                          max_draft_tokens=MAX_K)
    # the tiny checkpoints hold 96 positions: prompt + tokens + a last draft stay inside
    check(engine, prompts=300, n=32, max_prompt=40, seed={"llama": 1, "gpt2": 2}[arch])


@pytest.mark.slow
@pytest.mark.embedded
def test_verification_equals_plain_decoding_on_the_embedded_target(embedded_target):
    engine = TargetEngine(embedded_target, SessionStore(16, 1 << 30, 0), max_draft_tokens=MAX_K)
    check(engine, prompts=64, n=17, max_prompt=64, seed=5)
