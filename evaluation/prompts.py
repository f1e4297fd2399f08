"""The versioned prompt suite (``evaluation/prompts.jsonl``).

One JSON object per line: ``id``, ``category``, ``chat`` (true: the text is a user message sent
through the tokenizer's chat template; false: raw text to continue) and ``text``. Editing the file
changes its digest, which every results file records next to ``SUITE_VERSION``; bump the version
when prompts are added, removed or reworded so old and new numbers are not compared.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUITE_VERSION = "1"
SUITE_PATH = Path(__file__).with_name("prompts.jsonl")
CATEGORIES = ("chat_qa", "explanation", "code", "lists_json", "summarisation", "story")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    chat: bool
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_suite(path: Path = SUITE_PATH) -> list[Prompt]:
    """All prompts of the suite, in file order; ValueError names the line of a malformed entry."""
    prompts, seen = [], set()
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = Prompt(id=str(row["id"]), category=str(row["category"]), chat=bool(row["chat"]), text=str(row["text"]))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{path}:{n}: not a prompt entry ({exc})") from exc
        if prompt.category not in CATEGORIES:
            raise ValueError(f"{path}:{n}: unknown category {prompt.category!r} (one of {', '.join(CATEGORIES)})")
        if prompt.id in seen:
            raise ValueError(f"{path}:{n}: duplicate id {prompt.id!r}")
        if not prompt.text:
            raise ValueError(f"{path}:{n}: empty text")
        seen.add(prompt.id)
        prompts.append(prompt)
    return prompts


def suite_digest(path: Path = SUITE_PATH) -> str:
    """sha256 of the suite file (first 12 hex digits), recorded with every result."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def select(prompts: list[Prompt], limit: int | None = None, categories: list[str] | None = None) -> list[Prompt]:
    """A subset: only ``categories`` (all when None), then at most ``limit`` prompts taken round-robin
    over the categories, so any subset size covers every category it can."""
    if categories:
        unknown = sorted(set(categories) - set(CATEGORIES))
        if unknown:
            raise ValueError(f"unknown categories {unknown} (one of {', '.join(CATEGORIES)})")
        prompts = [p for p in prompts if p.category in categories]
    if limit is None or limit >= len(prompts):
        return list(prompts)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    chosen: list[Prompt] = []
    while len(chosen) < limit:
        for queue in by_cat.values():
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    order = {p.id: i for i, p in enumerate(prompts)}
    return sorted(chosen, key=lambda p: order[p.id])
