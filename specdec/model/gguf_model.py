"""A GGUF draft on specdec's own kernels: a transformers model from the file, its linears on the
file's own quantised blocks.

llama.cpp runs the embedded Q4_1 draft at ~7-9 ms a token here, of which only ~2 ms is streaming
its 96 MB of weights; the rest is per-op work, the overhead specdec.model.runner removed from the
target. :func:`load_gguf` reads the file once (specdec.model.gguf_file), builds the transformers model
its metadata describes (Llama or GPT-2 classes, the config transformers' own GGUF loader would
derive) with every tensor dequantised to fp32 by the ``gguf`` package, and returns, beside the
model, each linear layer's raw blocks where they are Q4_1 or Q8_0. The engine packs those for
specdec.native's VNNI kernels (:meth:`specdec.native.Kernels.pack_quant`), so the draft computes
with the same quantised weights llama.cpp would, at ~4-5 ms a token, and the runner does the
rest. Layers of any other GGUF type keep their fp32 copy.

transformers' ``from_pretrained(folder, gguf_file=...)`` builds the same model (a test compares
their logits) but takes ~20 s for the embedded draft here, against ~1.5 s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.errors import SpecdecError
from specdec.model.gguf_file import GGUFFile
from specdec.native import QUANT_FORMATS

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "gpt2")


class UnsupportedModel(SpecdecError, ValueError):
    """The GGUF file holds a model specdec's runner does not cover; the message says what."""

    code = "FAILED_PRECONDITION"

# general.file_type is llama.cpp's LLAMA_FTYPE enum; the common ones by name
FILE_TYPES = {"0": "F32", "1": "F16", "2": "Q4_0", "3": "Q4_1", "7": "Q8_0", "8": "Q5_0", "9": "Q5_1",
              "15": "Q4_K_M", "17": "Q5_K_M", "18": "Q6_K", "32": "BF16"}


def file_type_name(code: str | int) -> str:
    """The name of a GGUF ``general.file_type`` value ("gguf" for one without a name here)."""
    return FILE_TYPES.get(str(code), "gguf")


def file_type(gguf: GGUFFile) -> str:
    """The GGUF file's type by name (Q4_1, Q8_0 ...)."""
    return file_type_name(gguf.field("general.file_type", ""))


def unsupported(gguf: GGUFFile) -> str | None:
    """None when :func:`load_gguf` covers the file, else why not."""
    arch = gguf.field("general.architecture")
    if arch not in ARCHITECTURES:
        return f"GGUF architecture {arch!r} (specdec's kernels cover {', '.join(ARCHITECTURES)})"
    if gguf.field(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        return f"rope scaling {gguf.field(f'{arch}.rope.scaling.type')!r}"
    if "rope_freqs.weight" in gguf.tensors:
        return "per-dimension rope frequencies (rope_freqs.weight, Llama 3.1-style scaling)"
    if arch == "llama" and gguf.field("llama.expert_count", 0):
        return "a mixture of experts"
    return None


def _config(gguf: GGUFFile) -> Any:
    """The transformers config of the file's model (the keys llama.cpp's converter writes)."""
    from transformers import GPT2Config, LlamaConfig

    arch = gguf.field("general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return gguf.field(f"{arch}.{key}", default)

    vocab = len(gguf.field("tokenizer.ggml.tokens", [])) or get("vocab_size")
    special = {name: gguf.field(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos")}
    tied = "output.weight" not in gguf.tensors
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_positions=get("context_length"), n_embd=get("embedding_length"),
                          n_layer=get("block_count"), n_head=get("attention.head_count"),
                          n_inner=get("feed_forward_length"), layer_norm_epsilon=get("attention.layer_norm_epsilon"),
                          bos_token_id=special["bos"], eos_token_id=special["eos"], tie_word_embeddings=tied,
                          architectures=["GPT2LMHeadModel"])
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
                       num_hidden_layers=get("block_count"), num_attention_heads=heads,
                       num_key_value_heads=get("attention.head_count_kv", heads),
                       head_dim=get("attention.key_length", hidden // heads),
                       max_position_embeddings=get("context_length"), rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
                       rope_theta=get("rope.freq_base", 10000.0), bos_token_id=special["bos"],
                       eos_token_id=special["eos"], tie_word_embeddings=tied, architectures=["LlamaForCausalLM"])


def _modules(model: Any, arch: str) -> Iterator[tuple[str, Any]]:
    """(GGUF tensor name, linear module) of every linear layer the file may hold quantised."""
    if arch == "llama":
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            yield from ((f"blk.{i}.attn_q.weight", attn.q_proj), (f"blk.{i}.attn_k.weight", attn.k_proj),
                        (f"blk.{i}.attn_v.weight", attn.v_proj), (f"blk.{i}.attn_output.weight", attn.o_proj),
                        (f"blk.{i}.ffn_gate.weight", mlp.gate_proj), (f"blk.{i}.ffn_up.weight", mlp.up_proj),
                        (f"blk.{i}.ffn_down.weight", mlp.down_proj))
    else:
        for i, block in enumerate(model.transformer.h):
            yield from ((f"blk.{i}.attn_qkv.weight", block.attn.c_attn), (f"blk.{i}.attn_output.weight", block.attn.c_proj),
                        (f"blk.{i}.ffn_up.weight", block.mlp.c_fc), (f"blk.{i}.ffn_down.weight", block.mlp.c_proj))
    yield "output.weight", model.lm_head


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's reordering of a Llama q or k projection's output rows (it
    interleaves each head's two rotary halves; transformers rotates halves), as transformers'
    GGUF loader does for the dequantised weight."""
    per = rows.shape[0] // heads // 2
    return rows.reshape(heads, per, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


FLOAT_TYPES = ("F32", "F16", "BF16")  # tensors the engine computes from an fp32 copy


class QuantRows:
    """A quantised token-embedding table read row by row: the file's blocks (a view of the
    mapped file) and their type; :meth:`lookup` dequantises only the rows a pass embeds, so the
    table costs no fp32 copy (49152 x 576 floats, 113 MB, for the embedded model)."""

    def __init__(self, blocks: np.ndarray, qtype: Any, hidden: int) -> None:
        from gguf.quants import dequantize

        self.blocks, self.qtype, self.hidden = blocks, qtype, hidden
        self._dequantize = dequantize  # once, not on every step's lookup

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._dequantize(self.blocks[ids.numpy()], self.qtype).reshape(-1, self.hidden)
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))


def _check_types(gguf: GGUFFile, linear_names: dict[str, Any], tied: bool) -> None:
    """UnsupportedModel naming the first linear (or tied embedding) whose type the kernels cannot
    compute, with the types they can."""
    for name, tensor in gguf.tensors.items():
        computed = name in linear_names or (tied and name == "token_embd.weight")
        if computed and tensor.type_name not in QUANT_FORMATS and tensor.type_name not in FLOAT_TYPES:
            raise UnsupportedModel(
                f"{gguf.path.name}: tensor {name} is {tensor.type_name}, which specdec's kernels do not compute "
                f"(they compute {', '.join(QUANT_FORMATS)} and {', '.join(FLOAT_TYPES)}); requantise the file to one "
                "of those, e.g. with llama-quantize")


def _parameter_names(model: Any, arch: str, linear_names: dict[str, Any]) -> dict[str, str]:
    """The model's parameter name of each GGUF tensor name a file of ``arch`` may hold
    (``linear_names``: :func:`_modules`' linears by tensor name)."""
    config = model.config
    parameter_of = {id(m): n for n, m in model.named_modules()}
    names: dict[str, str] = {"token_embd.weight": "model.embed_tokens.weight" if arch == "llama" else "transformer.wte.weight"}
    if arch == "llama":
        names["output_norm.weight"] = "model.norm.weight"
        for i in range(config.num_hidden_layers):
            names[f"blk.{i}.attn_norm.weight"] = f"model.layers.{i}.input_layernorm.weight"
            names[f"blk.{i}.ffn_norm.weight"] = f"model.layers.{i}.post_attention_layernorm.weight"
    else:
        names |= {"position_embd.weight": "transformer.wpe.weight", "output_norm.weight": "transformer.ln_f.weight",
                  "output_norm.bias": "transformer.ln_f.bias"}
        for i in range(config.n_layer):
            for part in ("weight", "bias"):
                names[f"blk.{i}.attn_norm.{part}"] = f"transformer.h.{i}.ln_1.{part}"
                names[f"blk.{i}.ffn_norm.{part}"] = f"transformer.h.{i}.ln_2.{part}"
            names |= {f"blk.{i}.{t}.bias": f"transformer.h.{i}.{m}.bias" for t, m in
                      (("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_up", "mlp.c_fc"),
                       ("ffn_down", "mlp.c_proj"))}
    for name, module in linear_names.items():
        names[name] = parameter_of[id(module)] + ".weight"
    return names


def _state_dict(gguf: GGUFFile, model: Any, arch: str, dequantize_blocks: bool, embedding_rows: bool = False
                ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, np.ndarray]], QuantRows | None]:
    """The model's fp32 state dict from the file, the raw blocks of the quantised linears (types
    of QUANT_FORMATS) by parameter name, and with ``embedding_rows`` the token embeddings as
    :class:`QuantRows` when they are quantised. Those linears (and such embeddings) get an
    unwritten fp32 tensor of their shape unless ``dequantize_blocks`` (the engine packs their
    blocks and frees it: never touched, it costs no memory)."""
    from gguf.quants import dequantize

    config = model.config
    linear_names = {name: module for name, module in _modules(model, arch)}
    names = _parameter_names(model, arch, linear_names)
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    rows: QuantRows | None = None
    for name, tensor in gguf.tensors.items():
        target = names.get(name)
        if target is None:
            raise UnsupportedModel(f"{gguf.path.name}: tensor {name} has no place in a {arch} model")
        raw = tensor.data
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if name.endswith("attn_q.weight") else config.num_key_value_heads
            raw = _unpermute(raw, heads)
        if name in linear_names and tensor.type_name in QUANT_FORMATS:
            blocks[target] = (tensor.type_name, np.ascontiguousarray(raw))
            if not dequantize_blocks and name != "token_embd.weight":
                shape = tuple(reversed(tensor.shape))
                state[target] = torch.empty(shape[::-1] if arch == "gpt2" else shape)
                continue
        if (name == "token_embd.weight" and embedding_rows and not dequantize_blocks
                and tensor.type_name not in FLOAT_TYPES):
            shape = tuple(reversed(tensor.shape))
            rows = QuantRows(raw, tensor.type, shape[1])
            state[target] = torch.empty(shape)
            continue
        values = dequantize(raw, tensor.type).reshape(tuple(reversed(tensor.shape)))
        values = np.ascontiguousarray(values, dtype=np.float32)
        weight = torch.from_numpy(values if values.flags.writeable else values.copy())  # F32: a view of the file
        if arch == "gpt2" and name in linear_names:
            weight = weight.T.contiguous()  # Conv1D keeps [in, out]
        state[target] = weight
    if "lm_head.weight" not in state:  # tied to the token embeddings: the lm_head reads their blocks
        if config.tie_word_embeddings and "token_embd.weight" in gguf.tensors:
            embd = gguf.tensors["token_embd.weight"]
            if embd.type_name in QUANT_FORMATS:
                blocks["lm_head.weight"] = (embd.type_name, np.ascontiguousarray(embd.data))
    return state, blocks, rows


def load_gguf(path: Path, dequantize_blocks: bool = True, strict: bool = False
              ) -> tuple[Any, dict[int, tuple[str, np.ndarray]], GGUFFile]:
    """The causal LM in the GGUF file ``path`` (transformers, fp32, eval mode), its quantised
    linears' raw blocks by ``id(module)`` (``quant`` for specdec.model.linears), and the parsed file.
    ``dequantize_blocks`` False leaves those linears' fp32 weights unwritten (for an engine that
    packs the blocks: transformers' own forward is then meaningless). ``strict`` (a target: the
    weights computed in their own format, never an fp32 copy): every linear must be of a type the
    kernels compute or a float type, and quantised token embeddings stay quantised
    (``model.specdec_embedding``, a :class:`QuantRows`). Raises :class:`UnsupportedModel` when
    :func:`unsupported` names a reason, a tensor has no place in the model, or (``strict``) a
    tensor's type cannot be computed."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    gguf = GGUFFile(path)
    why = unsupported(gguf)
    if why is not None:
        raise UnsupportedModel(f"{path.name}: {why}")
    arch = gguf.field("general.architecture")
    config = _config(gguf)
    with no_init_weights():  # every parameter comes from the file: no random initialisation first
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if strict:
        _check_types(gguf, dict(_modules(model, arch)), config.tie_word_embeddings)
    state, blocks, rows = _state_dict(gguf, model, arch, dequantize_blocks, embedding_rows=strict)
    expected = {n for n, _ in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # the token embeddings, tied below
    missing = sorted(expected - set(state))
    if missing:
        raise UnsupportedModel(f"{path.name}: no tensor for {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.specdec_embedding = rows
    modules = dict(model.named_modules())
    quant = {id(modules[name.removesuffix(".weight")]): value for name, value in blocks.items()}
    logger.info("%s: %d of its %d linear layers on their GGUF blocks (%s)", path.name, len(quant),
                sum(1 for _ in _modules(model, arch)), ", ".join(sorted({f for f, _ in quant.values()})) or "none")
    return model, quant, gguf
