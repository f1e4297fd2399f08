"""The target on a quantised GGUF file: computed in the file's own format, speculative verification
equal to its own plain decoding over hundreds of prompts for every type, the file's type as its
dtype, and a type the kernels cannot compute refused at start-up by name.

The files are tiny Llama and GPT-2 checkpoints converted and quantised by llama.cpp's own tools
(the real path a user's SPECDEC_TARGET_QUANT takes), and the embedded model at Q8_0 and Q4_K_M."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.engine.sessions import SessionStore
from specdec.errors import InvalidArgument, NotFound
from specdec.model.gguf_model import UnsupportedModel
from specdec.models import LoadedModel
from target_service.settings import TargetSettings
from target_service.verify import GGUFModel, TargetEngine, target_gguf
from tests.conftest import GGUF_TARGET_TYPES
from tests.unit.test_exactness import MAX_K, check


def gguf_engine(path, max_draft_tokens: int = MAX_K) -> TargetEngine:
    gguf = GGUFModel.load(path)
    return TargetEngine(LoadedModel(gguf.model, None, str(path), str(path), gguf.load_s), SessionStore(16, 1 << 30, 0),
                        max_draft_tokens=max_draft_tokens, gguf=gguf)


def test_verification_equals_plain_decoding_on_a_quantised_file(tiny_ggufs):
    """The every-type check below on one type, shorter (make test-slow runs every type)."""
    engine = gguf_engine(tiny_ggufs["llama-q8_0"])
    assert engine.lm.fast_linears.quantised == engine.lm.fast_linears.count
    check(engine, prompts=24, n=24, max_prompt=40, seed=13)


@pytest.mark.slow
@pytest.mark.parametrize("quant", GGUF_TARGET_TYPES)
def test_verification_equals_plain_decoding_on_every_type(tiny_ggufs, quant):
    """200 random prompts, drafts of 1-16 tokens spoiled at random places, sessions sharing passes:
    every Verify accepts exactly the agreeing prefix and answers plain decoding's next token."""
    engine = gguf_engine(tiny_ggufs[f"llama-{quant}"])
    info = engine.info()
    assert (info.backend, info.dtype) == ("native", quant.upper())  # the file's type by name
    if quant != "f16":
        assert engine.lm.fast_linears.quantised == engine.lm.fast_linears.count  # no linear left in fp32
    check(engine, prompts=200, n=24, max_prompt=40, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_a_gpt2_file_verifies_exactly_too(tiny_ggufs, quant):
    engine = gguf_engine(tiny_ggufs[f"gpt2-{quant}"])
    check(engine, prompts=100, n=24, max_prompt=40, seed=12)


def test_info_names_the_file_type(tiny_ggufs):
    """(Every other type's name: the every-type check in make test-slow.)"""
    for quant, name in (("q8_0", "Q8_0"), ("f16", "F16")):
        assert gguf_engine(tiny_ggufs[f"llama-{quant}"]).info().dtype == name


def test_quantised_embeddings_stay_quantised(tiny_ggufs):
    """The token embeddings are looked up from the file's blocks, row by row: no fp32 table."""
    engine = gguf_engine(tiny_ggufs["llama-q8_0"])
    rows = engine.lm.runner.embed
    assert type(rows).__name__ == "QuantRows"
    ids = np.array([0, 5, 49151])
    import torch
    from gguf.quants import dequantize

    want = dequantize(rows.blocks[ids], rows.qtype)
    assert torch.equal(rows.lookup(torch.tensor(ids)), torch.from_numpy(want))


def test_a_type_the_kernels_cannot_compute_is_refused_by_name(tiny_ggufs, tmp_path):
    """A file holding a Q2_K linear: the start-up error names the tensor, its type and the types
    the kernels compute (no silent fp32 copy)."""
    import ctypes

    import llama_cpp  # llama.cpp's quantiser, for a type specdec.model.gguf_convert does not offer

    path = tmp_path / "q2_k.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K
    assert llama_cpp.llama_model_quantize(str(tiny_ggufs["llama-f16"]).encode(), str(path).encode(),
                                          ctypes.byref(params)) == 0
    with pytest.raises(UnsupportedModel, match=r"tensor blk\.\d+\.\w+\.weight is Q2_K.*Q8_0.*Q4_K"):
        GGUFModel.load(path)


def test_the_target_setting_takes_a_file_or_a_quantisation(tiny_ggufs, tmp_path):
    path = tiny_ggufs["llama-q8_0"]
    assert target_gguf(str(path), None) == path
    assert target_gguf("embedded", None) is None  # no quant: the checkpoint's own weights
    with pytest.raises(InvalidArgument, match="unset quant"):
        target_gguf(str(path), "q4_0")
    with pytest.raises(NotFound, match="no such GGUF file"):
        target_gguf(str(tmp_path / "missing.gguf"), None)
    engine = TargetEngine.from_settings(TargetSettings(model=str(path), kv_budget_mb=64))
    assert engine.info().dtype == "Q8_0" and engine.info().backend == "native"
    with pytest.raises(InvalidArgument, match="device=cpu"):
        TargetEngine.from_settings(TargetSettings(model=str(path), runner="transformers"))


@pytest.mark.slow
@pytest.mark.embedded
@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_verification_equals_plain_decoding_on_the_embedded_model(quant):
    from specdec.model.gguf_convert import ensure_gguf

    engine = gguf_engine(ensure_gguf("embedded", quant))
    check(engine, prompts=32, n=17, max_prompt=64, seed=13)
