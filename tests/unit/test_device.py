"""Where tensors live: forward passes, engines and sampling on every device there is.

- Every device-dependent path runs on the CPU and, where torch sees one, on CUDA (the ``cuda``
  params: skipped with a reason without a GPU; ``make test-gpu`` runs them and fails when there is
  none).
- The same paths run on PyTorch's ``meta`` device in the CPU suite. A meta tensor beside a CPU one
  fails as a CUDA tensor beside a CPU one does, and a meta tensor has no value to read, so a mask
  or index created without the KV's device, or a per-token ``.item()`` on the device, fails here
  on any machine. :class:`CrossDevice` counts every copy between devices and stands in for the one
  copy out of meta a pass makes (the kept logits to the host), which meta cannot do.
- The varlen attention path (CUDA's) computes what the per-segment path (the CPU's) computes.
- llama.cpp on a GPU (the build flag, the device it reports), the orchestrator's topology from
  Info.device, and on a GPU the embedded target's speculative greedy output against plain decoding.
"""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import tarfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draft_service.backends.hf import TransformersProposer
from specdec import sampling as sm
from specdec.engine.compute import PENDING
from specdec.engine.executor import HOST, Executor, ForwardRequest
from specdec.engine.sessions import SessionStore
from specdec.errors import NotFound
from specdec.model.ragged import SEGMENTS, VARLEN, RaggedBatch, Segment, SessionKV, attention_path, kv_geometry
from specdec.models import LoadedModel, load_hf, load_tokenizer
from target_service.verify import TargetEngine
from tests.support import ROOT, VOCAB

HAS_CUDA = torch.cuda.is_available()
CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (make test-gpu runs these on a GPU)")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, CUDA_ONLY])]
ARCHS = ["llama", "gpt2"]
IDS = [3, 17, 5, 22, 9, 31, 4, 12, 28, 7, 19, 2, 25, 11, 6, 33, 14, 8, 21, 10, 27, 13, 30, 16, 24]


class CrossDevice(TorchDispatchMode):
    """Records every copy of a tensor to another device, as (from, to, shape); a copy out of meta
    (which holds no data) returns ``arange`` values on the destination instead, so the code after
    it runs on real numbers: as logits, every row's argmax is the last id."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        device = kwargs.get("device")
        if src is not None and device is not None and torch.device(device) != src.device:
            self.copies.append((src.device.type, torch.device(device).type, tuple(src.shape)))
            if src.device.type == "meta":
                return torch.arange(src.numel(), dtype=kwargs.get("dtype") or src.dtype).reshape(src.shape).to(device)
        if func is torch.ops.aten.copy_.default and args[0].device != args[1].device:
            self.copies.append((args[1].device.type, args[0].device.type, tuple(args[1].shape)))
        return func(*args, **kwargs)


def meta_loaded(path: str) -> LoadedModel:
    """The model at ``path`` built on the meta device (no weights), with its real tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return LoadedModel(model.eval(), load_tokenizer(path), path, path, 0.0)


def device_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding with the model's own forward on its device, no cache: the n tokens
    after ``ids`` and the logits [n, V] (on the host) each was chosen from."""
    seq, rows = list(ids), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq], device=model.device)).logits[0, -1].float().cpu()
            rows.append(logits)
            seq.append(int(logits.argmax()))
    return seq[len(ids):], torch.stack(rows)


# ---- placement on meta: what a GPU would fail on, caught on any machine -----------------------------


def test_the_attention_path_follows_the_device():
    assert attention_path(torch.device("cuda")) == attention_path(torch.device("cuda:1")) == VARLEN
    assert attention_path(torch.device("cpu")) == attention_path(torch.device("meta")) == SEGMENTS


def test_a_bad_attention_path_or_packing_is_refused(tiny_models):
    model = load_hf(tiny_models["gpt2-target"]).model
    with pytest.raises(ValueError, match="attention must be one of"):
        Executor(model, SessionStore(2, 1 << 20, 0), attention="flash")
    kv = SessionKV(*kv_geometry(model), torch.float32, torch.device("cpu"))
    kv.ensure(8, 8)
    with pytest.raises(ValueError, match="attention path must be one of"):
        RaggedBatch([Segment(kv, 0, 2, 0)], "flash")
    with pytest.raises(ValueError, match="packed in order"):
        RaggedBatch([Segment(kv, 0, 2, 1)], VARLEN)


@pytest.mark.parametrize("attention", [SEGMENTS, VARLEN])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_forward_runs_on_meta_and_copies_only_the_kept_logits_to_the_host(tiny_models, arch, attention):
    """Start-up (the 2-row warm-up), a batch of prefills, verify-sized passes over a cache and a
    prefill chunk without logits, with model, inputs and KV on meta. Before the masks took the KV's
    device, constructing the model failed in its warm-up ("Tensor on device cpu is not on the
    expected device meta!" from the per-segment mask in ragged_attention), as it did on CUDA."""
    loaded = meta_loaded(tiny_models[f"{arch}-target"])
    vocab = loaded.model.config.vocab_size
    with CrossDevice() as moves:
        lm = Executor(loaded.model, SessionStore(8, 1 << 30, 0), attention=attention)
        assert lm.runner is None and lm.attention == attention
        assert moves.copies == [("meta", "cpu", (1, vocab))]  # the warm-up's logits
        plans = [
            [ForwardRequest(lm.session("a"), IDS[:9], 3), ForwardRequest(lm.session("b"), IDS[:2], 1),
             ForwardRequest(lm.session("c"), IDS[:12], 0)],
            [ForwardRequest(lm.session("a"), IDS[:14], 5), ForwardRequest(lm.session("b"), IDS[:3], 1),
             ForwardRequest(lm.session("c"), IDS[:20], 2)],
        ]
        for requests in plans:
            moves.copies.clear()
            results = lm.forward_batch(requests)
            kept = sum(r.logits for r in requests)
            assert moves.copies == [("meta", "cpu", (kept, vocab))]  # one copy per pass, of the kept rows only
            for request, result in zip(requests, results, strict=True):
                assert not isinstance(result, BaseException), result
                if request.logits:
                    assert result.logits.device == HOST and result.logits.shape == (request.logits, vocab)
                    assert result.logits.dtype == torch.float32
                else:
                    assert result.logits is None
                assert request.session.cache.kv.device.type == "meta"
                assert request.session.cache.length == len(request.tokens)


def test_runner_masks_live_on_the_kv_device(tiny_models):
    """specdec's own runner (CPU only: packed oneDNN weights) builds its causal masks beside the
    keys: on meta KV they are meta, and attention over them runs there. Before, they were CPU
    tensors whatever the keys' device (the assertion on the masks' device failed)."""
    lm = Executor(load_hf(tiny_models["llama-target"]).model, SessionStore(2, 1 << 30, 0))
    runner = lm.runner
    assert runner is not None
    kvs = [SessionKV(*lm.geometry, torch.float32, torch.device("meta")) for _ in range(3)]
    for kv in kvs:
        kv.ensure(16, 16)
    segments = [Segment(kvs[0], 4, 3, 0), Segment(kvs[1], 0, 1, 3), Segment(kvs[2], 2, 2, 4)]
    masks = runner._masks(segments)
    assert masks[1] is None and all(m.device.type == "meta" for m in (masks[0], masks[2]))
    t, d = 6, runner.head_dim
    q = torch.empty(t, runner.heads, d, device="meta")
    k, v = torch.empty(t, runner.kv_heads, d, device="meta"), torch.empty(t, runner.kv_heads, d, device="meta")
    out = torch.empty(t, runner.heads * d, device="meta")
    runner._attend(0, q, k, v, segments, masks, out)


@pytest.mark.parametrize("arch", ARCHS)
def test_engines_verify_and_draft_on_meta_with_one_host_copy_per_pass(tiny_models, arch):
    """The target's Verify (greedy and lossless sampling with the draft's distributions) and the
    transformers draft's Propose, with the models on meta: sampling, its seeded CPU draws and every
    per-token read run on the host copy of a pass's logits. Each pass copies once (a per-token
    ``.item()`` on the device would fail on meta, and before the host copy the CPU generator met the
    device's probabilities)."""
    target, draft = meta_loaded(tiny_models[f"{arch}-target"]), meta_loaded(tiny_models[f"{arch}-draft"])
    vocab = target.model.config.vocab_size
    last = vocab - 1  # the argmax of every row the stand-in copy returns
    with CrossDevice() as moves:
        engine = TargetEngine(target, SessionStore(8, 1 << 30, 0), max_draft_tokens=8)
        proposer = TransformersProposer(draft, SessionStore(8, 1 << 30, 0), 8)
        assert engine.info().device == proposer.info().device == "meta"

        moves.copies.clear()
        v = engine.verify("g", IDS[:10], [last, last, 5], return_target_probs=True)
        assert (v.num_accepted, v.next_token) == (2, last)
        assert v.target_probs[0] == pytest.approx(float(torch.softmax(torch.arange(float(vocab)), 0)[-1]))
        assert moves.copies == [("meta", "cpu", (4, vocab))]

        moves.copies.clear()
        seeded = sm.Sampling(temperature=0.8, top_k=5, seed=11)
        q = [(list(range(vocab)), [1.0 / vocab] * vocab)] * 2
        first = engine.verify("s1", IDS[:10], [last, 3], seeded, q)
        again = engine.verify("s2", IDS[:10], [last, 3], seeded, q)
        # the last id is the target's likeliest (accepted: p > q), 3 is outside its top 5 (p = 0:
        # rejected), and the correction comes from the residual, inside the top 5
        assert first.num_accepted == again.num_accepted == 1
        assert first.next_token == again.next_token and first.next_token >= vocab - 5
        assert moves.copies == [("meta", "cpu", (3, vocab))] * 2

        moves.copies.clear()
        p = proposer.propose("d", IDS[:10], 3)
        assert p.tokens == [last] * 3 and len(moves.copies) == 3  # one pass per draft token
        p = proposer.propose("d2", IDS[:10], 2, sampling=seeded, return_distributions=True)
        assert len(p.distributions) == 2 and all(len(ids) == 5 for ids, _ in p.distributions)  # top_k support


def test_the_sampling_transform_creates_nothing_off_the_logits_device():
    """Temperature, top-k and top-p on meta logits: every intermediate stays on their device (a
    CPU tensor among them would fail), so the transform runs wherever the logits are."""
    logits = torch.empty(3, len(VOCAB), device="meta")
    for sampling in (sm.Sampling(), sm.Sampling(temperature=0.7, top_k=5, top_p=0.9)):
        probs = sm.probabilities(logits, sampling)
        assert probs.device.type == "meta" and probs.shape == logits.shape


# ---- the same paths on every device present --------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_pass_brings_its_logits_to_the_host_in_one_copy(tiny_models, device):
    """The kept rows of every request in a pass come back as slices of one host tensor; the KV
    stays on the device."""
    lm = Executor(load_hf(tiny_models["llama-target"], device=device).model, SessionStore(8, 1 << 30, 0))
    assert lm.attention == attention_path(torch.device(device))
    requests = [ForwardRequest(lm.session("a"), IDS[:9], 3), ForwardRequest(lm.session("b"), IDS[:4], 1),
                ForwardRequest(lm.session("c"), IDS[:6], 2)]
    results = lm.forward_batch(requests)
    assert {r.logits.device for r in results} == {HOST}
    assert len({r.logits.untyped_storage().data_ptr() for r in results}) == 1
    assert all(r.session.cache.kv.device.type == device for r in requests)


def _passes(lm: Executor) -> list[list[torch.Tensor | None]]:
    """Logits of a sequence of batched passes over three sessions at different cached lengths:
    prefills, verify-sized passes, single rows, a prefill chunk without logits, a rollback."""
    plans = [
        [("a", IDS[:11], 3), ("b", IDS[:2], 1), ("c", IDS[:7], 0)],
        [("a", IDS[:15], 5), ("b", IDS[:3], 1), ("c", IDS[:16], 2)],
        [("a", IDS[:16], 1), ("b", IDS[:9], 7), ("c", IDS[:12], 4)],  # c rolls back to 11 cached
    ]
    return [[r.logits for r in lm.forward_batch([ForwardRequest(lm.session(s), tokens, want)
                                                 for s, tokens, want in plan])] for plan in plans]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_attention_matches_per_segment_attention(tiny_models, arch, device):
    """One attention call over every segment's rows (CUDA's path) against one per segment (the
    CPU's): the same logits within fp32 rounding, the same argmax tokens, the same keys and values
    written into each session's buffer."""
    model = load_hf(tiny_models[f"{arch}-target"], device=device).model
    by_segment = Executor(model, SessionStore(8, 1 << 30, 0), use_runner=False, attention=SEGMENTS)
    varlen = Executor(model, SessionStore(8, 1 << 30, 0), use_runner=False, attention=VARLEN)
    for mine, theirs in zip(_passes(by_segment), _passes(varlen), strict=True):
        for a, b in zip(mine, theirs, strict=True):
            if a is None:
                assert b is None
                continue
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    for name in "abc":
        x, y = by_segment.session(name).cache, varlen.session(name).cache
        assert x.length == y.length
        assert torch.allclose(x.kv[:, :, :, : x.length], y.kv[:, :, :, : y.length], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_engines_verify_and_draft_on_every_device(tiny_models, device):
    """Greedy Verify (bonus, correction, the target's probabilities of the draft), seeded sampling
    Verify and the transformers draft's Propose on ``device``, against the model's own forward
    there."""
    path = tiny_models["llama-target"]
    ref, logits = device_greedy(load_hf(path, device=device).model, IDS[:8], 5)
    engine = TargetEngine(load_hf(path, device=device), SessionStore(8, 1 << 30, 0), max_draft_tokens=8)
    assert engine.info().device.startswith(device)
    v = engine.verify("plain", IDS[:8])
    assert (v.num_accepted, v.next_token) == (0, ref[0])
    wrong = (ref[3] + 1) % len(VOCAB)
    v = engine.verify("g", IDS[:8], ref[:3] + [wrong], return_target_probs=True)
    assert (v.num_accepted, v.next_token) == (3, ref[3])
    expected = torch.softmax(logits[:4], -1)[torch.arange(4), torch.tensor(ref[:3] + [wrong])]
    assert torch.allclose(torch.tensor(v.target_probs), expected, atol=1e-4)

    seeded = sm.Sampling(temperature=0.9, top_p=0.95, seed=5)
    vocab = engine.info().vocab_size
    q = [(list(range(vocab)), [1.0 / vocab] * vocab)] * 3
    outcomes = {(r.num_accepted, r.next_token) for r in
                (engine.verify(f"s{i}", IDS[:8], ref[:3], seeded, q) for i in range(2))}
    assert len(outcomes) == 1  # seeded: the same on a retry

    draft_path = tiny_models["llama-draft"]
    draft_ref, _ = device_greedy(load_hf(draft_path, device=device).model, IDS[:8], 4)
    proposer = TransformersProposer(load_hf(draft_path, device=device), SessionStore(8, 1 << 30, 0), 8)
    assert proposer.propose("d", IDS[:8], 4).tokens == draft_ref
    p = proposer.propose("ds", IDS[:8], 3, sampling=seeded, return_distributions=True)
    for token, (ids, probs) in zip(p.tokens, p.distributions, strict=True):
        assert token in ids and math.isclose(sum(probs), 1.0, rel_tol=1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error where torch sees no GPU")
def test_a_cuda_device_torch_cannot_see_is_refused_in_words(tiny_models):
    with pytest.raises(NotFound, match="sees no CUDA device"):
        load_hf(tiny_models["gpt2-target"], device="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="checks the failure where torch sees no GPU")
def test_make_test_gpu_fails_where_there_is_no_gpu():
    """``--require-cuda`` (make test-gpu) stops the run before any test, rather than passing by
    skipping every cuda test."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--require-cuda", "-m", "cuda", "--collect-only", "-q",
                           "tests/unit/test_device.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "no CUDA device" in done.stdout + done.stderr


# ---- llama.cpp on a GPU ----------------------------------------------------------------------------


@pytest.mark.embedded
def test_the_llamacpp_draft_reports_where_it_computes(monkeypatch, caplog):
    """``gpu_layers`` reaches llama.cpp as n_gpu_layers only where the build can offload; Info's
    device says where the draft computes."""
    import llama_cpp
    from llama_cpp import _internals

    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.models import embedded_gguf_path

    built = llama_cpp.llama_supports_gpu_offload()
    asked = []
    model = _internals.LlamaModel

    def spy(*args, params, **kwargs):
        asked.append(params.n_gpu_layers)
        return model(*args, params=params, **kwargs)

    monkeypatch.setattr(_internals, "LlamaModel", spy)

    def draft(gpu_layers: int) -> str:
        return LlamaCppProposer(str(embedded_gguf_path()), 2, 32 << 20, 0, 4, gpu_layers=gpu_layers).info().device

    assert draft(0) == "cpu" and asked[-1] == 0
    assert draft(-1) == ("cuda" if built else "cpu") and asked[-1] == (-1 if built else 0)
    if not built:
        assert "no GPU backend" in caplog.text
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    assert draft(12) == "cuda" and asked[-1] == 12


@pytest.mark.slow
def test_the_install_script_adds_the_cuda_backend_on_request(tmp_path):
    """scripts/install_llamacpp.sh with SPECDEC_LLAMACPP_CUDA=1 builds with -DGGML_CUDA=on, into a
    wheel cache of its own (a CPU wheel built before is not taken for it). The Python it is given
    is a stand-in that records what the build was asked for."""
    version = "0.3.36"
    cache = tmp_path / "cache"
    wheels = cache / "specdec" / "wheels"
    wheels.mkdir(parents=True)
    with tarfile.open(wheels / f"llama_cpp_python-{version}.tar.gz", "w:gz") as tar:
        for name in ("convert_hf_to_gguf.py", "conversion/x.py", "gguf-py/x.py", "LICENSE"):
            src = tmp_path / "src" / name
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_text("")
            tar.add(src, f"llama_cpp_python-{version}/vendor/llama.cpp/{name}")
    log = tmp_path / "builds.log"
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
# stands in for the Python the script installs into
if [ "$1" = "-" ]; then grep -q write_text && exit 0 || exit 1; fi
if [ "$1" = "-c" ]; then echo "{tmp_path / 'prefix'}"; exit 0; fi
if [ "$3" = "wheel" ]; then
  echo "$CMAKE_BUILD_PARALLEL_LEVEL $CMAKE_ARGS" >> "{log}"
  while [ "$1" != "-w" ]; do shift; done
  mkdir -p "$2" && touch "$2/llama_cpp_python-{version}-py3-none-linux_x86_64.whl"
fi
""")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_CACHE_HOME": str(cache),
           "SPECDEC_LLAMACPP_AVX512": "off"}
    for cuda in ("0", "1"):
        done = subprocess.run(["bash", str(ROOT / "scripts" / "install_llamacpp.sh"), str(python)],
                              env={**env, "SPECDEC_LLAMACPP_CUDA": cuda}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    cpu, gpu = (line.split() for line in log.read_text().splitlines())
    # on every core, without the multimodal library the binding never loads
    assert cpu[0] == gpu[0] == str(os.cpu_count()) and "-DLLAVA_BUILD=OFF" in cpu
    assert "-DGGML_CUDA=on" not in cpu and sorted(gpu) == sorted(cpu + ["-DGGML_CUDA=on"])
    assert len(list(wheels.glob("llama-cpp-python-*/*.whl"))) == 2


# ---- where the orchestrator thinks each service computes ---------------------------------------------


@pytest.mark.parametrize("target_device, draft_device, shared", [
    ("cpu", "cpu", True),  # one host's cores
    ("cuda:0", "cpu", False),  # a GPU target and a CPU draft on one host: no compute shared
    ("cuda:0", "cuda", True),  # llama.cpp offloading to the default GPU, the target's
    ("cuda:1", "cuda", False),
])
async def test_the_orchestrator_reads_the_topology_from_device_and_host(target_device, draft_device, shared):
    from orchestrator.controller_inputs import Load
    from orchestrator.cost_model import CostModel
    from orchestrator.generation import DraftHealth
    from orchestrator.runtime import Runtime, connect
    from orchestrator.settings import OrchestratorSettings
    from specdec.v1 import specdec_pb2 as pb

    class Service:
        def __init__(self, device: str) -> None:
            self.device = device

        async def info(self):
            return pb.InfoResponse(model_id="m", vocab_size=100, tokenizer_fingerprint="f", max_context=100,
                                   max_draft_tokens=8, host_id="host-a", cpu_cores=2.0, device=self.device)

    rt = Runtime(settings=OrchestratorSettings(), draft=Service(draft_device), target=Service(target_device),
                 draft_health=DraftHealth(1.0), costs=CostModel(shared_host_max_streams=1))
    rt.tokenizer, rt.tokenizer_fingerprint = object(), "f"
    await connect(rt)
    assert rt.not_ready == ""
    assert rt.limits.draft_shares_host is shared
    # above shared_host_max_streams: only a shared host turns speculation off
    assert rt.costs.speculation_allowed(Load(streams=4, topology=rt.limits.topology)) is not shared


# ---- on a GPU: the embedded target, speculative against plain ------------------------------------------

# Largest gap between the two tokens' logits (in the target's own plain pass) at which a flip is
# taken for rounding: different row counts sum in different orders in cuBLAS. A wrong mask or KV
# makes the two runs part where one token clearly wins.
NEAR_TIE = {"float32": 0.05, "bfloat16": 1.0}
EQUALITY_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List five tips for writing clean Python code:",
    "My favourite thing to do on a rainy afternoon is",
]


@pytest.mark.embedded
@pytest.mark.cuda
@CUDA_ONLY
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_equals_plain_on_the_gpu(dtype):
    """The embedded target on the GPU: plain decoding (one Verify without a draft per token, one
    session per pass) against speculation (llama.cpp drafts, every prompt verified in one batched
    pass: the varlen path over several segments). Where the two part, the target's own logits
    there must be a near tie (NEAR_TIE); such flips are counted and written to
    artifacts/gpu/equality-<dtype>.json (docs/performance.md, "GPU")."""
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.models import embedded_gguf_path

    loaded = load_hf("embedded", dtype, "cuda")
    engine = TargetEngine(loaded, SessionStore(32, 4 << 30, 0), max_draft_tokens=8)
    assert engine.lm.attention == VARLEN and engine.info().device.startswith("cuda")
    proposer = LlamaCppProposer(str(embedded_gguf_path()), 8, 256 << 20, 0, 8)
    prompts = [loaded.tokenizer(p).input_ids for p in EQUALITY_PROMPTS]
    n_new = 48

    plain = []
    for i, ids in enumerate(prompts):
        seq = list(ids)
        while len(seq) < len(ids) + n_new:
            seq.append(engine.verify(f"plain-{i}", seq).next_token)
        plain.append(seq[len(ids):])

    seqs = [list(ids) for ids in prompts]
    proposed = accepted = passes = 0
    while active := [i for i, ids in enumerate(prompts) if len(seqs[i]) < len(ids) + n_new]:
        drafts = {i: proposer.propose(f"spec-{i}", seqs[i], 6).tokens for i in active}
        jobs = {i: engine.prepare(f"spec-{i}", seqs[i], drafts[i]) for i in active}
        done: dict[int, object] = {}
        while len(done) < len(jobs):  # one batched pass for all (long prompts may take a chunk first)
            waiting = [i for i in jobs if i not in done]
            for i, outcome in zip(waiting, engine.step([jobs[i] for i in waiting]).outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    raise outcome
                if outcome is not PENDING:
                    done[i] = outcome
            passes += 1
        for i in active:
            v = done[i]
            seqs[i] += drafts[i][: v.num_accepted] + [v.next_token]
            proposed, accepted = proposed + len(drafts[i]), accepted + v.num_accepted
    speculative = [seq[len(ids):][:n_new] for seq, ids in zip(seqs, prompts, strict=True)]

    flips, clear = [], []
    for i, (a, b) in enumerate(zip(plain, speculative, strict=True)):
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if at is None:
            continue
        logits, _ = engine.lm.extend(engine.lm.session(f"check-{i}"), prompts[i] + a[:at])
        gap = abs(float(logits[-1, a[at]] - logits[-1, b[at]]))
        (flips if gap <= NEAR_TIE[dtype] else clear).append({"prompt": i, "position": at, "plain": a[at],
                                                             "speculative": b[at], "logit_gap": gap})
    report = {"dtype": dtype, "device": torch.cuda.get_device_name(), "prompts": len(prompts), "tokens": n_new,
              "identical": len(prompts) - len(flips) - len(clear), "near_tie_flips": flips, "clear_divergences": clear,
              "acceptance": accepted / max(proposed, 1), "batched_passes": passes}
    out = ROOT / "artifacts" / "gpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"equality-{dtype}.json").write_text(json.dumps(report, indent=2))
    assert clear == [], report
    assert accepted / proposed > 0.5, report  # speculation really ran: the draft is the target quantised
