"""Shared fixtures: tiny randomly initialised models of real architectures, saved with
``save_pretrained`` and loaded back through the real ``from_pretrained`` path, plus the embedded
default for end-to-end checks."""

from __future__ import annotations

import socket
import string
from pathlib import Path

import pytest
import torch

VOCAB = ["<eos>", "<unk>", " "] + list(string.ascii_lowercase) + list(".,!?'-0123456789")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return str(folder)


def make_gpt2(folder: Path, seed: int) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=96, n_embd=32, n_layer=2, n_head=2,
                        eos_token_id=0, bos_token_id=0)
    return _save(GPT2LMHeadModel(config), folder)


def make_llama(folder: Path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                         eos_token_id=0, bos_token_id=0)
    return _save(LlamaForCausalLM(config), folder)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Paths of tiny checkpoints: {arch}-target and {arch}-draft (same architecture, other seed)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "gpt2-target": make_gpt2(root / "gpt2-target", 0),
        "gpt2-draft": make_gpt2(root / "gpt2-draft", 1),
        "llama-target": make_llama(root / "llama-target", 0),
        "llama-draft": make_llama(root / "llama-draft", 1),
    }


@pytest.fixture(scope="session")
def embedded_target():
    """The embedded default target (SmolLM2-135M-Instruct, fp32), loaded once."""
    from specdec.models import load_hf

    return load_hf("embedded")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_reference(model, tokens: list[int], n: int) -> list[int]:
    """Plain greedy decoding without any cache: n tokens after ``tokens`` (independent reference)."""
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(tokens):]
