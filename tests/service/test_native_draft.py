"""The native draft backend: GGUF drafts (the embedded Q4_1 file, tiny random models converted by
llama.cpp's own converter) read by specdec.model.gguf_file, built into transformers models by
specdec.model.gguf_model and run on specdec.native's quantised linears; against the gguf package's
reader, transformers' own GGUF loader and the llama.cpp backend on the same file."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from draft_service.backends import native_unavailable, resolve_backend
from draft_service.backends.llamacpp import LlamaCppProposer
from draft_service.backends.native import NativeProposer
from draft_service.settings import DraftSettings
from specdec.engine.sessions import SessionStore
from specdec.model.gguf_convert import ensure_gguf
from specdec.model.gguf_file import GGUFError, GGUFFile
from specdec.model.gguf_model import UnsupportedModel, load_gguf
from specdec.models import embedded_gguf_path, load_tokenizer
from specdec.native import kernels
from tests.support import ROOT, make_bpe_model

# auto takes the native draft where specdec.native's vector kernels run (AVX2 or AVX-512 VNNI)
VECTOR = (k := kernels()) is not None and k.quant_isa("Q4_1") != "baseline"
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was", "1, 2, 3, 4,",
         "Speculative decoding lets a small model", "The weather today"]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, object]:
    """Tiny gpt2 and llama models converted at f16 and q8_0, and the folders they came from."""
    root, cache = tmp_path_factory.mktemp("bpe"), tmp_path_factory.mktemp("gguf-cache")
    out: dict[str, object] = {}
    for arch in ("gpt2", "llama"):
        folder = make_bpe_model(root / arch, arch)
        out[arch] = folder
        for quant in ("f16", "q8_0"):
            out[f"{arch}-{quant}"] = ensure_gguf(str(folder), quant, cache)
    return out


def _fields_of(reader) -> dict[str, object]:
    from gguf.constants import GGUFValueType

    fields = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        values = [f.parts[i] for i in f.data]
        if f.types[-1] == GGUFValueType.STRING:
            values = [bytes(v).decode() for v in values]
        else:
            values = [v.tolist()[0] for v in values]
        fields[name] = values if f.types[0] == GGUFValueType.ARRAY else values[0]
    return fields


@pytest.mark.slow
@pytest.mark.parametrize("which", ["embedded", "gpt2-q8_0", "llama-f16"])
def test_the_reader_reads_what_the_gguf_package_reads(ggufs, which):
    from gguf import GGUFReader

    path = embedded_gguf_path() if which == "embedded" else ggufs[which]
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    want = _fields_of(theirs)
    assert ours.fields.keys() == want.keys()
    for key, value in want.items():
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value, key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
        assert np.array_equal(np.asarray(mine.data).reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all, just bytes" * 4)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(bad)


def _logits(model, text: str) -> torch.Tensor:
    ids = torch.tensor([load_tokenizer("embedded")(text)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_model_is_its_checkpoint_with_the_files_weights(ggufs, arch):
    """specdec.model.gguf_model builds the model the file was converted from: on the f16 file, the
    original checkpoint with its matrices rounded to fp16 (what the converter stores; vectors stay
    fp32) gives the same logits, to the rounding of the norms' epsilon (the file keeps it as fp32)."""
    from transformers import AutoModelForCausalLM

    ours, quant, _ = load_gguf(ggufs[f"{arch}-f16"])
    original = AutoModelForCausalLM.from_pretrained(str(ggufs[arch]), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in original.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    text = TEXTS[0] + " " + TEXTS[4]
    assert torch.allclose(_logits(ours, text), _logits(original, text), rtol=1e-3, atol=2e-3)
    assert not quant  # f16 linears keep their fp32 copy


def test_the_model_is_the_one_transformers_loads_from_the_file(ggufs):
    """On a Q8_0 Llama file, transformers' own ``from_pretrained(gguf_file=...)`` builds the same
    model (both dequantise with the gguf package and un-permute q and k the same way). Its GPT-2
    loader drops the file's context length (a 256-position table becomes 1,024), so GPT-2 is
    checked against its checkpoint above instead."""
    from transformers import AutoModelForCausalLM

    path = ggufs["llama-q8_0"]
    ours, quant, _ = load_gguf(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    text = TEXTS[2] + " " + TEXTS[5]
    assert torch.allclose(_logits(ours, text), _logits(theirs, text), rtol=1e-4, atol=1e-4)
    assert len(quant) == 15  # 7 linears a layer and the lm_head on their Q8_0 blocks


def _drafts(proposer, prompts: list[list[int]], k: int) -> list[list[int]]:
    return [proposer.propose(f"s{i}", p, k).tokens for i, p in enumerate(prompts)]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_native_drafts_like_llamacpp_on_the_same_file(ggufs, arch):
    """On the same Q8_0 file, the native backend proposes what llama.cpp proposes: both quantise x
    to int8 per block and sum in their own orders, so a draft may part at a near-tie; at most 1
    token in 10 may differ, counted from where the two part."""
    k = 8
    path = ggufs[f"{arch}-q8_0"]
    tok = load_tokenizer(str(ggufs[arch]))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    native = NativeProposer(path, SessionStore(8, 1 << 30, 0), k)
    ll = LlamaCppProposer(str(path), 8, 64 << 20, 0, k, threads=1)
    a, b = _drafts(native, prompts, k), _drafts(ll, prompts, k)
    assert all(len(x) == k for x in a + b)
    parted = [next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), k) for x, y in zip(a, b, strict=True)]
    assert sum(k - i for i in parted) <= len(prompts) * k // 10, (a, b)
    info = native.model_info
    assert (info.backend, info.dtype, info.tokenizer_fingerprint) == ("native", "Q8_0", ll.model_info.tokenizer_fingerprint)
    assert native.lm.fast_linears.quantised == (9 if arch == "gpt2" else 15)  # every linear and the lm_head


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_quantised_stack_in_one_call_drafts_what_its_calls_one_by_one_draft(ggufs, arch):
    """On Q8_0 blocks, the decoder stack in one C call (sd_forward_decoder) and the runner's calls
    one by one draft the same tokens with the same confidences, bit for bit."""
    path = ggufs[f"{arch}-q8_0"]
    tok = load_tokenizer(str(ggufs[arch]))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    fused, calls = (NativeProposer(path, SessionStore(8, 1 << 30, 0), 8) for _ in range(2))
    assert fused.lm.runner.stack is not None and fused.lm.runner.quant_k > 0
    calls.lm.runner.fused = False
    for i, p in enumerate(prompts):
        a, b = fused.propose(f"s{i}", p, 8), calls.propose(f"s{i}", p, 8)
        assert a.tokens == b.tokens and a.confidences == b.confidences


def test_embedded_draft_keeps_its_sessions_and_agrees_with_its_fp32_forward():
    """The embedded Q4_1 draft on its blocks: a session's second Propose reuses its cache, and the
    drafted tokens are the greedy choices of the same model's transformers forward on the
    dequantised weights, apart from near-ties the int8 rounding of activations may flip (each
    drafted token within 0.25 logits of the fp32 forward's best)."""
    path = embedded_gguf_path()
    proposer = NativeProposer(path, SessionStore(8, 1 << 30, 0), 16)
    model, _, _ = load_gguf(path)
    tok = load_tokenizer("embedded")
    prompt = tok("The three primary colours are red, yellow and")["input_ids"]
    first = proposer.propose("a", prompt, 8)
    second = proposer.propose("a", prompt + first.tokens[:3], 8)
    assert second.cached_tokens == len(prompt) + 2  # all but the last known token came from the cache
    ids = torch.tensor([prompt + first.tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    greedy = logits.argmax(-1).tolist()
    assert sum(a == b for a, b in zip(greedy, first.tokens, strict=True)) >= 5, (greedy, first.tokens)
    # where they differ, the fp32 forward all but ties the two (gaps of ~0.05 logits are seen)
    gaps = [float(logits[i].max() - logits[i, t]) for i, t in enumerate(first.tokens)]
    assert max(gaps) < 0.25, (greedy, first.tokens, gaps)


def test_auto_takes_native_where_it_applies_and_says_why_not(ggufs):
    settings = DraftSettings(_cli_parse_args=[], backend="auto")
    why = native_unavailable(settings)
    assert (why is None) == VECTOR, why
    assert resolve_backend(settings) == ("native" if VECTOR else "llamacpp")
    f16 = DraftSettings(_cli_parse_args=[], backend="auto", model=str(ggufs["llama-f16"]))
    assert resolve_backend(f16) == "llamacpp"
    assert "a F16 file" in native_unavailable(f16) if VECTOR else "AVX2" in native_unavailable(f16)
    assert resolve_backend(DraftSettings(_cli_parse_args=[], backend="llamacpp")) == "llamacpp"
    gpu = DraftSettings(_cli_parse_args=[], backend="auto", gpu_layers=-1)  # llama.cpp offloads; native is CPU only
    assert resolve_backend(gpu) == "llamacpp" and "GPU" in native_unavailable(gpu)


@pytest.mark.slow
def test_auto_without_vector_kernels_runs_llama_cpp(tmp_path):
    """A CPU without AVX2 (capped here by SPECDEC_NATIVE_ISA) gets the llama.cpp draft; one with
    AVX2 but no VNNI (capped at avx2) gets the native one."""
    script = ("from draft_service.backends import resolve_backend\n"
              "from draft_service.settings import DraftSettings\n"
              "print(resolve_backend(DraftSettings(_cli_parse_args=[], backend='auto')))\n")
    for cap, backend in (("baseline", "llamacpp"), ("avx2", "native")):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "SPECDEC_NATIVE_ISA": cap, "HOME": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == backend, cap


def _falcon_gguf(folder) -> object:
    from gguf import GGUFWriter

    path = folder / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_outside_the_runners_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedModel, match="architecture 'falcon'"):
        load_gguf(_falcon_gguf(tmp_path))


def test_the_native_service_refuses_an_uncovered_model_with_a_clear_exit(tmp_path):
    """Asked for by name, the native backend on a file its runner does not cover stops the service
    with exit code 2 and the reason in its log, not a traceback."""
    from evaluation.procs import Service, free_port

    proc = Service("draft", "draft_service", {"SPECDEC_DRAFT_BACKEND": "native", "SPECDEC_DRAFT_PORT": "0",
                                              "SPECDEC_DRAFT_MODEL": str(_falcon_gguf(tmp_path)),
                                              "SPECDEC_DRAFT_METRICS_PORT": str(free_port())}, tmp_path)
    assert proc.popen.wait(timeout=120) == 2
    log = proc.log.read_text()
    assert "cannot start the draft service" in log and "architecture 'falcon'" in log and "Traceback" not in log, log


@pytest.mark.slow
def test_the_draft_service_bounds_its_openmp_spin_before_choosing_a_backend(tmp_path):
    """``auto`` builds specdec.native (importing torch) before torch's threads are configured; the
    OpenMP spin bound must already be in place then, or the idle draft's threads spin on the cores
    the target's Verify needs (measured: 36-40 ms verifies instead of 25)."""
    from tests.support import start_model_service

    proc, _ = start_model_service("draft", tmp_path)
    try:
        log = proc.log.read_text()
    finally:
        proc.stop()
    assert "GOMP_SPINCOUNT=20000" in log and "torch was imported before configure_torch" not in log, log[-2000:]


@pytest.mark.skipif(not VECTOR, reason="auto takes llama.cpp on a CPU without AVX2 anyway")
def test_auto_falls_back_to_llama_cpp_when_the_native_load_fails(monkeypatch, caplog):
    """A file auto admits (architecture and type) may still hold a tensor the runner has no place
    for; the service then starts on llama.cpp with the reason logged, instead of failing."""
    import draft_service.backends as backends
    from draft_service.backends import create_proposer

    def refuse(settings):
        raise UnsupportedModel("tensor blk.0.attn_q.bias has no place in a llama model")

    monkeypatch.setitem(backends.BACKENDS, "native", refuse)
    proposer = create_proposer(DraftSettings(_cli_parse_args=[], backend="auto"))
    assert isinstance(proposer, LlamaCppProposer)
    assert "attn_q.bias" in caplog.text
    with pytest.raises(ValueError, match="no place"):  # asked for by name, it fails loudly
        create_proposer(DraftSettings(_cli_parse_args=[], backend="native"))
