"""In-process Hugging Face baselines and the mismatch explanation (torch and transformers).

The baselines run the target in this process with no services: plain greedy ``generate``, HF
assisted generation with an assistant model, and HF prompt lookup. All decode a fixed number of
tokens past any EOS (``eos_token_id=[]``, so EOS is not masked the way ``min_new_tokens`` would),
which makes their ids comparable with specdec's ``ignore_eos`` output token for token.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from typing import Any

from evaluation.prompts import Prompt

logger = logging.getLogger(__name__)


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Prompt ids exactly as the orchestrator builds them: chat prompts as one user message through
    the chat template (a plain transcript without one), others as raw text."""
    if not prompt.chat:
        return tokenizer(prompt.text).input_ids
    messages = [{"role": "user", "content": prompt.text}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(f"User: {prompt.text}\nAssistant:").input_ids


def int8_assistant(model: Any) -> Any:
    """A copy of ``model`` with torch dynamic int8 quantisation of every Linear layer."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager quantisation API's deprecation notice
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)


class HFGenerator:
    """Greedy ``generate`` of one target, optionally with an assistant model or prompt lookup."""

    def __init__(self, model: Any, tokenizer: Any, assistant: Any = None, prompt_lookup_tokens: int = 10) -> None:
        self.model, self.tokenizer, self.assistant = model, tokenizer, assistant
        self.prompt_lookup_tokens = prompt_lookup_tokens
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad = pad if pad is not None else 0

    def generate(self, prompt_ids: list[int], max_new_tokens: int, how: str = "plain") -> tuple[list[int], float]:
        """(new token ids, wall ms) of greedy decoding; ``how``: plain, assisted or prompt_lookup."""
        import torch

        extra: dict[str, Any] = {}
        if how == "assisted":
            if self.assistant is None:
                raise ValueError("assisted generation needs an assistant model")
            extra["assistant_model"] = self.assistant
        elif how == "prompt_lookup":
            extra["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        elif how != "plain":
            raise ValueError(f"unknown generation kind {how!r} (plain, assisted or prompt_lookup)")
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      min_new_tokens=0, do_sample=False, eos_token_id=[], pad_token_id=self.pad,
                                      **extra)
            ms = (time.perf_counter() - t0) * 1e3
        return out[0, len(prompt_ids):].tolist(), ms


def explain_mismatch(model: Any, tokenizer: Any, prompt_ids: list[int], reference: list[int],
                     other: list[int]) -> dict[str, Any] | None:
    """Where ``other`` first departs from ``reference`` (both continuations of ``prompt_ids``) and
    how close the target's call was there: one forward over the prompt and the common prefix.

    ``top2_gap`` is the target's logit margin between its two best tokens at that position (a tiny
    gap means numerics, e.g. batched vs single-token kernels, can flip the argmax);
    ``other_gap`` is the margin between the reference token and the other run's token.
    """
    import torch

    from evaluation.client import first_difference

    pos = first_difference(reference, other)
    if pos is None:
        return None
    out: dict[str, Any] = {"position": pos}
    if pos >= len(reference) or pos >= len(other):
        out["note"] = f"lengths differ: {len(reference)} reference tokens, {len(other)} in this run"
        return out
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(prompt_ids) + list(reference[:pos])])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    ref_tok, oth_tok = reference[pos], other[pos]
    out.update({
        "reference_token": ref_tok, "other_token": oth_tok,
        "reference_text": tokenizer.decode([ref_tok]), "other_text": tokenizer.decode([oth_tok]),
        "top1_token": int(top.indices[0]), "top2_token": int(top.indices[1]),
        "top2_gap": float(top.values[0] - top.values[1]),
        "other_gap": float(logits[ref_tok] - logits[oth_tok]),
    })
    return out
