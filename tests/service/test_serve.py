"""``python -m specdec serve``: the flags become the services' settings, and the one command
serves the OpenAI API (real processes under honcho, real ports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from specdec.__main__ import environment, parser
from tests.support import ROOT, free_port


def test_flags_become_settings_and_win_over_the_environment():
    args = parser().parse_args(["serve", "gpt2", "--draft", "distilgpt2", "--port", "8080", "--api-key", "a",
                                "--api-key", "b", "--served-model-name", "g", "--num-speculative-tokens", "6",
                                "-q", "q8_0"])
    env = environment(args, {"SPECDEC_ORCHESTRATOR_PORT": "9000", "SPECDEC_TARGET_THREADS": "2"})
    assert env["SPECDEC_TARGET_MODEL"] == "gpt2" and env["SPECDEC_DRAFT_MODEL"] == "distilgpt2"
    assert env["SPECDEC_ORCHESTRATOR_PORT"] == "8080" and env["SPECDEC_ORCHESTRATOR_API_KEYS"] == "a,b"
    assert env["SPECDEC_ORCHESTRATOR_MODEL_NAME"] == "g" and env["SPECDEC_ORCHESTRATOR_DEFAULT_MAX_K"] == "6"
    assert env["SPECDEC_TARGET_QUANT"] == "q8_0" and env["SPECDEC_TARGET_THREADS"] == "2"
    # without --draft: the embedded model drafts for itself, any other from its own quantised copy
    assert environment(parser().parse_args(["serve", "embedded"]), {})["SPECDEC_DRAFT_MODEL"] == "embedded"
    assert environment(parser().parse_args(["serve", "./m"]), {})["SPECDEC_DRAFT_MODEL"] == "target"
    # llama.cpp's spellings
    args = parser().parse_args(["serve", "m", "-md", "d.gguf", "--draft-max", "8"])
    assert args.draft == "d.gguf" and args.max_k == 8
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "m", "--quantization", "q3_x"])


@pytest.mark.slow
@pytest.mark.embedded
def test_serve_serves_the_openai_api(tmp_path):
    port = free_port()
    draft, target = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "SPECDEC_DRAFT_PORT": str(draft), "SPECDEC_TARGET_PORT": str(target),
           "SPECDEC_DRAFT_METRICS_PORT": str(free_port()), "SPECDEC_TARGET_METRICS_PORT": str(free_port()),
           "SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS": f"127.0.0.1:{draft}",
           "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": f"127.0.0.1:{target}"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "embedded", "--port", str(port),
                             "--served-model-name", "local-smol", "--api-key", "sk-test", "--num-speculative-tokens",
                             "6"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError("not ready:\n" + (tmp_path / "serve.log").read_text()[-3000:])
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["local-smol"]
        reply = client.chat.completions.create(model="local-smol", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens >= 1
        info = httpx.get(url + "/v1/info", headers={"Authorization": "Bearer sk-test"}, timeout=10).json()
        assert info["defaults"]["max_k"] == 6
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: honcho stops every process
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
