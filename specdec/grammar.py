"""Structured output: a grammar (llguidance) that constrains which tokens either model may emit.

A request's grammar travels in its :class:`~specdec.params.Sampling` (``grammar``: llguidance's
grammar JSON, ``output_start``: where in the request's tokens the constrained output begins, the
prompt's length). Each model service keeps, per session, one matcher that has consumed exactly the
committed output tokens (``tokens[output_start:]``), as it keeps a KV cache: a call that arrives
with more committed tokens consumes the new ones, a call that diverges rolls back to the common
prefix first (:meth:`Grammars.state`).

How speculation stays exact under a grammar (masks are applied to logits before the sampling
transform, in both services, so p' and q' are the constrained laws):

- the draft samples each token from its own masked distribution q' (the mask after the tokens it
  drafted before), and reports q' as the distribution it drew from;
- the target computes, in one pass, the mask at every draft position on prefix + the draft tokens
  before it (:meth:`GrammarState.masks`), applies each to its row, and verifies as always: greedy
  takes the masked argmax, sampling accepts with min(1, p'(x)/q'(x)) and replaces from
  norm(max(0, p' - q')). Rows after the first draft token the grammar refuses are never read: that
  token has p' = 0 and is rejected there.

Plain decoding is the same pass with no draft, so speculative output under a grammar equals plain
output under it, token for token (greedy) and in law (sampling).

The mask is a bitmask llguidance fills (a bit per token); it is unpacked with numpy and applied
with one ``masked_fill`` per row, never per token in Python.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Matchers held per service (one per session with a grammar); the least recently used goes first.
MAX_STATES = 4096
# Grammars known to compile, remembered (by digest) so a request's later calls skip the compile.
MAX_VALID = 1024
# A grammar's text (llguidance JSON) at most, so one request cannot make every call carry megabytes.
MAX_GRAMMAR_BYTES = 256 * 1024
# JSON output: whitespace between tokens is bounded as llama.cpp's JSON grammars bound it (one
# space, or a newline and an indent of at most 20): with unbounded whitespace a small model can fill
# its whole budget with newlines inside an object.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "key_separator": ":", "item_separator": ","}


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise InvalidArgument(f"structured output needs the llguidance package ({exc})") from exc
    return llguidance


# ---- grammars from what a client asks for (the orchestrator: no torch) ------------------------

def from_json_schema(schema: dict[str, Any] | bool) -> str:
    """The grammar of JSON text that validates against ``schema`` (``True``/``{}``: any JSON value)."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidArgument("a JSON schema is an object")
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def from_regex(pattern: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(pattern)


def from_choice(choices: Sequence[str]) -> str:
    """Exactly one of ``choices``."""
    import re

    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgument("choice is a non-empty list of non-empty strings")
    return from_regex("|".join(f"(?:{re.escape(c)})" for c in choices))


def from_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's: llguidance converts it)."""
    llg = _llguidance()
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        text = any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter's own message says what is wrong
        raise InvalidArgument(f"the GBNF grammar does not convert: {exc}") from exc
    return llg.LLMatcher.grammar_from_lark(text)


def validate(grammar: str) -> str:
    """``grammar`` when llguidance compiles it, else InvalidArgument with its message."""
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidArgument(f"the grammar is {len(grammar.encode())} bytes, over the {MAX_GRAMMAR_BYTES} allowed")
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgument(f"the grammar does not compile: {error}")
    return grammar


# ---- the services' side --------------------------------------------------------------------------

def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A llguidance bitmask [..., ceil(V / 32)] int32 as allowed-token booleans [..., V]."""
    import numpy as np
    import torch

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[..., :vocab_size].astype(bool))


def apply(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] with every token ``allowed`` [..., V] refuses at -inf (a new tensor)."""
    return logits.float().masked_fill(~allowed, float("-inf"))


@dataclass
class GrammarState:
    """One session's matcher and the output tokens it has consumed."""

    key: tuple[str, int]  # (sha256 of the grammar, output_start)
    matcher: Any  # llguidance.LLMatcher
    vocab_size: int
    eos_token_ids: list[int]
    consumed: list[int] = field(default_factory=list)
    after_end: int = 0  # trailing consumed tokens the matcher never saw (the EOS after its end)

    def sync(self, output: Sequence[int]) -> bool:
        """Make the matcher have consumed exactly ``output``: roll back to the common prefix, then
        consume the rest. False when the grammar refuses ``output`` (the matcher then holds the
        longest prefix it accepts)."""
        from specdec.engine.sessions import common_prefix_len

        common = common_prefix_len(self.consumed, output)
        self.rollback(len(self.consumed) - common)
        return all(self.advance(token) for token in output[common:])

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` consumed tokens."""
        if n <= 0:
            return
        virtual = min(n, self.after_end)
        self.after_end -= virtual
        if n > virtual and not self.matcher.rollback(n - virtual):
            raise RuntimeError(f"llguidance could not roll back: {self.matcher.get_error()}")
        del self.consumed[len(self.consumed) - n:]

    def mask(self) -> torch.Tensor:
        """The tokens the grammar allows next [V] (bool); once it has ended, the EOS tokens only (also
        after one was consumed, so a pass's rows past the end stay distributions)."""
        import torch

        if self.matcher.is_stopped():
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[self.eos_token_ids] = True
            return allowed
        bitmask = torch.empty((self.vocab_size + 31) // 32, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        return unpack(bitmask, self.vocab_size)

    def advance(self, token: int) -> bool:
        """Consume one more token (a draft token); False when the grammar refuses it."""
        if self.matcher.is_stopped():
            # the grammar has ended (llguidance stops by itself where nothing can follow): one EOS
            # token ends the output; the matcher does not count it, so it is kept apart for rollback
            if self.after_end or token not in self.eos_token_ids:
                return False
            self.after_end = 1
        # validated first: a refused consume_token would leave the matcher in its error state for good
        elif self.matcher.validate_tokens([token]) == 1:
            self.matcher.consume_token(token)
        else:
            return False
        self.consumed.append(token)
        return True

    def masks(self, draft: Sequence[int]) -> torch.Tensor:
        """The mask at each position of a verify pass [n, V]: after the consumed tokens, then after
        each draft token, stopping after the first draft token the grammar refuses (n <= k + 1).
        The matcher ends where it began."""
        import torch

        rows = [self.mask()]
        taken = 0
        for token in draft:
            if bool(rows[-1][token]) and self.advance(token):
                taken += 1
                rows.append(self.mask())
                continue
            if bool(rows[-1][token]):  # allowed by the mask yet refused: the row must refuse it too
                rows[-1] = rows[-1].clone()
                rows[-1][token] = False
            break
        self.rollback(taken)
        return torch.stack(rows)


class Grammars:
    """A service's matchers, one per session with a grammar (bounded, least recently used first).

    ``tokenizer``: returns the model's transformers tokenizer, called once, the first time a
    grammar is used (llguidance builds its token trie from it: ~2 s for a 49k vocabulary)."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int],
                 max_states: int = MAX_STATES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_states = max_states
        self._ll_tokenizer: Any = None
        self._states: OrderedDict[str, GrammarState] = OrderedDict()
        self._valid: OrderedDict[bytes, None] = OrderedDict()  # digests of grammars that compiled
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    def tokenizer(self) -> Any:
        """llguidance's tokenizer of the model (built on first use)."""
        if self._ll_tokenizer is None:
            with self._load_lock:
                if self._ll_tokenizer is None:
                    import llguidance.hf

                    tokenizer = self._tokenizer()
                    if tokenizer is None:
                        raise InvalidArgument("this model service has no tokenizer for grammars")
                    try:
                        self._ll_tokenizer = llguidance.hf.from_tokenizer(
                            tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                    except Exception as exc:  # noqa: BLE001 - llguidance names what it cannot read
                        raise InvalidArgument(f"structured output is unavailable for this model's tokenizer "
                                              f"({type(exc).__name__}: {exc})") from exc
                    logger.info("grammar tokenizer ready (%d tokens, eos %s)", self.vocab_size, self.eos_token_ids)
        return self._ll_tokenizer

    def check(self, grammar: str) -> None:
        """InvalidArgument unless ``grammar`` compiles for this model (called as a request arrives,
        off the model's thread; loads the tokenizer the first time)."""
        if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidArgument(f"the grammar is {len(grammar.encode())} bytes, over the {MAX_GRAMMAR_BYTES} allowed")
        digest = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            if digest in self._valid:  # a request's grammar comes with each of its calls: compile it once
                self._valid.move_to_end(digest)
                return
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error:
            raise InvalidArgument(f"the grammar does not compile: {error}")
        with self._lock:
            self._valid[digest] = None
            while len(self._valid) > MAX_VALID:
                self._valid.popitem(last=False)

    def state(self, session_id: str, grammar: str, start: int, tokens: Sequence[int]) -> GrammarState | None:
        """The session's matcher, having consumed ``tokens[start:]``; None when the grammar refuses
        those tokens. A new grammar or start for the session starts a new matcher."""
        if start > len(tokens):
            raise InvalidArgument(f"output_start {start} is past the {len(tokens)} tokens")
        key = (hashlib.sha256(grammar.encode()).hexdigest(), start)
        with self._lock:
            state = self._states.get(session_id)
            if state is not None and state.key == key:
                self._states.move_to_end(session_id)
            else:
                state = None
        if state is None:
            llg = _llguidance()
            matcher = llg.LLMatcher(self.tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise InvalidArgument(f"the grammar does not compile: {matcher.get_error()}")
            state = GrammarState(key, matcher, self.vocab_size, self.eos_token_ids)
            with self._lock:
                self._states[session_id] = state
                while len(self._states) > self.max_states:
                    self._states.popitem(last=False)
        return state if state.sync(list(tokens[start:])) else None

    def release(self, session_id: str) -> None:
        with self._lock:
            self._states.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._states)
