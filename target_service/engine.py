"""Target engine: one forward pass over the uncached suffix + draft, then greedy or lossless
rejection-sampling verification. No grpc here; see servicer.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec import sampling as sm
from specdec.engine import (
    CachedCausalLM,
    ModelInfo,
    eos_ids,
    validate_context,
    validate_session_id,
    validate_tokens,
)
from specdec.errors import InvalidArgument
from specdec.models import LoadedModel, tokenizer_fingerprint
from specdec.sessions import SessionStore

logger = logging.getLogger(__name__)


@dataclass
class Verification:
    """Result of one Verify call."""

    num_accepted: int
    next_token: int  # correction at the first rejected position, or the bonus token
    target_probs: list[float]  # [k] target probability of each draft token (when asked)
    next_token_prob: float
    cached_tokens: int
    compute_ns: int


class TargetEngine:
    """Verifies drafts against a transformers causal LM with per-session KV caches."""

    backend = "transformers"

    def __init__(self, loaded: LoadedModel, store: SessionStore, max_draft_tokens: int = 32) -> None:
        self.loaded = loaded
        self.lm = CachedCausalLM(loaded.model, store)
        self.store = store
        self.max_draft_tokens = max_draft_tokens
        config = loaded.model.config
        self._info = ModelInfo(
            model_id=loaded.model_id,
            architecture=(config.architectures or [type(loaded.model).__name__])[0],
            vocab_size=self.lm.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            max_context=self.lm.max_context,
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            device=str(self.lm.device),
            backend=self.backend,
            max_draft_tokens=max_draft_tokens,
            eos_token_ids=eos_ids(config, loaded.tokenizer),
        )

    def info(self) -> ModelInfo:
        self._info.sessions = len(self.store)
        self._info.kv_bytes = self.store.nbytes
        self._info.kv_budget_bytes = self.store.max_bytes
        return self._info

    def release(self, session_id: str) -> bool:
        validate_session_id(session_id)
        with self.lm.lock:
            return self.store.release(session_id)

    def verify(
        self,
        session_id: str,
        tokens: Sequence[int],
        draft: Sequence[int] = (),
        sampling: sm.Sampling = sm.Sampling(),
        draft_distributions: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
        return_target_probs: bool = False,
    ) -> Verification:
        """Verify ``draft`` after ``tokens`` in one forward pass.

        ``draft_distributions`` are the draft's q (sparse, one per draft token), required when
        sampling with a non-empty draft.
        """
        t0 = time.perf_counter_ns()
        tokens, draft = list(tokens), list(draft)
        validate_session_id(session_id)
        validate_tokens(tokens, self.lm.vocab_size)
        validate_tokens(draft, self.lm.vocab_size, what="draft_tokens", allow_empty=True)
        sampling.validate()
        if len(draft) > self.max_draft_tokens:
            raise InvalidArgument(f"draft_tokens holds {len(draft)} tokens, over the maximum of {self.max_draft_tokens}")
        # The verified draft and the next token must fit in the context.
        validate_context(len(tokens) + len(draft) + 1, self.lm.max_context, "tokens + draft_tokens + 1")
        if not sampling.greedy and draft and len(draft_distributions) != len(draft):
            raise InvalidArgument(
                f"sampling verification needs one draft distribution per draft token: got "
                f"{len(draft_distributions)} for {len(draft)} draft tokens"
            )

        with self.lm.lock:
            session = self.lm.session(session_id)
            logits, cached = self.lm.extend(session, tokens, draft)  # [k + 1, V]
        first = len(tokens)  # absolute position of draft[0] (and of the next token when k == 0)
        k = len(draft)
        if sampling.greedy:
            num_accepted, next_token = sm.verify_greedy(logits.argmax(dim=-1).tolist(), draft)
            # one softmax serves both the draft tokens' probabilities and the next token's
            p = torch.softmax(logits, dim=-1) if return_target_probs else None
            row = p[num_accepted] if p is not None else torch.softmax(logits[num_accepted], dim=-1)
            next_prob = float(row[next_token])
        else:
            p = sm.probabilities(logits, sampling)
            if k:
                q = torch.stack([sm.to_dense(list(ids), list(pr), p.shape[-1]) for ids, pr in draft_distributions])
                for i, x in enumerate(draft):
                    if q[i, x] <= 0:
                        raise InvalidArgument(f"draft distribution {i} gives probability 0 to its own draft token {x}")
                num_accepted, next_token = sm.verify_sampling(p, q, draft, sampling.seed, first)
            else:
                num_accepted, next_token = 0, sm.sample(p[0], sampling.seed, first, sm.STREAM_TARGET)
            next_prob = float(p[num_accepted, next_token])
        target_probs = [float(p[i, x]) for i, x in enumerate(draft)] if (return_target_probs and p is not None) else []
        return Verification(
            num_accepted=num_accepted,
            next_token=next_token,
            target_probs=target_probs,
            next_token_prob=next_prob,
            cached_tokens=cached,
            compute_ns=time.perf_counter_ns() - t0,
        )
