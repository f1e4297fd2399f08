"""Hugging Face checkpoints converted to GGUF for the llama.cpp draft (specdec.model.gguf_convert): real
conversions of tiny random models that carry the embedded model's byte-level BPE tokenizer, by
llama.cpp's own converter and quantiser, loaded by the real llama.cpp draft backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.errors import NotFound
from specdec.model import gguf_convert
from specdec.model.gguf_convert import ConversionError, draft_gguf, ensure_gguf
from specdec.models import embedded_gguf_path, gguf_tokenizer_fingerprint, load_tokenizer, tokenizer_fingerprint
from tests.support import BPE_VOCAB as VOCAB
from tests.support import ROOT, make_bpe_model


@pytest.fixture(scope="module")
def bpe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bpe")
    return {arch: make_bpe_model(root / arch, arch) for arch in ("gpt2", "llama")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_conversion_keeps_the_tokenizer(bpe_models, cache, arch, quant):
    """The converted file's tokenizer fingerprint equals the Hugging Face tokenizer's: the
    orchestrator accepts the pair (and would refuse it, as for any pair, if they differed)."""
    from gguf import GGUFReader

    out = ensure_gguf(str(bpe_models[arch]), quant, cache)
    assert out.is_file() and out.parent == cache / "gguf" and out.name.endswith(f"-{quant}.gguf")
    fingerprint, vocab, eos = gguf_tokenizer_fingerprint(out)
    assert fingerprint == tokenizer_fingerprint(load_tokenizer(str(bpe_models[arch])))
    assert vocab == VOCAB and eos == [2]
    reader = GGUFReader(str(out))
    arch_field = reader.fields["general.architecture"]
    assert bytes(arch_field.parts[arch_field.data[0]]).decode() == arch
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2 and "norm" not in t.name}
    assert quant.upper() in types


def test_embedded_fingerprints_agree():
    """The shipped GGUF draft and the embedded model's transformers tokenizer (the pair every default
    stack runs) have the same fingerprint."""
    assert gguf_tokenizer_fingerprint(embedded_gguf_path())[0] == tokenizer_fingerprint(load_tokenizer("embedded"))


def _greedy_drafts(proposer, prompts: list[list[int]], k: int) -> list[list[int]]:
    return [proposer.propose(f"s{i}", p, k).tokens for i, p in enumerate(prompts)]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_llamacpp_drafts_like_transformers(bpe_models, cache, arch):
    """The llama.cpp draft on the f16 conversion proposes what the transformers draft proposes on
    the same weights. f16 rounds the weights (and llama.cpp sums in its own order), so a draft may
    part from transformers' at a near-tie: at most 1 token in 10 may differ, counted from the first
    position where the two part (what follows a different token is another continuation)."""
    from draft_service.backends.hf import TransformersProposer
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.engine.sessions import SessionStore
    from specdec.models import load_hf

    k = 8
    tok = load_tokenizer(str(bpe_models[arch]))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was",
             "1, 2, 3, 4,", "Speculative decoding lets a small model", "The weather today"]
    prompts = [tok(t)["input_ids"] for t in texts]
    hf = TransformersProposer(load_hf(str(bpe_models[arch])), SessionStore(8, 1 << 30, 0), k)
    ll = LlamaCppProposer(str(ensure_gguf(str(bpe_models[arch]), "f16", cache)), 8, 64 << 20, 0, k, threads=1)
    a, b = _greedy_drafts(hf, prompts, k), _greedy_drafts(ll, prompts, k)
    assert all(len(x) == k for x in a + b)
    parted = [next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), k) for x, y in zip(a, b, strict=True)]
    differing = sum(k - i for i in parted)
    assert differing <= len(prompts) * k // 10, (a, b)
    assert ll.model_info.tokenizer_fingerprint == hf.model_info.tokenizer_fingerprint


def test_second_start_reuses_the_cache(bpe_models, cache, monkeypatch):
    first = ensure_gguf(str(bpe_models["gpt2"]), "q8_0", cache)
    mtime = first.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert", no_conversion)
    assert ensure_gguf(str(bpe_models["gpt2"]), "q8_0", cache) == first and first.stat().st_mtime_ns == mtime
    # new weights are another source: converted again, to another file
    other = make_bpe_model(cache.parent / "gpt2-other", "gpt2", seed=1)
    with pytest.raises(AssertionError, match="converted again"):
        ensure_gguf(str(other), "q8_0", cache)


@pytest.mark.slow
def test_quantised_types_go_through_llamas_quantiser(bpe_models, cache):
    """q4_0 is not a type the converter writes: f32 first, then llama_model_quantize; the f32
    intermediate does not stay behind, and the time it took is recorded beside the file."""
    from gguf import GGUFReader

    out = ensure_gguf(str(bpe_models["llama"]), "q4_0", cache)
    reader = GGUFReader(str(out))
    assert "Q4_0" in {t.tensor_type.name for t in reader.tensors}
    assert not list(out.parent.glob("*.f32")) and not list(out.parent.glob("*.tmp*"))
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["quant"] == "q4_0" and meta["seconds"] > 0 and meta["bytes"] == out.stat().st_size


def test_unsupported_architecture_gets_a_clear_error(tmp_path):
    model = make_bpe_model(tmp_path / "opt", "opt")
    with pytest.raises(ConversionError, match=r"does not support the architecture OPTForCausalLM.*"
                                              r"SPECDEC_DRAFT_BACKEND=transformers"):
        ensure_gguf(str(model), "f16", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").glob("*.gguf"))


@pytest.mark.parametrize("plant", ["auto_map", "python_file"])
def test_a_folder_with_remote_code_is_refused_not_converted(bpe_models, tmp_path, plant):
    """llama.cpp's converter loads some tokenizers with trust_remote_code=True: a checkpoint that
    carries code is refused before the converter starts, and the code never runs."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(bpe_models["llama"], model)
    ran = tmp_path / "ran"
    (model / "tokenization_evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    if plant == "auto_map":
        (model / "tokenization_evil.py").rename(model / "sub.txt")  # the map alone names the code
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"holds code .* SPECDEC_DRAFT_BACKEND=transformers"):
        ensure_gguf(str(model), "f16", tmp_path / "cache")
    assert not ran.exists() and not list((tmp_path / "cache").rglob("*.gguf"))


def test_two_processes_convert_once(bpe_models, tmp_path):
    """Two services starting together: one converts, the other waits on the lock and takes its file."""
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "specdec.model.gguf_convert", str(bpe_models["llama"]), "--quant", "q8_0"]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1 and Path(paths.pop()).is_file()
    assert len(list((tmp_path / "gguf").glob("*.gguf"))) == 1
    logs = "".join(o[1] for o in outs)
    assert len(re.findall(r": converted \S+ to q8_0 in", logs)) == 1 and "converted by another process" in logs


def test_draft_model_names(bpe_models, cache, tmp_path):
    assert draft_gguf("embedded") == embedded_gguf_path()  # the shipped Q4_1 file, as is
    assert draft_gguf(str(embedded_gguf_path())) == embedded_gguf_path()
    # target: the target model itself at the chosen type
    assert draft_gguf("target", str(bpe_models["gpt2"]), "q8_0", cache) == ensure_gguf(str(bpe_models["gpt2"]), "q8_0", cache)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(NotFound, match="not a .gguf file"):
        draft_gguf(str(not_gguf))
    with pytest.raises(NotFound, match="no config.json"):
        draft_gguf(str(tmp_path))
    with pytest.raises(NotFound, match="no such file or folder: '/no/such/model'"):
        draft_gguf("/no/such/model")
    with pytest.raises(ConversionError, match="unknown quantisation 'q3_x'"):
        draft_gguf(str(bpe_models["gpt2"]), quant="q3_x", cache_dir=cache)
    with pytest.raises(NotFound, match="cannot find model 'no-such-org/no-such-model'"):
        draft_gguf("no-such-org/no-such-model", cache_dir=cache)


def test_missing_converter_says_how_to_install_it(bpe_models, tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_convert.CONVERTER_ENV, str(tmp_path))
    with pytest.raises(ConversionError, match="converter is not installed.*make setup"):
        ensure_gguf(str(bpe_models["gpt2"]), "f16", tmp_path / "cache")


def test_installed_converter_is_the_vendored_one():
    """make setup keeps the converter of the llama.cpp version the draft runs on."""
    folder = gguf_convert.converter_dir()
    version = (ROOT / "scripts" / "install_llamacpp.sh").read_text().split("VERSION=")[1].split()[0]
    assert (folder / "VERSION").read_text().strip() == f"llama-cpp-python-{version}"
    assert gguf_convert.converter_version(folder) == f"llama-cpp-python-{version}"


def test_draft_settings_name_the_target(monkeypatch):
    from draft_service.settings import DraftSettings

    monkeypatch.delenv("SPECDEC_DRAFT_TARGET_MODEL", raising=False)
    monkeypatch.delenv("SPECDEC_TARGET_MODEL", raising=False)
    assert DraftSettings().target_model == "embedded" and DraftSettings().quant == gguf_convert.DEFAULT_QUANT
    monkeypatch.setenv("SPECDEC_TARGET_MODEL", "gpt2")
    assert DraftSettings().target_model == "gpt2"
    monkeypatch.setenv("SPECDEC_DRAFT_TARGET_MODEL", "/models/t")
    assert DraftSettings().target_model == "/models/t"
    with pytest.raises(ValueError, match="quant"):
        DraftSettings(quant="q3_x")


@pytest.mark.slow
@pytest.mark.embedded
def test_self_speculation_stack_keeps_the_output(tmp_path):
    """The whole stack with SPECDEC_DRAFT_MODEL=target: the embedded target's own fp32 weights,
    converted to q8_0 for llama.cpp on the draft's first start, draft for the target; the output
    is plain greedy decoding's, token for token, and most drafted tokens are accepted."""
    import httpx

    from tests.support import start_model_service, start_orchestrator

    procs = []
    try:
        draft, dport = start_model_service("draft", tmp_path, {"SPECDEC_DRAFT_MODEL": "target"})
        procs.append(draft)
        target, tport = start_model_service("target", tmp_path)
        procs.append(target)
        orch, url = start_orchestrator(dport, tport, tmp_path)
        procs.append(orch)
        server = httpx.get(url + "/v1/server", timeout=10).json()
        assert "q8_0.gguf" in json.dumps(server)  # the default type
        proposed = accepted = 0
        for prompt in ("Write a short poem about the sea.", "List three prime numbers and explain why."):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "ignore_eos": True}
            plain = httpx.post(url + "/v1/generate", json={**body, "mode": "autoregressive"}, timeout=120).json()
            spec = httpx.post(url + "/v1/generate", json=body, timeout=120).json()
            assert spec["token_ids"] == plain["token_ids"]
            proposed += spec["stats"]["draft_tokens"]
            accepted += spec["stats"]["accepted_tokens"]
        assert proposed > 0 and accepted / proposed > 0.7
    finally:
        for p in reversed(procs):
            p.stop()



def test_converter_environment_puts_its_own_gguf_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("NO_LOCAL_GGUF", "1")
    env = gguf_convert.converter_environment(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "gguf-py"), "/elsewhere"]
    assert "NO_LOCAL_GGUF" not in env
    monkeypatch.delenv("PYTHONPATH")
    assert gguf_convert.converter_environment(tmp_path)["PYTHONPATH"] == str(tmp_path / "gguf-py")


def test_cache_key_follows_the_files(tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w").write_bytes(b"1")
    first = gguf_convert.folder_digest(src)
    assert gguf_convert.folder_digest(src) == first
    (src / "sub" / "w").write_bytes(b"2")
    assert gguf_convert.folder_digest(src) != first
    path = gguf_convert.cache_path(tmp_path / "cache", src, first, "llama-cpp-python-0.3.36", "q4_0")
    assert path == tmp_path / "cache" / "gguf" / f"model-{first}-llama-cpp-python-0.3.36-q4_0.gguf"


def test_gpt2_configs_without_n_ctx_are_staged(tmp_path):
    """transformers 5 saves GPT-2 without n_ctx, which llama.cpp's converter reads: the converter gets
    a staged copy (links to the files, n_ctx filled from n_positions); other configs go as they are."""
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 512}))
    (src / "model.safetensors").write_bytes(b"w")
    staged = gguf_convert.staged_source(src, tmp_path / "stage")
    assert staged == tmp_path / "stage" and json.loads((staged / "config.json").read_text())["n_ctx"] == 512
    assert (staged / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert "n_ctx" not in json.loads((src / "config.json").read_text())  # the user's folder is untouched
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 512, "n_ctx": 1024}))
    assert gguf_convert.staged_source(src, tmp_path / "stage2") == src
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert gguf_convert.staged_source(src, tmp_path / "stage3") == src
