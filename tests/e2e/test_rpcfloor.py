"""The gRPC round-trip floor (evaluation/rpcfloor.py): arguments, then a short real run of echo
servers in their own processes and of a running model service's health check."""

from __future__ import annotations

import json
import math

import pytest

from evaluation.rpcfloor import SERVERS, main, parse_args, render_markdown


def test_defaults_and_errors(capsys):
    args = parse_args([])
    assert args.servers == list(SERVERS) and args.calls == 400 and args.payload_bytes == 1024 and args.service == []
    with pytest.raises(SystemExit):
        parse_args(["--servers", "sync,grpc-go"])
    assert "unknown server(s) grpc-go" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--calls", "0"])


def test_markdown_lists_every_server_and_service():
    result = {"calls": 3, "payload_bytes": 10, "command": "python -m evaluation.rpcfloor",
              "echo": [{"server": "sync", "unary_ms": 0.8, "stream_ms": 0.4},
                       {"server": "aio+handoff", "unary_ms": 0.7, "stream_ms": 0.35}],
              "services": {"127.0.0.1:1": 1.25}}
    text = render_markdown(result)
    assert "| sync | 0.800 | 0.400 |" in text and "| aio+handoff | 0.700 | 0.350 |" in text
    assert "127.0.0.1:1: 1.250 ms" in text


def test_short_run_against_echo_servers_and_a_model_service(tmp_path, embedded_stack):
    out = tmp_path / "floor"
    target = f"127.0.0.1:{embedded_stack['target_port']}"
    result = main(["--servers", "sync,aio+handoff", "--calls", "30", "--warmup", "5", "--payload-bytes", "1500",
                   "--service", target, "--out", str(out)])
    assert [r["server"] for r in result["echo"]] == ["sync", "aio+handoff"]
    for row in result["echo"]:
        # a loopback round trip: above zero, below the time a forward pass takes
        assert 0 < row["unary_ms"] < 50 and 0 < row["stream_ms"] < 50 and math.isfinite(row["unary_ms"])
    assert 0 < result["services"][target] < 50
    saved = json.loads((out / "rpcfloor.json").read_text())
    assert saved["echo"] == result["echo"] and saved["machine"]["cores"] >= 1
    assert (out / "rpcfloor.md").read_text() == render_markdown(result)
