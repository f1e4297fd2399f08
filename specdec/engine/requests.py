"""Checks every model service applies to a request before it reaches the compute thread, and what a
model's configuration says about its limits (end-of-sequence ids, context)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.errors import InvalidArgument

MAX_SESSION_ID_LEN = 128


def validate_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_LEN or not session_id.isprintable():
        raise InvalidArgument(f"session_id must be 1..{MAX_SESSION_ID_LEN} printable characters, got {session_id!r}")


def validate_tokens(tokens: Sequence[int], vocab_size: int, what: str = "tokens", allow_empty: bool = False) -> None:
    if not tokens and not allow_empty:
        raise InvalidArgument(f"{what} must not be empty")
    if tokens:
        bad = max(tokens)
        if bad >= vocab_size:
            raise InvalidArgument(f"{what} holds id {bad}, outside the vocabulary of {vocab_size} ids")


def validate_context(length: int, max_context: int, what: str) -> None:
    if length > max_context:
        raise InvalidArgument(f"{what} is {length} tokens, over the model's maximum context of {max_context}")


def eos_ids(config: Any, tokenizer: Any | None = None, generation_config: Any | None = None) -> list[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer.

    Chat models often name their end-of-turn token only in ``generation_config.json`` (a list of
    ids), so a generation that ignored it would run past the end of the answer.
    """
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), getattr(config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return sorted(ids)


def max_context_of(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048

