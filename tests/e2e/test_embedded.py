"""The embedded default end to end over gRPC: llama.cpp draft (Q4_1 GGUF) + transformers target
(the same model in fp32). Greedy decoding by repeated Verify with llama.cpp drafts must reproduce
the target's own ``generate(do_sample=False)`` token for token."""

from __future__ import annotations

import grpc
import pytest

from specdec.engine.sessions import SessionStore
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

pytestmark = pytest.mark.embedded

# (prompt, chat?): chat prompts go through the tokenizer's chat template.
PROMPTS = [
    ("Write a short story about a lighthouse keeper who finds a message in a bottle.", True),
    ("List five tips for writing clean Python code, with a one-line example each.", True),
    ("The history of the printing press begins in the fifteenth century, when", False),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
]


@pytest.fixture(scope="module")
def stubs(embedded_target):
    from draft_service.backends.llamacpp import LlamaCppProposer
    from draft_service.servicer import build_server as build_draft
    from specdec.models import embedded_gguf_path
    from target_service.servicer import build_server as build_target
    from target_service.verify import TargetEngine

    proposer = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16)
    engine = TargetEngine(embedded_target, SessionStore(4, 1 << 30, 0))
    servers = [build_draft(proposer, "127.0.0.1:0"), build_target(engine, "127.0.0.1:0")]
    for server, _, _ in servers:
        server.start()
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _, port, _ in servers]
    yield pb_grpc.DraftServiceStub(channels[0]), pb_grpc.TargetServiceStub(channels[1])
    for channel in channels:
        channel.close()
    for server, _, _ in servers:
        server.stop(0)


def test_fingerprints_match(stubs):
    draft, target = stubs
    d, t = draft.Info(pb.InfoRequest()), target.Info(pb.InfoRequest())
    assert d.backend == "llamacpp" and d.dtype == "Q4_1" and t.backend == "native"
    assert d.tokenizer_fingerprint == t.tokenizer_fingerprint
    assert d.vocab_size == t.vocab_size == 49152


@pytest.mark.parametrize("prompt, chat", PROMPTS)
def test_speculative_greedy_equals_generate(stubs, embedded_target, prompt, chat):
    import torch

    draft, target = stubs
    tok, model = embedded_target.tokenizer, embedded_target.model
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=True, return_tensors="pt")["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    n_new = 64
    eos = set(target.Info(pb.InfoRequest()).eos_token_ids)
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False)[0].tolist()
    seq = ids[0].tolist()
    start, proposed, accepted, steps = len(seq), 0, 0, 0
    sid = f"eq-{abs(hash(prompt))}"
    while len(seq) < start + n_new and seq[-1] not in eos:
        p = draft.Propose(pb.ProposeRequest(session_id=sid, tokens=seq, max_draft_tokens=6))
        v = target.Verify(pb.VerifyRequest(session_id=sid, tokens=seq, draft_tokens=p.draft_tokens))
        new = list(p.draft_tokens[: v.num_accepted]) + [v.next_token]
        # stop exactly where generate does: at the first EOS
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        seq += new[:cut]
        proposed, accepted, steps = proposed + len(p.draft_tokens), accepted + v.num_accepted, steps + 1
    assert len(ref) - start >= 32  # the prompts make real continuations
    assert seq[: len(ref)] == ref
    assert steps < n_new  # speculation actually landed several tokens per target pass
    assert accepted / proposed > 0.5
