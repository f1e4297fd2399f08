"""The modes ``python -m evaluation.bench`` runs (``--modes``, ``--extra-draft``: see its
``--help``), and the rotated order every benchmark runs its modes in."""

from __future__ import annotations

import argparse
import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.model.gguf_convert import QUANTS

FIXED_KS = (*range(1, 9), 12, 16)  # fixed-k modes
MAX_FIXED_K = max(FIXED_KS)


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # "hf" (in this process) or "specdec" (through an orchestrator)
    how: str = ""  # hf: plain | assisted | prompt_lookup
    stack: str = "main"  # specdec: "main" (the model draft), "ngram" (the n-gram draft service) or an extra draft's name
    body: dict[str, Any] = field(default_factory=dict)  # specdec: request fields of /v1/generate


# --extra-draft NAME: a slug, so it can name log files, a stack and mode prefixes
EXTRA_NAME = re.compile(r"[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*")
# names of the built-in stacks, and first words of the built-in modes: an extra draft named so
# would be swept up by their patterns ('sd-*') and the plots' grouping
RESERVED_NAMES = ("main", "hf", "sd", "ngram")
UNCONVERTED = ("embedded",)  # SPECDEC_DRAFT_MODEL values the draft runs as shipped (no quantisation)


@dataclass(frozen=True)
class ExtraDraft:
    """``--extra-draft NAME=SPEC``: one more llama.cpp draft service (SPECDEC_DRAFT_MODEL=model, at
    ``quant`` when given) with its own orchestrator over the shared target."""

    name: str
    model: str
    quant: str | None = None  # None: the draft service's default

    def env(self, target: str) -> dict[str, str]:
        """The draft service's settings (``target`` for model=target: the model the target service runs)."""
        env = {"SPECDEC_DRAFT_BACKEND": "llamacpp", "SPECDEC_DRAFT_MODEL": self.model, "SPECDEC_DRAFT_TARGET_MODEL": target}
        if self.quant:
            env["SPECDEC_DRAFT_QUANT"] = self.quant
        return env

    def modes(self) -> list[Mode]:
        # the bodies of sd-cost and sd-fixed-k4, so the drafts compare with the main one as well
        return [Mode(f"{self.name}-fixed-k4", "specdec", stack=self.name,
                     body={"controller": "fixed", "k": 4, "max_k": MAX_FIXED_K, "overlap": False}),
                Mode(f"{self.name}-cost", "specdec", stack=self.name, body={"controller": "cost", "overlap": False})]


def parse_extra_draft(value: str) -> ExtraDraft:
    """``NAME=SPEC`` (SPEC: a SPECDEC_DRAFT_MODEL value, optionally ``@QUANT``) as an ExtraDraft;
    argparse reports the ArgumentTypeError."""
    name, sep, spec = value.partition("=")
    if not sep or not spec:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=SPEC, e.g. self-q4_0=target@q4_0")
    if not EXTRA_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{value!r}: NAME {name!r} is not a simple slug (lowercase letters, digits, '_' and '-', starting with a letter)")
    if name.split("-")[0] in RESERVED_NAMES:
        raise argparse.ArgumentTypeError(
            f"{value!r}: NAME {name!r} clashes with the built-in stacks and modes ({', '.join(RESERVED_NAMES)})")
    model, quant = spec, None
    if "@" in spec:
        model, _, quant = spec.rpartition("@")
        quant = quant.lower()
        if quant not in QUANTS:
            raise argparse.ArgumentTypeError(f"{value!r}: unknown quantisation {quant!r} (one of {', '.join(QUANTS)})")
        # the draft service runs these files as they are: a quantisation would be a silent no-op
        if model in UNCONVERTED or model.lower().endswith(".gguf"):
            raise argparse.ArgumentTypeError(f"{value!r}: {model!r} is not converted, so @{quant} would not apply")
    if not model:
        raise argparse.ArgumentTypeError(f"{value!r}: SPEC names no model")
    return ExtraDraft(name, model, quant)


def all_modes(extras: Sequence[ExtraDraft] = ()) -> list[Mode]:
    modes = [Mode("hf-plain", "hf", "plain"), Mode("hf-assisted", "hf", "assisted"),
             Mode("hf-prompt-lookup", "hf", "prompt_lookup"),
             Mode("sd-autoregressive", "specdec", body={"mode": "autoregressive"})]
    # alternating (draft, then verify), whatever the server's default
    modes += [Mode(f"sd-fixed-k{k}", "specdec", body={"controller": "fixed", "k": k, "max_k": MAX_FIXED_K, "overlap": False})
              for k in FIXED_KS]
    modes += [Mode(f"sd-{c}", "specdec", body={"controller": c, "overlap": False}) for c in ("acceptance", "hf", "cost")]
    # overlapped: the next block is drafted while this one is verified
    modes += [Mode(f"sd-overlap-fixed-k{k}", "specdec", body={"controller": "fixed", "k": k, "max_k": MAX_FIXED_K,
                                                              "overlap": True}) for k in (3, 4, 6, 8)]
    modes += [Mode("sd-overlap-cost", "specdec", body={"controller": "cost", "overlap": True})]
    modes += [Mode("ngram-fixed-k4", "specdec", stack="ngram", body={"controller": "fixed", "k": 4, "overlap": False}),
              Mode("ngram-cost", "specdec", stack="ngram", body={"controller": "cost", "overlap": False})]
    modes += [m for e in extras for m in e.modes()]
    return modes


ASSISTED_MODES = ("hf-assisted", "hf-prompt-lookup")


def pick_modes(patterns: list[str] | None, extras: Sequence[ExtraDraft] = ()) -> list[Mode]:
    """Modes matching any of ``patterns`` (names or shell patterns), in the canonical order."""
    modes = all_modes(extras)
    if not patterns:
        return modes
    chosen = [m for m in modes if any(fnmatch.fnmatchcase(m.name, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(m.name, p) for m in modes)]
    if unmatched:
        raise SystemExit(f"--modes: {unmatched} match no mode (modes: {', '.join(m.name for m in modes)})")
    return chosen


def rotation(modes: list[Any], shift: int) -> list[Any]:
    """``modes`` rotated left by ``shift`` (the order of one prompt's runs)."""
    if not modes:
        return []
    s = shift % len(modes)
    return modes[s:] + modes[:s]
