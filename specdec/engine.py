"""Pieces shared by the draft and target engines: request validation, model description, and
:class:`CachedCausalLM`, a transformers model with per-session KV caches and prefix reuse.

Engines never import grpc; servicers translate their results and map :mod:`specdec.errors`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from specdec.errors import InvalidArgument
from specdec.params import ModelInfo  # noqa: F401  (re-exported)
from specdec.sessions import Session, SessionStore, common_prefix_len

logger = logging.getLogger(__name__)

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


# Verify forwards carry 1..k+1 rows; above this many the stock linear kernel is used (prefill).
FAST_LINEAR_MAX_ROWS = 32


class _FastLinears:
    """Faster CPU fp32 ``nn.Linear`` for the few-row forwards of decoding and verification.

    ``F.linear(x, W)`` computes ``x @ W.T``; with 2..~10 rows MKL takes a slow path for the
    transposed weight (the 49152-row lm_head took 20-40 ms for 2-5 rows against 10 ms for one),
    and its one-row gemv reaches only ~10 GB/s. ``(W @ x.T).T`` streams the row-major weight at
    ~25 GB/s for two or more rows, so a single row is duplicated to two. Same dot products, only
    the summation blocking differs (~1e-6 relative). Active only inside :meth:`active` (per thread),
    so other users of the same model object (``generate``, tests) keep the stock kernels.
    """

    @classmethod
    def of(cls, model: Any) -> _FastLinears:
        """The model's one instance (engines may share a model object; wrap its layers once)."""
        fast = getattr(model, "_specdec_fast_linears", None)
        if not isinstance(fast, cls):
            fast = cls(model)
            model._specdec_fast_linears = fast
        return fast

    def __init__(self, model: Any) -> None:
        self._local = threading.local()
        self.count = 0
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" \
                    and module.weight.dtype == torch.float32:
                # An instance attribute shadows nn.Linear.forward for this module only.
                module.forward = functools.partial(self._forward, module, module.forward)
                self.count += 1

    def active(self) -> _FastLinearsScope:
        return _FastLinearsScope(self._local)

    def _forward(self, module: torch.nn.Linear, stock: Any, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self._local, "on", False) or x.dim() < 2:
            return stock(x)
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if rows > FAST_LINEAR_MAX_ROWS or rows == 0 or x2.dtype != torch.float32:
            return stock(x)
        if rows == 1:
            y = (module.weight @ torch.cat((x2, x2)).T)[:, :1].T.contiguous()
        else:
            y = (module.weight @ x2.T).T.contiguous()
        if module.bias is not None:
            y += module.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class _FastLinearsScope:
    def __init__(self, local: threading.local) -> None:
        self._local = local

    def __enter__(self) -> None:
        self._prev = getattr(self._local, "on", False)
        self._local.on = True

    def __exit__(self, *exc: Any) -> None:
        self._local.on = self._prev


class CachedCausalLM:
    """A transformers causal LM whose sessions keep their own ``DynamicCache``.

    :meth:`extend` makes a session's cache cover ``tokens + extra``, reusing the longest common
    prefix with what the cache held, cropping the rest, and running one forward pass over the new
    suffix only. Callers hold :attr:`lock` around it: one forward at a time per model.
    """

    def __init__(self, model: Any, store: SessionStore) -> None:
        self.model = model
        self.store = store
        self.lock = threading.Lock()
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        self._fast = _FastLinears.of(model)
        self.bytes_per_token = self._measure_bytes_per_token()
        self.model_max_context = max_context_of(model.config)

    @property
    def max_context(self) -> int:
        """Longest sequence a session may hold: the model's context, or fewer tokens when the KV
        budget holds fewer, so clients learn up front that a longer sequence is their input's
        problem (INVALID_ARGUMENT, HTTP 400), not a server fault."""
        return max(2, min(self.model_max_context, self.store.max_bytes // self.bytes_per_token))

    def _measure_bytes_per_token(self) -> int:
        """Run one token through the model (also warms it up) and read the cache size."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=self.device), use_cache=True)
        return max(1, cache_nbytes(out.past_key_values) // 2)

    def session(self, session_id: str) -> Session:
        return self.store.get_or_create(session_id, lambda: None)

    def extend(self, session: Session, tokens: list[int], extra: Sequence[int] = ()) -> tuple[torch.Tensor, int]:
        """Forward the uncached part of ``tokens + extra``.

        Returns:
            logits: [len(extra) + 1, V] fp32; row i predicts the token after ``(tokens + extra)[:len(tokens) + i]``.
            cached: how many leading tokens were reused from the session's cache.
        """
        full = tokens + list(extra)
        # At least the last committed token is recomputed: its logits are needed.
        cached = min(common_prefix_len(session.tokens, tokens), len(tokens) - 1)
        # Room first: a refusal here leaves the session exactly as it was.
        self.store.reserve(session, len(full) * self.bytes_per_token - session.nbytes)
        cache = session.cache
        try:
            if cache is not None:
                held = cache.get_seq_length()
                if cached == 0:
                    cache = None
                elif held > cached:
                    cache.crop(cached - held)
            new = full[cached:]
            with torch.inference_mode(), self._fast.active():
                out = self.model(
                    input_ids=torch.tensor([new], dtype=torch.long, device=self.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=len(extra) + 1,
                )
        except BaseException:
            # The cache may have been cropped or half-extended: it no longer matches
            # session.tokens, and reusing it would give silently wrong logits. Start afresh.
            session.cache = None
            self.store.reset(session)
            raise
        session.cache = out.past_key_values
        self.store.update(session, full, len(full) * self.bytes_per_token)
        return out.logits[0].float(), cached


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a transformers cache's key/value tensors."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
