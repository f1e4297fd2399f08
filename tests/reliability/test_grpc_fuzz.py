"""Fuzzing both model services over raw gRPC: random, truncated and mutated protobuf bytes, fields
of the wrong wire type, negative-looking varints, out-of-vocabulary ids, extreme floats, invalid
UTF-8, oversized messages and unknown methods, sent straight to the embedded default services.

Every reply must be a status a client can act on (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
NOT_FOUND, UNIMPLEMENTED, UNAUTHENTICATED), never INTERNAL or UNKNOWN and never a hang; the
process must stay up and serve a normal call afterwards. Cases are generated from a fixed seed, so
a failure replays exactly.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import random
import struct
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.v1 import specdec_pb2 as pb
from tests.reliability.helpers import env_int, service_info, summarize, write_report
from tests.support import start_model_service

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

SEED = 1234
CALLS = env_int("SPECDEC_GRPC_FUZZ_CALLS", 2000)  # per service
CALL_TIMEOUT_S = 60  # far above any legitimate call here: reaching it means a hang
THREADS = 4
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED}
# The fuzz threads Release the same few session ids their Proposes use: a Propose that arrived
# before a Release of its session ends CANCELLED (the Release wins, docs/design.md), the one
# CANCELLED that is proper here.
RELEASED_FIRST = "was released after this call was made"
U32, U64 = (1 << 32) - 1, (1 << 64) - 1

SERVICE = {"draft": "specdec.v1.DraftService", "target": "specdec.v1.TargetService"}
METHODS = {
    "draft": {"Propose": pb.ProposeRequest, "Info": pb.InfoRequest, "Release": pb.ReleaseRequest},
    "target": {"Verify": pb.VerifyRequest, "Info": pb.InfoRequest, "Release": pb.ReleaseRequest},
}
HEALTH = "/grpc.health.v1.Health/Check"


# ---- protobuf wire format, by hand (so that anything can be encoded, including what is invalid) ----

def varint(n: int) -> bytes:
    n &= U64  # a negative int32/int64 is sent as its 10-byte two's complement
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def f_varint(number: int, value: int) -> bytes:
    return tag(number, 0) + varint(value)


def f_bytes(number: int, value: bytes) -> bytes:
    return tag(number, 2) + varint(len(value)) + value


def f_float(number: int, value: float) -> bytes:
    return tag(number, 5) + struct.pack("<f", value)


def f_packed(number: int, values: list[int]) -> bytes:
    return f_bytes(number, b"".join(varint(v) for v in values))


# ---- case generation --------------------------------------------------------------------------------

@dataclass
class Case:
    method: str  # full method path
    kind: str  # which generator made it
    payload: bytes


class Generator:
    """Seeded cases for one service; ``vocab`` and ``max_context`` come from its Info."""

    def __init__(self, service: str, vocab: int, max_context: int, seed: int) -> None:
        self.service, self.vocab, self.max_context = service, vocab, max_context
        self.rng = random.Random(seed)
        self.main = "Propose" if service == "draft" else "Verify"

    def path(self, method: str) -> str:
        return f"/{SERVICE[self.service]}/{method}"

    # values --------------------------------------------------------------------------------------
    def session_id(self) -> str:
        r = self.rng
        return r.choice(["", "s", "fz-" + str(r.randrange(16)), "x" * 128, "x" * 129, "\x00", "\t", " ", "é" * 5,
                         "🙂" * 20, "".join(chr(r.randrange(32, 127)) for _ in range(r.randrange(1, 40)))])

    def token(self) -> int:
        v = self.vocab
        return self.rng.choice([0, 1, 2, v - 1, v, v + 1, U32, self.rng.randrange(v), self.rng.randrange(v)])

    def tokens(self, allow_long: bool = True) -> list[int]:
        r = self.rng
        roll = r.random()
        if roll < 0.1:
            return []
        if roll < 0.15 and allow_long:
            return [1] * (self.max_context + r.choice([0, 1, 50]))
        if roll < 0.6:
            return [r.randrange(self.vocab) for _ in range(r.randrange(1, 40))]
        return [self.token() for _ in range(r.randrange(1, 12))]

    def real(self) -> float:
        return self.rng.choice([0.0, -0.0, 0.3, 0.7, 1.0, 1.0000001, 2.0, -1.0, 1e-40, 1e-45, 1e30, 3.4e38,
                                math.inf, -math.inf, math.nan])

    def sampling(self) -> pb.SamplingParams | None:
        r = self.rng
        if r.random() < 0.3:
            return None
        return pb.SamplingParams(
            temperature=r.choice([0.0, 0.0, 0.7, 1.0, self.real()]), top_p=r.choice([0.0, 0.9, 1.0, self.real()]),
            top_k=r.choice([0, 0, 1, 40, self.vocab - 1, self.vocab, self.vocab + 1, U32]),
            seed=r.choice([0, 1, r.randrange(U64), U64]),
        )

    def distributions(self, n: int) -> list[pb.SparseDistribution]:
        r = self.rng
        out = []
        for _ in range(n):
            size = r.choice([0, 1, 2, 5, 50])
            ids = [self.token() if r.random() < 0.3 else r.randrange(self.vocab) for _ in range(size)]
            probs = [r.choice([1.0 / max(size, 1), r.random(), 0.0, -0.5, 2.0, math.nan, math.inf])
                     for _ in range(size + r.choice([0, 0, 0, -1, 1]))]
            out.append(pb.SparseDistribution(token_ids=ids, probs=[p for p in probs]))
        return out

    # messages ------------------------------------------------------------------------------------
    def typed(self) -> pb.ProposeRequest | pb.VerifyRequest:
        """A well-formed message with hostile values."""
        r = self.rng
        sampling = self.sampling()
        if self.service == "draft":
            msg = pb.ProposeRequest(session_id=self.session_id(), tokens=self.tokens(),
                                    max_draft_tokens=r.choice([0, 1, 2, 4, 8, 32, 33, 256, U32]),
                                    confidence_threshold=r.choice([0.0, 0.3, 1.0, self.real()]),
                                    return_distributions=r.random() < 0.5)
        else:
            draft = [] if r.random() < 0.3 else self.tokens(allow_long=False)[: r.choice([1, 4, 8, 40])]
            n = r.choice([0, len(draft), len(draft), max(len(draft) - 1, 0), len(draft) + 1])
            msg = pb.VerifyRequest(session_id=self.session_id(), tokens=self.tokens(), draft_tokens=draft,
                                   draft_distributions=self.distributions(n) if r.random() < 0.6 else [],
                                   return_target_probs=r.random() < 0.5)
        if sampling is not None:
            msg.sampling.CopyFrom(sampling)
        return msg

    def valid(self) -> bytes:
        if self.service == "draft":
            return pb.ProposeRequest(session_id="fz-valid", tokens=[1, 2, 3, 4], max_draft_tokens=3,
                                     sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, seed=7),
                                     return_distributions=True).SerializeToString()
        return pb.VerifyRequest(session_id="fz-valid", tokens=[1, 2, 3, 4], draft_tokens=[5, 6],
                                sampling=pb.SamplingParams(temperature=0.8, seed=7),
                                draft_distributions=[pb.SparseDistribution(token_ids=[5, 9], probs=[0.5, 0.5]),
                                                     pb.SparseDistribution(token_ids=[6], probs=[1.0])],
                                return_target_probs=True).SerializeToString()

    def mutated(self) -> bytes:
        r = self.rng
        data = bytearray(self.r_choice_serialized())
        for _ in range(r.randrange(1, 5)):
            op = r.randrange(5)
            if op == 0 and data:
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            elif op == 1 and data:
                del data[r.randrange(len(data)):]  # truncate
            elif op == 2:
                i = r.randrange(len(data) + 1)
                data[i:i] = r.randbytes(r.randrange(1, 8))
            elif op == 3 and data:
                i = r.randrange(len(data))
                data[i:i] = data[i: i + r.randrange(1, 16)]
            elif op == 4 and data:
                data[r.randrange(len(data))] = r.choice([0x00, 0x7F, 0x80, 0xFF])
        return bytes(data)

    def r_choice_serialized(self) -> bytes:
        return self.valid() if self.rng.random() < 0.5 else self.typed().SerializeToString()

    def random_wire(self) -> bytes:
        """Random fields: numbers the message has and has not, every wire type (6 and 7 are invalid)."""
        r = self.rng
        out = b""
        for _ in range(r.randrange(1, 8)):
            number = r.choice([1, 2, 3, 4, 5, 6, 1, 2, 15, 16, 2047, (1 << 29) - 1])
            wire = r.choice([0, 1, 2, 5, 0, 2, 3, 4, 6, 7])
            if wire == 0:
                out += tag(number, 0) + varint(r.choice([0, 1, -1, U32, U32 + 1, U64, r.randrange(1 << 40)]))
            elif wire == 1:
                out += tag(number, 1) + r.randbytes(8)
            elif wire == 2:
                body = r.randbytes(r.randrange(0, 30))
                declared = len(body) + r.choice([0, 0, 0, 1, 100, -1 if body else 0])
                out += tag(number, 2) + varint(declared) + body
            elif wire == 5:
                out += tag(number, 5) + r.randbytes(4)
            else:
                out += tag(number, wire) + r.randbytes(r.randrange(0, 4))
        return out

    def semantic(self) -> bytes:
        """Hand-encoded values the typed API cannot express: negative-looking and oversized varints
        for uint32 fields, invalid UTF-8 session ids, known fields with the wrong wire type, NaN bits."""
        r = self.rng
        sid = r.choice([f_bytes(1, b"fz-raw"), f_bytes(1, b"\xff\xfe"), f_bytes(1, b"\xc3"), f_bytes(1, b"\xed\xa0\x80"),
                        f_varint(1, 5), f_float(1, 1.0), b""])
        big = r.choice([-1, -2, U32, U32 + 1, U64, 1 << 35])
        toks = r.choice([f_packed(2, [1, 2, big]), f_varint(2, big) + f_varint(2, 3), f_varint(2, 1) + f_packed(2, [2, 3]),
                         f_float(2, 1.0), f_bytes(2, b"\x80\x80\x80"), f_packed(2, [1, 2, 3])])
        nan_bits = tag(4, 5) + r.choice([b"\x00\x00\xc0\x7f", b"\x01\x00\x80\x7f", b"\x00\x00\x80\xff"])
        if self.service == "draft":
            rest = r.choice([f_varint(3, big), f_varint(3, 2), f_bytes(3, b"x")]) + r.choice([nan_bits, f_float(4, 0.5), b""])
            rest += r.choice([f_bytes(5, f_varint(3, big) + f_varint(4, -1)), f_bytes(5, nan_bits), f_varint(5, 1), b""])
            rest += r.choice([f_varint(6, 2), f_varint(6, U64), b""])
        else:
            rest = r.choice([f_packed(3, [big]), f_packed(3, [4]), f_varint(3, -1), b""])
            rest += r.choice([f_bytes(4, tag(1, 5) + struct.pack("<f", 1e-40) + f_varint(3, big)), f_bytes(4, nan_bits), b""])
            dist = f_bytes(5, f_packed(1, [big]) + f_bytes(2, struct.pack("<ff", 0.5, math.nan)))
            rest += r.choice([dist, dist * 3, f_bytes(5, b"\xff"), b""])
        return sid + toks + rest

    def case(self) -> Case:
        r = self.rng
        roll = r.random()
        if roll < 0.05:
            return Case(HEALTH, "health", r.choice([b"", f_bytes(1, b"nope"), f_bytes(1, b"\xff"), r.randbytes(5)]))
        if roll < 0.15:
            method = r.choice(["Info", "Release"])
            payload = r.choice([b"", f_bytes(1, b"fz-1"), f_bytes(1, b""), r.randbytes(r.randrange(1, 40)), self.random_wire()])
            return Case(self.path(method), method.lower(), payload)
        if roll < 0.25:
            return Case(self.path(self.main), "random-bytes", r.randbytes(r.choice([1, 2, 5, 17, 64, 300, 2000])))
        if roll < 0.4:
            return Case(self.path(self.main), "mutated", self.mutated())
        if roll < 0.5:
            return Case(self.path(self.main), "random-wire", self.random_wire())
        if roll < 0.65:
            return Case(self.path(self.main), "semantic", self.semantic())
        return Case(self.path(self.main), "typed", self.typed().SerializeToString())


# ---- running ----------------------------------------------------------------------------------------

@dataclass
class Results:
    codes: collections.Counter = field(default_factory=collections.Counter)  # (kind, code name)
    by_code: collections.Counter = field(default_factory=collections.Counter)
    violations: list[dict] = field(default_factory=list)
    sessions_seen: set[str] = field(default_factory=set)
    slowest_s: float = 0.0


def call_raw(channel: grpc.Channel, method: str, payload: bytes, metadata: tuple = ()) -> tuple[grpc.StatusCode, str]:
    stub = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        stub(payload, timeout=CALL_TIMEOUT_S, metadata=metadata)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def run_cases(port: int, cases: list[Case], results: Results, metadata: tuple = ()) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
        def one(case: Case) -> None:
            t0 = time.monotonic()
            code, details = call_raw(channel, case.method, case.payload, metadata)
            seconds = time.monotonic() - t0
            results.slowest_s = max(results.slowest_s, seconds)
            results.codes[(case.kind, code.name)] += 1
            results.by_code[code.name] += 1
            if code not in ALLOWED and not (code == grpc.StatusCode.CANCELLED and RELEASED_FIRST in details):
                results.violations.append({"method": case.method, "kind": case.kind, "code": code.name,
                                           "details": details[:200], "payload_hex": case.payload[:96].hex(),
                                           "payload_len": len(case.payload), "seconds": round(seconds, 2)})
            for message in (pb.ProposeRequest, pb.VerifyRequest, pb.ReleaseRequest):
                try:
                    parsed = message.FromString(case.payload)
                except Exception:  # noqa: BLE001 - not parseable as this message: no session to clean up
                    continue
                if parsed.session_id:
                    results.sessions_seen.add(parsed.session_id)

        with cf.ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, cases))


def release_all(kind: str, port: int, session_ids: set[str], metadata: tuple = ()) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for sid in session_ids:
            call_raw(channel, f"/{SERVICE[kind]}/Release", pb.ReleaseRequest(session_id=sid).SerializeToString(), metadata)


def assert_still_serving(kind: str, port: int, proc, metadata: tuple = ()) -> None:
    assert proc.alive(), f"{kind} service died:\n{proc.tail()}"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        if kind == "draft":
            request = pb.ProposeRequest(session_id="after-fuzz", tokens=[504, 1296, 3003], max_draft_tokens=3)
            method = "/specdec.v1.DraftService/Propose"
            response_type = pb.ProposeResponse
        else:
            request = pb.VerifyRequest(session_id="after-fuzz", tokens=[504, 1296, 3003], draft_tokens=[260])
            method = "/specdec.v1.TargetService/Verify"
            response_type = pb.VerifyResponse
        stub = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=response_type.FromString)
        response = stub(request, timeout=30, metadata=metadata)
        assert response.compute_ns > 0
        health = channel.unary_unary(HEALTH, request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert health(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        release = channel.unary_unary(f"/{SERVICE[kind]}/Release", request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=pb.ReleaseResponse.FromString)
        release(pb.ReleaseRequest(session_id="after-fuzz"), timeout=10, metadata=metadata)


def _violations_text(results: Results) -> str:
    kinds = collections.Counter((v["kind"], v["code"], v["details"][:60]) for v in results.violations)
    lines = [f"{n} x {kind} -> {code}: {details}" for (kind, code, details), n in kinds.most_common(12)]
    return "\n".join(lines + [f"example: {v}" for v in results.violations[:3]])


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_fuzzed_messages_get_proper_status_codes(embedded_stack, kind):
    port, proc = embedded_stack[f"{kind}_port"], embedded_stack[kind]
    info = service_info(kind, port)
    sessions_before = info.sessions
    gen = Generator(kind, info.vocab_size, info.max_context, SEED + (kind == "target"))
    cases = [gen.case() for _ in range(CALLS)]
    results = Results()
    t0 = time.monotonic()
    run_cases(port, cases, results)
    seconds = time.monotonic() - t0
    release_all(kind, port, results.sessions_seen)
    sessions_after = service_info(kind, port).sessions
    data = {"service": kind, "calls": len(cases), "seed": SEED, "seconds": round(seconds, 1),
            "codes": dict(sorted(results.by_code.items())),
            "codes_by_kind": {f"{k} {c}": n for (k, c), n in sorted(results.codes.items())},
            "violations": len(results.violations), "violation_examples": results.violations[:20],
            "slowest_call_s": round(results.slowest_s, 2), "sessions_before": sessions_before,
            "sessions_after_release": sessions_after}
    write_report(f"grpc_fuzz_{kind}", data)
    summarize(f"gRPC fuzz ({kind})", [
        f"calls {len(cases)} in {seconds:.0f} s (seed {SEED}); codes {dict(sorted(results.by_code.items()))}",
        f"improper codes (INTERNAL/UNKNOWN/...) {len(results.violations)}; slowest call {results.slowest_s:.1f} s; "
        f"process alive {proc.alive()}; sessions before {sessions_before}, after releasing {sessions_after}",
    ])
    assert_still_serving(kind, port, proc)
    assert not results.violations, _violations_text(results)
    assert sessions_after <= sessions_before, "sessions of rejected or released calls are still held"


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_oversized_and_huge_messages(embedded_stack, kind):
    """Over the server's message limit: RESOURCE_EXHAUSTED before parsing; huge but under it:
    INVALID_ARGUMENT (over the context or the draft maximum), never INTERNAL and never a crash."""
    port, proc = embedded_stack[f"{kind}_port"], embedded_stack[kind]
    info = service_info(kind, port)
    main = f"/{SERVICE[kind]}/{'Propose' if kind == 'draft' else 'Verify'}"
    over_limit = f_bytes(1, b"big") + f_bytes(2, b"\x01" * (65 * 1024 * 1024))  # above any limit a service sets
    huge = [
        ("tokens x 200k", f_bytes(1, b"fz-huge") + f_packed(2, [1] * 200_000) + f_varint(3, 2)),
        ("tokens over context", f_bytes(1, b"fz-huge") + f_packed(2, [1] * (info.max_context + 1)) + f_varint(3, 2)),
        ("ids out of vocabulary x 50k", f_bytes(1, b"fz-huge") + f_packed(2, [info.vocab_size + 7] * 50_000) + f_varint(3, 2)),
    ]
    if kind == "target":
        dist = f_bytes(5, f_packed(1, list(range(info.vocab_size))) + f_bytes(2, struct.pack("<f", 1.0 / info.vocab_size)
                                                                           * info.vocab_size))
        huge += [
            ("draft_tokens x 100k", f_bytes(1, b"fz-huge") + f_packed(2, [1, 2]) + f_packed(3, [5] * 100_000)),
            ("full-vocabulary distributions x 40", f_bytes(1, b"fz-huge") + f_packed(2, [1, 2]) + f_packed(3, [5] * 40)
             + f_bytes(4, f_float(1, 1.0)) + dist * 40),
            ("distributions x 100k", f_bytes(1, b"fz-huge") + f_packed(2, [1, 2]) + f_packed(3, [5])
             + f_bytes(4, f_float(1, 1.0)) + f_bytes(5, f_packed(1, [5]) + f_bytes(2, struct.pack("<f", 1.0))) * 100_000),
        ]
    results = []
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
        code, details = call_raw(channel, main, over_limit)
        results.append(("over the message limit (65 MiB)", len(over_limit), code, details))
        for name, payload in huge:
            code, details = call_raw(channel, main, payload)
            results.append((name, len(payload), code, details))
    summarize(f"gRPC oversized ({kind})", [f"{name} ({size} B): {code.name}" for name, size, code, _ in results])
    assert_still_serving(kind, port, proc)
    assert results[0][2] == grpc.StatusCode.RESOURCE_EXHAUSTED, results[0]
    bad = [r for r in results if r[2] not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)]
    assert not bad, bad


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_unknown_methods_and_reflection(embedded_stack, kind):
    port, proc = embedded_stack[f"{kind}_port"], embedded_stack[kind]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in (f"/{SERVICE[kind]}/Nope", "/specdec.v1.Nope/Verify", "/specdec.v2.TargetService/Verify", "/x/y",
                       f"/{SERVICE['target' if kind == 'draft' else 'draft']}/Info"):
            code, _ = call_raw(channel, method, b"")
            assert code == grpc.StatusCode.UNIMPLEMENTED, (method, code)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE[kind]),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="specdec.v1.Nope"),
                    reflection_pb2.ServerReflectionRequest(file_by_filename="nope.proto"),
                    reflection_pb2.ServerReflectionRequest(file_containing_extension=reflection_pb2.ExtensionRequest(
                        containing_type="specdec.v1.VerifyRequest", extension_number=99))]
        responses = list(stub.ServerReflectionInfo(iter(requests), timeout=30))
    assert len(responses) == len(requests)
    names = {s.name for s in responses[0].list_services_response.service}
    assert SERVICE[kind] in names
    assert responses[1].file_descriptor_response.file_descriptor_proto
    for r in responses[2:]:
        assert r.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], r
    assert proc.alive()


def _auth_setting() -> bool:
    from specdec.settings import ModelServiceSettings

    return "auth_token" in ModelServiceSettings.model_fields


def test_fuzz_behind_an_auth_token(tmp_path):
    """With a token configured: calls without it or with a wrong one are UNAUTHENTICATED before any
    parsing; with it, fuzzed calls get the same proper codes."""
    if not _auth_setting():
        pytest.skip("the model services have no auth_token setting")
    token = "rel-grpc-token"
    proc, port = start_model_service("draft", tmp_path, {"SPECDEC_DRAFT_AUTH_TOKEN": token})
    try:
        good = (("authorization", f"Bearer {token}"),)
        info = service_info("draft", port, metadata=good)
        gen = Generator("draft", info.vocab_size, info.max_context, SEED + 7)
        cases = [gen.case() for _ in range(max(CALLS // 6, 50))]
        unauthenticated = Results()
        run_cases(port, cases[:40], unauthenticated)
        run_cases(port, cases[:40], unauthenticated, metadata=(("authorization", "Bearer wrong"),))
        with_token = Results()
        run_cases(port, cases, with_token, metadata=good)
        release_all("draft", port, with_token.sessions_seen, metadata=good)
        summarize("gRPC fuzz behind a token (draft)", [
            f"without or with a wrong token: {dict(unauthenticated.by_code)}",
            f"with the token: {len(cases)} calls, codes {dict(sorted(with_token.by_code.items()))}"])
        # health stays open for probes; everything else needs the token
        health_calls = sum(n for (k, _), n in unauthenticated.codes.items() if k == "health")
        assert unauthenticated.by_code["UNAUTHENTICATED"] == 80 - health_calls, dict(unauthenticated.by_code)
        assert_still_serving("draft", port, proc, metadata=good)
        assert not with_token.violations, _violations_text(with_token)
    finally:
        proc.stop()
