"""Token selection and verification math, pure torch, no models.

Vocabulary (as in vLLM's rejection sampler):
- *draft tokens*: the k tokens the draft model proposed after the committed sequence;
- *accepted*: the leading draft tokens the target keeps;
- *correction*: the target's token at the first rejected position;
- *bonus*: the target's token after the last draft token when all k are accepted.
One verification therefore always yields ``num_accepted + 1`` new tokens.

Greedy verification accepts while the draft token equals the target's argmax. Sampling uses the
lossless rejection scheme of Leviathan et al. 2023 ("Fast Inference from Transformers via
Speculative Decoding") and Chen et al. 2023: accept x with probability min(1, p(x)/q(x)); on
rejection draw from normalize(max(0, p - q)); when all are accepted draw the bonus from p. The
output is then distributed exactly as sampling from p alone.

Randomness is keyed by (seed, absolute position, stream), not drawn from a running generator, so a
retried call gives the same answer and a seeded request with the same k schedule the same output
(the k schedule itself decides which draws are used, so the orchestrator keeps it timing-free
for sampling requests).

The draft's draws are keyed by the round as well: by the length of the sequence it drafts after
(:func:`draft_seed`). The target's draws at a position are used once (the position is committed in
that round, whatever the outcome), but after a rejection the next round drafts the same positions
again; keyed by position alone it would redraw them with the same numbers, and a controller whose k
depends on where the last draft stopped would pick k from the very draws it then uses. With the
round in the key every round's draft draws are fresh, independent of everything seen before it.

Everything here runs on host tensors, whatever device computed the logits: the engines copy the
kept rows of a pass to the host once (specdec.engine.executor.HOST), so the seeded CPU generators, greedy
acceptance and every per-token read cost no device sync, and the draft's q meets the target's p
where both are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.params import Sampling  # noqa: F401  (re-exported: sm.Sampling)

# Independent random streams at one position.
STREAM_DRAFT = 1  # the draft's own sample
STREAM_ACCEPT = 2  # the uniform draw of the acceptance test
STREAM_TARGET = 3  # the target's sample (correction, bonus or plain decoding step)

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int, stream: int) -> int:
    """splitmix64 of (seed, position, stream): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A CPU generator for one draw at ``position`` of ``stream``."""
    return torch.Generator().manual_seed(_mix(seed, position, stream))


def process(logits: torch.Tensor, sampling: Sampling, tokens: Sequence[int], draft: Sequence[int] = ()) -> torch.Tensor:
    """``logits`` [n, V] of consecutive positions (n <= len(draft) + 1) with the request's logit
    processing applied, row i with its own history: ``tokens`` (the sequence so far) then
    ``draft[:i]``. The draft (one row, its drafted tokens in ``tokens``) and the target (a verify
    pass) call this same function, so q and p are processed alike and plain decoding, a pass of one
    row, processes as speculation does.

    In vLLM's order: ``logit_bias`` added; then the repetition penalty over every token of the
    history (a positive logit divided by it, a negative one multiplied); then, over the output's
    tokens (from ``sampling.output_start``), minus ``frequency_penalty`` x count and minus
    ``presence_penalty`` once present. ``logits`` itself when nothing is set (else a new tensor)."""
    if not sampling.processes:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long)
        out[:, ids] += torch.tensor([b for _, b in sampling.logit_bias], dtype=torch.float32)
    rep, freq, pres = sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty
    if rep == 1.0 and not freq and not pres:
        return out
    seq = torch.tensor(list(tokens), dtype=torch.long)
    counts = torch.bincount(seq[sampling.output_start:], minlength=vocab)[:vocab].float()
    seen = torch.bincount(seq, minlength=vocab)[:vocab] > 0
    for i in range(out.shape[0]):
        if i:
            counts[draft[i - 1]] += 1
            seen[draft[i - 1]] = True
        row = out[i]
        if rep != 1.0:
            row.copy_(torch.where(seen, torch.where(row > 0, row / rep, row * rep), row))
        if freq:
            row.sub_(counts * freq)
        if pres:
            row.sub_((counts > 0).float() * pres)
    return out


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Apply temperature, min-p, top-k, top-p to ``logits`` [..., V] (processed already:
    :func:`process`); return probabilities [..., V] (fp32).

    Greedy requests get the plain softmax (used for confidences and target probabilities).
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if sampling.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < sampling.top_p < 1.0:
        logits = _top_p(logits, sampling.top_p)
    return torch.softmax(logits, dim=-1)


# Top-p looks for its cut among this many top logits first: a partial selection instead of a sort
# of the whole vocabulary (milliseconds a row of a large vocabulary), nearly always enough since the kept set is
# rarely this large; when it is not, it looks again among all of them (a full sort).
TOP_P_PREFIX = 1024


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every token after the smallest set of top tokens whose probability reaches
    ``top_p`` set to -inf: a token is dropped when the mass of the tokens before it (in descending
    order) already reaches ``top_p``, so the top token always stays. Each row on its own, so a
    row's cut never depends on the rows beside it."""
    vocab = logits.shape[-1]
    if logits.dim() > 1:
        rows = logits.reshape(-1, vocab)
        return torch.stack([_top_p(row, top_p) for row in rows]).reshape(logits.shape)
    peak = logits.max()
    total = torch.exp(logits - peak).sum()  # the whole vocabulary's normaliser, as softmax's
    n = min(vocab, TOP_P_PREFIX)
    while True:
        top, order = torch.topk(logits, n)  # descending
        probs = torch.exp(top - peak) / total
        cum = probs.cumsum(dim=-1)
        if n == vocab or float(cum[-1]) >= top_p:  # the cut lies within these n
            break
        n = vocab
    keep = (cum - probs) < top_p
    return torch.full_like(logits, float("-inf")).scatter(0, order, top.masked_fill(~keep, float("-inf")))


def draft_seed(seed: int, round_start: int) -> int:
    """The seed of the draft's draws in the round that drafts after ``round_start`` tokens."""
    return _mix(seed, round_start, STREAM_DRAFT)


def sample(probs: torch.Tensor, seed: int, position: int, stream: int) -> int:
    """Draw one token id from ``probs`` [V]."""
    return int(torch.multinomial(probs, 1, generator=generator(seed, position, stream)).item())


def uniform(seed: int, position: int) -> float:
    """The acceptance test's uniform draw in [0, 1) at ``position``."""
    return float(torch.rand(1, generator=generator(seed, position, STREAM_ACCEPT)).item())


# A sampling draft proposes from at most this many of its most probable tokens, renormalised.
# Speculative sampling is lossless for any proposal distribution q, as long as the draft token is
# drawn from q and the target verifies against that same q, so this changes how often drafts are
# accepted, never what the output's law is. Without it a request with no top-k or top-p sent the
# whole vocabulary per draft token (~330 KB on the embedded model, whose conversions and protobuf
# between the three services cost more than a draft token; docs/design.md).
DRAFT_SUPPORT = 512


def proposal(probs: torch.Tensor, support: int = DRAFT_SUPPORT) -> torch.Tensor:
    """The draft's proposal distribution from its transformed ``probs`` [V]: ``probs`` itself when
    at most ``support`` tokens have probability, else its ``support`` most probable tokens,
    renormalised."""
    if probs.shape[-1] <= support:
        return probs
    top, ids = torch.topk(probs, support)
    if float(top[-1]) == 0.0:  # the support is already this small
        return probs
    return torch.zeros_like(probs).index_copy_(0, ids, top / top.sum())


def to_sparse(probs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Support of ``probs`` [V] as (ids, probabilities)."""
    ids = torch.nonzero(probs > 0, as_tuple=True)[0]
    return ids.tolist(), probs[ids].tolist()


def to_dense(ids: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`to_sparse`: a [V] tensor."""
    out = torch.zeros(vocab_size, dtype=torch.float32)
    if len(ids):
        out[torch.as_tensor(ids, dtype=torch.long)] = torch.as_tensor(probs, dtype=torch.float32)
    return out


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """Greedy verification.

    Args:
        target_argmax: the target's argmax at each draft position plus one more, [k + 1].
        draft: draft token ids, [k].
    Returns:
        (num_accepted, next_token): next_token is the correction or the bonus token.
    """
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampling(
    p: Sequence[torch.Tensor], q: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[float] | torch.Tensor]],
    draft: list[int], seed: int, first_position: int
) -> tuple[int, int]:
    """Lossless rejection sampling.

    Args:
        p: target probabilities (after the sampling transform), k + 1 rows of [V] (a [k + 1, V]
            tensor or a list of rows).
        q: the draft distributions the draft tokens were sampled from, k sparse rows (ids, probs),
            as :func:`to_sparse` gives them and the draft sends them: only the row of a rejection
            is made dense (for its residual).
        draft: draft token ids, [k].
        seed: the request's seed.
        first_position: absolute sequence position of draft[0].
    Returns:
        (num_accepted, next_token).
    """
    for i, x in enumerate(draft):
        ids, probs = torch.as_tensor(q[i][0]), torch.as_tensor(q[i][1], dtype=torch.float32)
        px, qx = float(p[i][x]), float(probs[ids == x].sum())
        # qx == 0 cannot happen for a token the draft sampled; treat it as a sure rejection.
        if qx > 0 and uniform(seed, first_position + i) < min(1.0, px / qx):
            continue
        residual = torch.clamp(p[i] - to_dense(ids, probs, p[i].shape[-1]), min=0.0)
        total = float(residual.sum())
        # p == q up to rounding leaves no residual mass; p itself is then the right law.
        dist = residual / total if total > 1e-12 else p[i]
        return i, sample(dist, seed, first_position + i, STREAM_TARGET)
    k = len(draft)
    return k, sample(p[k], seed, first_position + k, STREAM_TARGET)
