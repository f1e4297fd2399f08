"""What the test modules share, as plain functions and classes: tiny checkpoints of real
architectures, the greedy reference, step events built through the API's schema, the SSE reader,
in-process fakes (a target pool over an engine, the orchestrator's HTTP surface for the dashboard),
the real services started as processes on free ports, and ``wait_until``, the one way a test waits
for a state another thread or process reaches.

Fixtures and pytest hooks live in tests/conftest.py, which covers every folder under tests/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import string
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import httpx
import torch

from evaluation.procs import Service, answered, free_port, wait_grpc
from specdec.errors import InvalidArgument

if TYPE_CHECKING:
    from target_service.verify import TargetEngine

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")


# ---- waiting for a state ------------------------------------------------------------------------

def wait_until(predicate: Callable[[], T], timeout_s: float, what: str | Callable[[], str],
               interval_s: float = 0.01) -> T:
    """Call ``predicate`` until it returns something true, and return that: a state another thread
    or process reaches (a call queued, a metric moved, a service back), never a guess at how long
    it takes. Fails after ``timeout_s`` with ``what``: the state waited for, or a function that
    describes the last one seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what() if callable(what) else what}")
        time.sleep(interval_s)


# ---- tiny checkpoints ---------------------------------------------------------------------------

VOCAB = ["<eos>", "<unk>", " "] + list(string.ascii_lowercase) + list(".,!?'-0123456789")


def tokenizer():
    """One token per character of VOCAB."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def save_checkpoint(model, folder: Path) -> str:
    """Save ``model`` with the tiny tokenizer under ``folder``; return its path."""
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)


def make_gpt2(folder: Path, seed: int, positions: int = 96) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=positions, n_embd=32, n_layer=2, n_head=2,
                        eos_token_id=0, bos_token_id=0)
    return save_checkpoint(GPT2LMHeadModel(config), folder)


def make_llama(folder: Path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                         eos_token_id=0, bos_token_id=0)
    return save_checkpoint(LlamaForCausalLM(config), folder)


# ---- references and canned events --------------------------------------------------------------

# Token ids of a prompt for the tiny models.
PROMPT = [7, 3, 12, 5, 9, 20, 2, 11]

# Prompts for the embedded stack, of the kinds the benchmark suite has.
PROMPTS = [
    "The three primary colors are",
    "Write a haiku about autumn leaves falling in the wind.",
    "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "Q: What is the capital of France?\nA:",
    'Return a JSON object with the fields "name", "age" and "city" for a fictional person:\n',
    "Summarise: The Industrial Revolution began in Britain in the late 18th century. It transformed "
    "manufacturing through mechanisation, steam power and the factory system, and spread to Europe and "
    "North America.\nSummary:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1. Apples\n2. Bananas\n3.",
]


# Tiny random models with the embedded model's byte-level BPE tokenizer: what llama.cpp's converter
# turns into GGUF drafts (specdec.model.gguf_convert) for the native and llamacpp draft backends.
BPE_VOCAB = 49152  # the embedded tokenizer's


def make_bpe_model(folder: Path, arch: str, seed: int = 0, hidden: int = 64) -> Path:
    """A tiny random model of ``arch`` (gpt2, llama, opt) with the embedded tokenizer; ``hidden``
    256 or more gives GGUF's K-quants whole super-blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=BPE_VOCAB, n_positions=256, n_embd=hidden, n_layer=2, n_head=2,
                                           bos_token_id=1, eos_token_id=2))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=BPE_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, bos_token_id=1, eos_token_id=2))
    else:
        model = OPTForCausalLM(OPTConfig(vocab_size=BPE_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=256, word_embed_proj_dim=64,
                                         bos_token_id=1, eos_token_id=2))
    # Sharper logits than the default init, so greedy choices are not near-ties everywhere.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    model.save_pretrained(folder)
    from specdec.models import load_tokenizer

    load_tokenizer("embedded").save_pretrained(folder)
    return folder


def gen(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()



def greedy_reference(model, tokens: list[int], n: int) -> list[int]:
    """Plain greedy decoding without any cache: n tokens after ``tokens`` (independent reference)."""
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(tokens):]


def step_json(draft: list[int], accepted: int, next_token: int, kind: str = "", **fields) -> dict:
    """A `step` event's data as the orchestrator sends it: built through the API's own
    ``orchestrator.schemas.Step`` and dumped to JSON, so a field renamed in the schema breaks the
    tests of every reader (dashboard, benchmarks) that relies on the old name."""
    import json

    from orchestrator.schemas import Step

    kind = kind or ("plain" if not draft else "bonus" if accepted == len(draft) else "correction")
    defaults = {"index": 0, "k": len(draft), "draft_confidences": [0.9] * len(draft),
                "target_probs": [0.8] * len(draft), "next_token_prob": 0.6,
                "tokens": draft[:accepted] + [next_token], "text": "", "draft_ms": 1.0, "verify_ms": 2.0,
                "draft_compute_ms": 0.5, "verify_compute_ms": 1.5, "overhead_ms": 0.1}
    step = Step(**{**defaults, **fields, "draft": draft, "accepted": accepted, "next_token": next_token,
                   "next_kind": kind})
    return json.loads(step.model_dump_json())



def iter_sse(response: httpx.Response):
    """(event, data) pairs of a server-sent event stream, as they arrive."""
    event, data = None, []
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data.append(line.split(":", 1)[1].strip())
        elif not line and data:
            yield event or "message", json.loads("\n".join(data))
            event, data = None, []


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    return list(iter_sse(response))


# ---- in-process fakes ---------------------------------------------------------------------------

class EngineTarget:
    """TargetPool over an in-process TargetEngine, with the service's status codes."""

    service = "target"
    in_flight = 0  # Verifies of the pool in flight (other streams' too), as TargetPool counts them

    def __init__(self, engine: TargetEngine) -> None:
        self.engine, self.released = engine, []
        self.yield_cores: list[bool] = []  # per Verify: whether it asked to leave cores to a draft

    async def verify(self, session_id, tokens, draft, sampling, distributions=(), return_target_probs=True,
                     yield_cores=False, logprobs=None, processed_logprobs=False):
        from orchestrator.clients import Verified

        self.yield_cores.append(yield_cores)
        try:
            v = self.engine.verify(session_id, tokens, draft, sampling, distributions, return_target_probs, yield_cores,
                                   logprobs, processed_logprobs)
        except InvalidArgument as exc:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       str(exc)) from exc
        return Verified(v.num_accepted, v.next_token, v.target_probs, v.next_token_prob, v.cached_tokens,
                        v.compute_ns / 1e6, 1.0, logprobs=v.logprobs)

    async def release(self, session_id: str) -> bool:
        await asyncio.sleep(0.05)  # a Release's round trip, on purpose: its task outlives the generation
        self.released.append(session_id)
        return self.engine.release(session_id)


# ---- the orchestrator's HTTP surface for the dashboard (Streamlit AppTest) ---------------------

APP = str(ROOT / "ui" / "app.py")

TEXTS = {10: " The", 11: " cat", 12: " <b>&", 13: " x", 20: " dog", 21: " ran", 22: " off", 23: " to",
         24: " the", 25: " y", 26: " z", 30: " park", 31: " zoo"}


def step(index: int, k: int, draft: list[int], accepted: int, next_token: int, kind: str,
         tokens: list[int] | None = None) -> dict[str, Any]:
    tokens = tokens if tokens is not None else draft[:accepted] + [next_token]
    return step_json(
        draft, accepted, next_token, kind, index=index, k=k,
        draft_confidences=[0.9 - 0.1 * i for i in range(len(draft))],
        target_probs=[0.8 if i < accepted else 0.05 for i in range(len(draft))], tokens=tokens,
        text="".join(TEXTS[t] for t in tokens), draft_ms=4.0 * len(draft), verify_ms=20.0,
        draft_compute_ms=3.0 * len(draft), verify_compute_ms=18.0, overhead_ms=1.0,
        token_texts=[TEXTS[t] for t in draft], next_token_text=TEXTS[next_token],
    )


SPECULATIVE = [
    step(0, 4, [10, 11, 12, 13], 2, 20, "correction"),  # two accepted, two rejected, a correction
    step(1, 3, [21, 22, 23], 3, 24, "bonus"),  # all accepted, a bonus token
    step(2, 4, [25, 26], 0, 30, "correction"),  # the draft stopped early; nothing accepted
]
IDS = [10, 11, 20, 21, 22, 23, 24, 30]


def stats(tokens: int, iterations: int, drafted: int, accepted: int, tps: float) -> dict[str, Any]:
    return {"tokens": tokens, "iterations": iterations, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_per_iteration": accepted / iterations, "mean_tokens_per_iteration": tokens / iterations,
            "tokens_per_second": tps, "elapsed_ms": 1e3 * tokens / tps, "first_token_ms": 30.0,
            "draft_ms": 36.0, "verify_ms": 60.0, "overhead_ms": 3.0, "draft_compute_ms": 27.0,
            "verify_compute_ms": 54.0, "rpc_overhead_ms": 15.0, "draft_fallbacks": 0}


def done(ids: list[int], mode: str, st: dict[str, Any]) -> dict[str, Any]:
    return {"text": "".join(TEXTS[t] for t in ids), "token_ids": ids, "finish_reason": "length", "prompt_tokens": 5,
            "mode": mode, "controller": "cost", "stats": st}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\r\ndata: {json.dumps(data)}\r\n\r\n".encode()


INFO_MODEL = {"model_id": "/cache/SmolLM2-135M-Instruct", "backend": "transformers", "dtype": "float32",
              "device": "cpu", "vocab_size": 49152, "max_context": 8192, "sessions": 1, "kv_bytes": 2 << 20,
              "tokenizer_fingerprint": "abc"}
DEFAULTS = {"controller": "cost", "k": 4, "max_k": 8, "confidence_threshold": 0.3, "max_tokens": 128,
            "max_tokens_limit": 4096}


class FakeOrchestrator:
    """The orchestrator's HTTP surface with canned answers; ``mode`` picks the behaviour."""

    def reset(self, server_body: dict[str, Any] | None = None) -> FakeOrchestrator:
        """Back to answering normally with nothing recorded (tests share one fake per module)."""
        self.mode = "ok"
        self.requests.clear()
        self.gets.clear()
        self.server_body = server_body
        return self

    def __init__(self) -> None:
        self.mode = "ok"  # ok | not_ready | bad_input | bad_prompt | mid_error | draft_failing | plain_differs
        self.requests: list[dict[str, Any]] = []
        self.gets: list[tuple[str, str]] = []  # (path, authorization header) of every GET
        self.server_body: dict[str, Any] | None = None  # body of /v1/server; None: 404, as an older orchestrator
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.gets.append((self.path, self.headers.get("authorization", "")))
                ready = fake.mode != "not_ready"
                reason = "" if ready else "target service at 127.0.0.1:1 unreachable: UNAVAILABLE"
                if self.path == "/health":
                    self.reply(200, {"status": "ok"})
                elif self.path == "/ready":
                    self.reply(200 if ready else 503, {"ready": ready, "reason": reason, "draft": INFO_MODEL,
                                                       "target": INFO_MODEL if ready else {}})
                elif self.path == "/v1/info":
                    self.reply(200, {"ready": ready, "reason": reason, "draft": INFO_MODEL, "target": INFO_MODEL,
                                     "draft_available": fake.mode != "draft_failing", "defaults": DEFAULTS,
                                     "has_chat_template": True})
                elif self.path == "/v1/server" and fake.server_body is not None:
                    self.reply(200, fake.server_body)
                else:
                    self.reply(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.requests.append(body)
                if fake.mode == "not_ready":
                    return self.reply(503, {"detail": "not ready: target service at 127.0.0.1:1 unreachable"})
                if fake.mode == "bad_input":
                    return self.reply(422, {"detail": [{"type": "less_than_equal", "loc": ["body", "max_tokens"],
                                                        "msg": "Input should be less than or equal to 4096"}]})
                if fake.mode == "bad_prompt":
                    return self.reply(400, {"detail": "prompt: 9000 tokens, over the model's context of 8191"})
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                if body.get("mode") == "autoregressive":
                    ids = [31 if i == 7 and fake.mode == "plain_differs" else t for i, t in enumerate(IDS)]
                    events = [sse("step", step(i, 0, [], 0, t, "plain")) for i, t in enumerate(ids)]
                    events.append(sse("done", done(ids, "autoregressive", stats(8, 8, 0, 0, 20.0))))
                elif fake.mode == "mid_error":
                    events = [sse("step", SPECULATIVE[0]),
                              sse("error", {"status": 503, "detail": "target service: UNAVAILABLE: gone"})]
                else:
                    events = [b": ping\r\n\r\n"] + [sse("step", s) for s in SPECULATIVE]
                    events.append(sse("done", done(IDS, "speculative", stats(8, 3, 9, 5, 40.0))))
                for chunk in events:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeOrchestrator:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def app():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def submit(at, prompt: str, button: str = "generate"):
    at.text_area(key="prompt").input(prompt)
    at.button(key=button).click().run()
    assert not at.exception, at.exception
    return at


def stream_html(at) -> list[str]:
    return [h.value for h in at.html if h.value.startswith("<div class=\"tok-stream\">")]


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def messages(elements) -> str:
    return "\n".join(e.value for e in elements)


# ---- real processes on real ports ---------------------------------------------------------------

# Under pytest-xdist (`make test` runs two workers) every worker starts services of its own on the
# same cores: each computes on one thread, or OpenMP's barriers among more threads than free cores
# would stall a Propose past its deadline and turn speculation off by timing. Their defaults (every
# core) are what the benchmarks and the single-process runs measure.
WORKER_ENV = ({"SPECDEC_TARGET_THREADS": "1", "SPECDEC_DRAFT_THREADS": "1"}
              if os.environ.get("PYTEST_XDIST_WORKER") else {})


class Proc(Service):
    """A service started as ``python -m <module>`` with its log in a file (the benchmark's
    evaluation.procs.Service, on one thread each under pytest-xdist). Every one still running when
    the session ends is killed then (tests/conftest.py's pytest_sessionfinish), whatever failed on
    the way."""

    started: list[Proc] = []

    def __init__(self, name: str, module: str, env: dict[str, str], log_dir: Path) -> None:
        super().__init__(name, module, {**WORKER_ENV, **env}, log_dir)
        Proc.started.append(self)

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)


def wait_http(url: str, proc: Proc, timeout_s: float = 120, status: int = 200) -> None:
    """Wait until ``url`` answers ``status`` (the orchestrator's ``/ready`` also without
    ``degraded``); raises when ``proc`` exits or it times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.check()
        try:
            if answered(httpx.get(url, timeout=2), url, status):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer {status}:\n{proc.tail()}")


def start_model_service(kind: str, log_dir: Path, env: dict[str, str] | None = None, port: int | None = None,
                        name: str = "") -> tuple[Proc, int]:
    """Start ``draft_service`` or ``target_service`` (metrics off) as ``name`` (default: the kind) on
    ``port``, or on a free one: a restart passes the port the service had, to keep its address."""
    port = port or free_port()
    prefix = "SPECDEC_DRAFT_" if kind == "draft" else "SPECDEC_TARGET_"
    proc = Proc(name or kind, f"{kind}_service", {prefix + "PORT": str(port), prefix + "HOST": "127.0.0.1",
                                                  prefix + "METRICS_PORT": str(free_port()), **(env or {})}, log_dir)
    try:
        wait_grpc(port, proc, timeout_s=180)
    except BaseException:
        proc.kill()  # it never reached the caller, who could not stop it
        raise
    return proc, port


def start_orchestrator(draft_port: int, target_port: int, log_dir: Path, env: dict[str, str] | None = None,
                       wait_ready: bool = True) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc("orchestrator", "orchestrator", {
        "SPECDEC_ORCHESTRATOR_PORT": str(port), "SPECDEC_ORCHESTRATOR_HOST": "127.0.0.1",
        "SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS": f"127.0.0.1:{draft_port}",
        "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": f"127.0.0.1:{target_port}",
        "SPECDEC_ORCHESTRATOR_DRAFT_RETRY_S": "1", **(env or {}),
    }, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + ("/ready" if wait_ready else "/health"), proc)
    except BaseException:
        proc.kill()
        raise
    return proc, url


@contextlib.contextmanager
def running_stack(log_dir: Path, orchestrator_env: dict[str, str] | None = None):
    """draft + target + orchestrator on the embedded default (the draft backend auto picks), as real processes;
    stopped (newest first) on exit."""
    procs: list[Proc] = []
    try:
        draft, draft_port = start_model_service("draft", log_dir)
        procs.append(draft)
        target, target_port = start_model_service("target", log_dir)
        procs.append(target)
        orch, url = start_orchestrator(draft_port, target_port, log_dir, orchestrator_env)
        procs.append(orch)
        yield {"url": url, "draft": draft, "target": target, "orchestrator": orch,
               "draft_port": draft_port, "target_port": target_port, "log_dir": log_dir,
               "ports": {"draft": draft_port, "target": target_port}}
    finally:
        for p in reversed(procs):
            p.stop()
