"""Speculative sampling is lossless, end to end: the same distribution as sampling from the target alone.

On the embedded stack, many seeded samples of the first tokens after one prompt, drawn through the
whole service path (draft proposals, the target's rejection sampling, corrections and bonus tokens),
speculative (fixed k = 2, so every request drafts and most rounds meet a rejection) against
autoregressive:

- a chi-square homogeneity test on the first two tokens (cells with too few samples pooled) must
  not reject at the 0.1 % level;
- the mean log-likelihood of the sampled tokens under the target's transformed distribution (what
  the stream reports per token) must agree within four standard errors of the difference.

The test's power is checked alongside: the same homogeneity test between autoregressive sampling at
temperature 1.0 and 0.6 — a real difference in distribution — must reject. ``SPECDEC_LOSSLESS_SAMPLES``
(default 300 per arm) sizes it; the statistics land in artifacts/reliability/sampling_lossless.json.
"""

from __future__ import annotations

import collections
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from scipy.stats import chi2_contingency

from tests.reliability.helpers import env_int, write_report
from tests.support import iter_sse, running_stack

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

SAMPLES = env_int("SPECDEC_LOSSLESS_SAMPLES", 300)
PROMPT = "My favourite thing to do on a rainy afternoon is"
TOKENS = 3
TOP_K = 5
MIN_CELL = 5  # expected count below which cells are pooled into "other"


def sample(url: str, seed: int, mode: str, temperature: float = 1.0, **extra) -> tuple[tuple[int, ...], float]:
    """(generated token ids, their log-likelihood under the target's transformed distribution)."""
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "mode": mode, "temperature": temperature,
            "top_k": TOP_K, "seed": seed, "controller": "fixed", "k": 2, **extra}
    loglik, tokens = 0.0, None
    with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for event, data in iter_sse(r):
            if event == "step":
                accepted = data["accepted"]
                probs = data["target_probs"][:accepted] + [data["next_token_prob"]]
                loglik += sum(math.log(max(p, 1e-30)) for p in probs[: len(data["tokens"])])
            elif event == "done":
                tokens = tuple(data["token_ids"])
            elif event == "error":
                raise AssertionError(data)
    assert tokens is not None and len(tokens) == TOKENS
    return tokens, loglik


def draw(url: str, mode: str, temperature: float = 1.0, offset: int = 0, **extra) -> list[tuple[tuple[int, ...], float]]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda s: sample(url, s, mode, temperature, **extra), range(offset, offset + SAMPLES)))


def homogeneity(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> dict[str, float]:
    """Chi-square homogeneity of two samples of categories; sparse cells pooled."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    total = len(a) + len(b)
    cells = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
    keep = [c for c in cells if (ca[c] + cb[c]) * min(len(a), len(b)) / total >= MIN_CELL]
    table = [[ca[c] for c in keep], [cb[c] for c in keep]]
    rest = (len(a) - sum(table[0]), len(b) - sum(table[1]))
    if sum(rest):
        table[0].append(rest[0])
        table[1].append(rest[1])
    stat, p, dof, _ = chi2_contingency(table)
    return {"chi2": float(stat), "p": float(p), "dof": int(dof), "cells": len(table[0])}


def mean_and_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def test_speculative_sampling_matches_the_target(tmp_path):
    with running_stack(tmp_path) as stack:
        url = stack["url"]
        spec = draw(url, "speculative")
        plain = draw(url, "autoregressive", offset=10_000)  # other seeds: independent samples
        colder = draw(url, "autoregressive", temperature=0.6, offset=20_000)
    first2 = homogeneity([t[:2] for t, _ in spec], [t[:2] for t, _ in plain])
    power = homogeneity([t[:2] for t, _ in plain], [t[:2] for t, _ in colder])
    (m_spec, se_spec), (m_plain, se_plain) = mean_and_se([x for _, x in spec]), mean_and_se([x for _, x in plain])
    z = (m_spec - m_plain) / math.sqrt(se_spec**2 + se_plain**2)
    write_report("sampling_lossless", {
        "samples_per_arm": SAMPLES, "prompt": PROMPT, "tokens": TOKENS, "top_k": TOP_K,
        "speculative_vs_autoregressive": first2, "power_check_t1_vs_t06": power,
        "loglik": {"speculative": [m_spec, se_spec], "autoregressive": [m_plain, se_plain], "z": z},
        "distinct_first_two": len({t[:2] for t, _ in spec + plain}),
    })
    assert power["p"] < 1e-3, f"the test cannot tell temperature 1.0 from 0.6: {power}"
    assert first2["p"] > 1e-3, f"speculative and plain sampling differ: {first2}"
    assert abs(z) < 4, f"mean log-likelihoods differ: {m_spec:.3f} ± {se_spec:.3f} vs {m_plain:.3f} ± {se_plain:.3f}"


# Every logit control at once (penalties that see the tokens sampled before, so the second and
# third positions' laws depend on the first; a bias; min-p), as /v1/generate takes them.
CONTROLS = {"frequency_penalty": 1.0, "presence_penalty": 0.7, "repetition_penalty": 1.3, "min_p": 0.02}


def test_speculative_sampling_with_every_logit_control_matches_the_target(tmp_path):
    with running_stack(tmp_path) as stack:
        url = stack["url"]
        # the bias lifts the token plain sampling draws most often second, so it matters at once
        seen = collections.Counter(t[1] for t, _ in draw(url, "autoregressive", offset=30_000))
        controls = {**CONTROLS, "logit_bias": {str(seen.most_common(2)[1][0]): 2.0}}
        spec = draw(url, "speculative", offset=40_000, **controls)
        plain = draw(url, "autoregressive", offset=50_000, **controls)
        free = draw(url, "autoregressive", offset=60_000)
    first3 = homogeneity([t for t, _ in spec], [t for t, _ in plain])
    power = homogeneity([t for t, _ in plain], [t for t, _ in free])
    (m_spec, se_spec), (m_plain, se_plain) = mean_and_se([x for _, x in spec]), mean_and_se([x for _, x in plain])
    z = (m_spec - m_plain) / math.sqrt(se_spec**2 + se_plain**2)
    write_report("sampling_lossless_controls", {
        "samples_per_arm": SAMPLES, "prompt": PROMPT, "tokens": TOKENS, "top_k": TOP_K, "controls": controls,
        "speculative_vs_autoregressive": first3, "power_check_controls_vs_none": power,
        "loglik": {"speculative": [m_spec, se_spec], "autoregressive": [m_plain, se_plain], "z": z},
    })
    assert power["p"] < 1e-3, f"the controls do not change the law, so this test shows nothing: {power}"
    assert first3["p"] > 1e-3, f"speculative and plain sampling differ with the controls on: {first3}"
    assert abs(z) < 4, f"mean log-likelihoods differ: {m_spec:.3f} ± {se_spec:.3f} vs {m_plain:.3f} ± {se_plain:.3f}"
