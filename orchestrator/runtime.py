"""The orchestrator's process-wide state (:class:`Runtime`) and its connection to the model
services: Info read, tokenizer loaded and checked against the target, readiness set, again and
again while the process runs."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from orchestrator.clients import NOT_SERVING
from orchestrator.controller_inputs import Topology, compute_site
from orchestrator.cost_model import CostModel
from orchestrator.generation import DraftHealth, ModelLimits
from orchestrator.replicas import DraftPool, TargetPool
from orchestrator.settings import OrchestratorSettings
from specdec import process

logger = logging.getLogger(__name__)

READY_RECHECK_S = 1.0  # /ready asks the services again at most this often


@dataclass
class Runtime:
    """Process-wide state of the orchestrator."""

    settings: OrchestratorSettings
    draft: DraftPool
    target: TargetPool
    draft_health: DraftHealth
    costs: CostModel = field(default_factory=CostModel)
    tokenizer: Any = None
    limits: ModelLimits | None = None
    target_info: dict[str, Any] = field(default_factory=dict)
    draft_info: dict[str, Any] = field(default_factory=dict)
    not_ready: str = "connecting to the model services"
    # why requests decode without drafts while the orchestrator is otherwise ready ("" when not)
    degraded: str = ""
    active: int = 0
    active_per_key: dict[str, int] = field(default_factory=dict)
    # The admission queue: one future per request waiting for a slot (orchestrator.service.admit);
    # every freed slot, and the drain, resolves them all and each waiter checks again, in order.
    waiters: list[asyncio.Future] = field(default_factory=list)
    # Tokenising and chat templates run here, off the event loop (a 1 MiB prompt takes long enough
    # to stall every stream), one at a time: a fast tokenizer's settings are mutated by each call,
    # so concurrent calls on one tokenizer can fail ("Already borrowed").
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))
    draining_since: float | None = None  # monotonic time of the SIGTERM that started the drain
    tokenizer_fingerprint: str = ""  # of ``tokenizer``: compared with the target's on every check
    # the most characters of text one token of ``tokenizer`` stands for, and whether it encodes
    # whitespace (else the characters counted are the others: orchestrator.service.check_size)
    token_chars: int = 1
    encodes_spaces: bool = True
    checked_at: float = -float("inf")  # monotonic time of the last connect()
    # Release calls still running after their request ended (see orchestrator.loop.generate)
    background: set[asyncio.Task] = field(default_factory=set)

    @classmethod
    def from_settings(cls, settings: OrchestratorSettings) -> Runtime:
        """The services' pools, the draft's health and the cost model, not yet connected (its
        channels belong to the event loop that first uses them: build it inside the server's)."""
        return cls(
            settings=settings,
            draft=DraftPool.from_settings(settings),
            target=TargetPool.from_settings(settings),
            draft_health=DraftHealth(settings.draft_retry_s),
            costs=CostModel(shared_host_max_streams=settings.shared_host_max_streams),
        )

    def drain(self) -> None:
        """Stop admitting; generations in progress get ``drain_timeout_s`` to finish (SIGTERM)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            # the queued requests get their 503 now (a signal handler may run this outside the loop's turn)
            for waiter in self.waiters:
                waiter.get_loop().call_soon_threadsafe(lambda w=waiter: w.done() or w.set_result(None))
            logger.info("draining: no new requests; %d in progress get %.0f s to finish",
                        self.active, self.settings.drain_timeout_s)

    def wake_waiters(self) -> None:
        """A slot was freed (or the drain began): every queued request checks again."""
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)

    def drain_expired(self) -> bool:
        return self.draining_since is not None and time.monotonic() - self.draining_since >= self.settings.drain_timeout_s

    @property
    def model_name(self) -> str:
        return self.settings.model_name or self.target_info.get("model_id", "specdec")


def longest_token_chars(tokenizer: Any) -> tuple[int, bool]:
    """The most characters of a user's text one token can stand for: the longest entry of the
    vocabulary (special tokens aside: typed text never becomes one; a byte-level BPE entry holds a
    character per byte and a character is at least a byte; a SentencePiece entry is its text), and
    whether whitespace is encoded at all (a word-level tokenizer drops it: then only the other
    characters count)."""
    special = {*getattr(tokenizer, "all_special_ids", ()), *getattr(tokenizer, "added_tokens_decoder", {})}
    try:
        vocab = tokenizer.get_vocab()
        spaced = tokenizer.decode(tokenizer("a    b", add_special_tokens=False).input_ids)
    except Exception:  # a tokenizer without a readable vocabulary: no bound from it
        return 1 << 20, False
    longest = max((len(text) for text, i in vocab.items() if i not in special), default=1)
    return longest, "    " in spaced


def _info_dict(info: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _unreachable(exc: grpc.aio.AioRpcError) -> str:
    """Why a service's pool gave no Info: its replicas' reasons are in the details."""
    if NOT_SERVING in (exc.details() or ""):  # a replica answers, but its forward pass hangs
        return f"not serving: {NOT_SERVING}"
    return f"unreachable: {exc.code().name}"


async def connect(rt: Runtime) -> None:
    """Read both services' Info, load the tokenizer, check they are compatible; set readiness."""
    rt.checked_at = time.monotonic()
    try:
        target = await rt.target.info()
    except grpc.aio.AioRpcError as exc:
        rt.not_ready = f"target service at {rt.settings.target_address} {_unreachable(exc)}"
        return
    rt.target_info = _info_dict(target)
    draft = await _draft_info(rt)
    problem = _mismatch(target, draft) or await _ensure_tokenizer(rt, target)
    if problem:
        rt.not_ready = problem
        return
    rt.limits = _model_limits(target, draft)
    rt.not_ready = ""
    if draft is not None:
        rt.degraded = ""


async def _draft_info(rt: Runtime) -> Any:
    """The draft's Info, or None (and the runtime degraded) when its pool gave none."""
    try:
        draft = await rt.draft.info()
        rt.draft_info = _info_dict(draft)
    except grpc.aio.AioRpcError as exc:
        # requests still decode (target only, the same output): ready, but degraded
        rt.degraded = f"draft service at {rt.settings.draft_address} {_unreachable(exc)}; decoding without drafts"
        rt.draft_info = {}
        draft = None
    return draft


def _mismatch(target: Any, draft: Any) -> str:
    """Why this draft cannot serve beside this target ("" when it can, or when there is no draft)."""
    if draft is not None and draft.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        return (
            f"draft and target tokenizers differ (draft {draft.model_id}: {draft.tokenizer_fingerprint[:12]}, "
            f"target {target.model_id}: {target.tokenizer_fingerprint[:12]}); pair models that share a tokenizer"
        )
    if draft is not None and draft.tokenizer_fingerprint and draft.vocab_size > target.vocab_size:
        # Same tokenizer, but a larger embedding table could let the draft propose ids the target
        # cannot take (each such step would be verified again without its draft).
        return (
            f"the draft's vocabulary ({draft.model_id}: {draft.vocab_size} ids) is larger than the target's "
            f"({target.model_id}: {target.vocab_size} ids); pair a draft whose ids the target accepts"
        )
    return ""


async def _ensure_tokenizer(rt: Runtime, target: Any) -> str:
    """Load the target's tokenizer unless the one loaded is still the target's; why not ("" once
    it is loaded and matches)."""
    if rt.tokenizer is not None and rt.tokenizer_fingerprint != target.tokenizer_fingerprint:
        # the target now serves another model (a rollout): text must not be decoded with the old vocabulary
        logger.warning("the target's tokenizer changed (%s): loading it again", target.model_id)
        rt.tokenizer, rt.tokenizer_fingerprint, rt.limits = None, "", None
    if rt.tokenizer is None:
        from specdec.models import load_tokenizer, tokenizer_fingerprint

        spec = rt.settings.tokenizer or target.model_id
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, spec)
        except Exception as exc:
            return f"cannot load tokenizer {spec!r}: {exc}"
        fingerprint = await asyncio.to_thread(tokenizer_fingerprint, tokenizer)
        if fingerprint != target.tokenizer_fingerprint:
            return f"tokenizer {spec!r} does not match the target's ({target.model_id})"
        rt.token_chars, rt.encodes_spaces = await asyncio.to_thread(longest_token_chars, tokenizer)
        rt.tokenizer, rt.tokenizer_fingerprint = tokenizer, fingerprint
    return ""


def _model_limits(target: Any, draft: Any) -> ModelLimits:
    """What the loop needs of both services' Info (no draft: no drafting), and where each party computes."""
    # where each party computes: a host's cores, or a device on it (a GPU target and a CPU draft on
    # one host do not take each other's compute)
    target_site = compute_site(target.host_id, target.device, target.cpu_cores)
    draft_site = compute_site(draft.host_id, draft.device, draft.cpu_cores) if draft is not None else None
    topology = Topology(target_site, draft_site, (process.host_id(), process.cpu_cores()))
    return ModelLimits(
        target_max_context=target.max_context,
        target_max_draft=target.max_draft_tokens,
        draft_max_context=draft.max_context if draft is not None else 0,
        draft_max_draft=draft.max_draft_tokens if draft is not None else 0,
        eos_token_ids=set(target.eos_token_ids),
        draft_shares_host=topology.draft_shares_target(),
        topology=topology,
    )


async def keep_connected(rt: Runtime) -> None:
    while True:
        await connect(rt)
        # a missing draft is looked for as often as a missing target: requests speculate again
        # within 2 s of the draft coming back
        await asyncio.sleep(2.0 if rt.not_ready or rt.degraded else 15.0)
