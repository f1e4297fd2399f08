"""The planner: which sessions a step computes, and how many rows of each (chunked prefills
included), under a row budget. Pure: no model, no locks, no clock; the target's verifier and every
draft backend plan their steps with :func:`plan`.

A job's *need* is the part of its sequence its cache lacks (``length - cached`` rows) and how many
rows at its end want logits (``final``: a verify's draft + 1, a draft step's 1). The rules, in order:

1. **Decode-sized work first.** Batched jobs of at most ``verify_rows`` rows, oldest first, share
   the pass: each stream gets its next token every step.
2. **Jobs that compute alone** (sampling jobs: a pass of their own, so a seeded request's numbers
   never depend on the batch around it), oldest first, each chunked as if nothing else waited and
   counted against the same budget, one pass at least; a later, smaller one never overtakes one that
   does not fit.
3. **Long prefills** with what is left, whole or in chunks of at least ``min_chunk`` rows (capped at
   ``shared_prefill_rows`` when others decode in the pass, so their next token stays close). A chunk
   covers committed tokens only: the rows that want logits come with the job's last piece, so a
   chunked job gets no logits until then (its outcome stays pending).

``min_chunk`` rows are held back from rules 1 and 2 while a long prefill waits, so it always moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

VERIFY_SIZED_ROWS = 64
MIN_PREFILL_CHUNK = 16


@dataclass(frozen=True)
class Need:
    """One job's demand on a step: its sequence is ``length`` tokens, the first ``cached`` already
    in its session's cache; the last ``final`` rows want logits."""

    index: int  # the job's place in the step's list (oldest first)
    cached: int
    length: int
    final: int
    alone: bool = False  # computes in a pass of its own

    @property
    def rows(self) -> int:
        return self.length - self.cached

    @property
    def chunk_end(self) -> int:
        """The furthest a prefill chunk may reach: the rows wanting logits come last, together."""
        return self.length - self.final


@dataclass(frozen=True)
class Budget:
    """A step's row limits (see the module doc)."""

    max_rows: int
    shared_prefill_rows: int = 0  # 0: no cap beyond max_rows
    verify_rows: int = VERIFY_SIZED_ROWS
    min_chunk: int = MIN_PREFILL_CHUNK

    @classmethod
    def of(cls, max_rows: int, shared_prefill_rows: int, longest_final: int) -> Budget:
        """A service's budget: ``max_rows`` raised so a pass always holds the longest rows wanting
        logits (``longest_final``: a verify of the longest draft) and a prefill chunk beside them;
        ``shared_prefill_rows`` at least a chunk."""
        return cls(max(max_rows, longest_final + MIN_PREFILL_CHUNK),
                   max(shared_prefill_rows, MIN_PREFILL_CHUNK) if shared_prefill_rows else 0)


@dataclass(frozen=True)
class Slot:
    """A job's part of a pass: compute its sequence up to ``end``; ``logits`` rows at the end want
    logits (0: a prefill chunk, the job is not finished)."""

    index: int
    end: int
    logits: int


@dataclass
class Plan:
    """The step: ``shared`` run as one batched pass; each of ``alone`` runs in a pass of its own."""

    shared: list[Slot] = field(default_factory=list)
    alone: list[Slot] = field(default_factory=list)

    @property
    def slots(self) -> list[Slot]:
        return self.shared + self.alone


def _whole(need: Need) -> Slot:
    return Slot(need.index, need.length, need.final)


def plan(needs: Sequence[Need], budget: Budget) -> Plan:
    """The step's plan for ``needs`` (oldest first; one per session)."""
    step = Plan()
    waiting_prefill = any(n.rows > budget.verify_rows for n in needs)
    reserve = budget.min_chunk if waiting_prefill else 0
    left = budget.max_rows - reserve
    planned: set[int] = set()
    for n in needs:  # 1. decode-sized batched work
        if not n.alone and n.rows <= budget.verify_rows and n.rows <= left:
            step.shared.append(_whole(n))
            planned.add(n.index)
            left -= n.rows
    left = _plan_alone(needs, budget, step, left)
    left += reserve
    if step.shared and budget.shared_prefill_rows:
        left = min(left, budget.shared_prefill_rows)
    for n in needs:  # 3. long prefills, whole or chunked
        if n.alone or n.index in planned or left <= 0:
            continue
        if n.rows <= left:
            step.shared.append(_whole(n))
            left -= n.rows
        elif left >= budget.min_chunk and n.cached < n.chunk_end:
            end = min(n.cached + left, n.chunk_end)
            step.shared.append(Slot(n.index, end, 0))
            left -= end - n.cached
    return step


def _plan_alone(needs: Sequence[Need], budget: Budget, step: Plan, left: int) -> int:
    """Rule 2 (see the module doc); returns the rows left."""
    for n in needs:
        if not n.alone:
            continue
        if n.rows <= budget.max_rows:
            slot = _whole(n)
        else:  # chunked as if nothing else waited: its numbers must not depend on the load
            slot = Slot(n.index, min(n.cached + budget.max_rows, n.chunk_end), 0)
        cost = min(n.rows, budget.max_rows)
        if step.alone and cost > left:
            break  # in order: a later, smaller one does not overtake it
        step.alone.append(slot)
        left -= cost
    return left
