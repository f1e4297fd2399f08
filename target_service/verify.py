"""Target engine: one forward pass over the uncached suffix + draft, then greedy or lossless
rejection-sampling verification. No grpc here; see servicer.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.engine.compute import PENDING, CpuAccounted, StepResult, run_alone
from specdec.engine.executor import Executor, ForwardRequest
from specdec.engine.planner import Budget, Need, Slot, plan
from specdec.engine.requests import eos_ids, validate_context, validate_session_id, validate_tokens
from specdec.engine.sessions import Session, SessionsFull, SessionStore
from specdec.errors import InvalidArgument, NotFound, ResourceExhausted
from specdec.grammar import Grammars
from specdec.grammar import apply as apply_mask
from specdec.models import LoadedModel, gguf_tokenizer_fingerprint, load_hf, load_tokenizer, tokenizer_fingerprint
from specdec.params import ModelInfo
from specdec.sampling import STREAM_TARGET, Sampling, probabilities, process, sample, verify_greedy, verify_sampling

if TYPE_CHECKING:
    from target_service.settings import TargetSettings

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
DEFAULT_MAX_QUEUED_DISTRIBUTION_BYTES = 64 << 20
LOGPROB_FLOOR = -9999.0  # a processed logprob of a token its distribution excludes (OpenAI's floor)


@dataclass
class VerifyJob(CpuAccounted):
    """A validated Verify request, ready for the compute thread (built on the RPC thread, so a
    malformed or oversized request never costs the model's thread any time)."""

    session_id: str
    tokens: list[int]  # [n] committed tokens
    draft: list[int]  # [k] draft tokens
    sampling: Sampling
    # k sparse draft distributions, (ids int32, probs float32) (sampling with a draft), else None:
    # dense, 128 waiting verifications of 32 draft tokens held 0.8 GB of zeros outside the KV budget
    q: list[tuple[torch.Tensor, torch.Tensor]] | None
    return_target_probs: bool
    yield_cores: bool = False  # a draft computes on this host meanwhile: run on overlap_threads
    logprobs: int | None = None  # None: none; n >= 0: each emitted token's raw logprob and the top n
    processed_logprobs: bool = False  # logprobs of the distribution each token was chosen from instead
    prepare_ns: int = 0
    queue_ns: int = 0  # set by the scheduler: wait before the first step
    started_ns: int = 0  # perf_counter_ns of the first step that computed for it

    @property
    def distribution_bytes(self) -> int:
        """Bytes its draft distributions hold while it waits (see :class:`HeldBytes`)."""
        return sum(ids.nbytes + probs.nbytes for ids, probs in self.q or ())


@dataclass
class Verification:
    """Result of one Verify call."""

    num_accepted: int
    next_token: int  # correction at the first rejected position, or the bonus token
    target_probs: list[float]  # [k] target probability of each draft token (when asked)
    next_token_prob: float
    cached_tokens: int
    compute_ns: int
    batch_sessions: int = 1  # sessions in the forward pass that verified it
    batch_rows: int = 0  # token rows in that pass
    queue_ns: int = 0
    step_cpu_ns: int = 0  # set by the scheduler: process CPU time of the pass(es) it was in, mean
    # with logprobs: per emitted token (accepted draft tokens, then next_token) its raw logprob,
    # and the top n (ids, logprobs), most likely first
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


def target_gguf(model: str, quant: str | None, cache_dir: Path | None = None) -> Path | None:
    """The GGUF file the target computes: ``model`` itself when it is a .gguf file, the model
    converted to ``quant`` (once, cached) when ``quant`` is set, else None (a transformers
    checkpoint in its own dtype)."""
    from specdec.model.gguf_convert import ensure_gguf

    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if quant is not None:
            raise InvalidArgument(f"{model!r} is a GGUF file of its own type: unset quant ({quant!r}), or give the "
                                  "checkpoint to quantise")
        if not path.is_file():
            raise NotFound(f"no such GGUF file: {model!r}")
        return path
    if quant is None:
        return None
    return ensure_gguf(model, quant, cache_dir)


@dataclass
class GGUFModel:
    """A GGUF target: the model specdec.model.gguf_model builds, its quantised linears' blocks, the file."""

    model: object
    quant: dict
    file: object  # specdec.model.gguf_file.GGUFFile
    file_type: str
    load_s: float

    @classmethod
    def load(cls, path: Path) -> GGUFModel:
        """The model of the GGUF file ``path``, or UnsupportedModel saying why it cannot be served
        (an architecture the runner does not cover, a tensor type the kernels do not compute)."""
        from specdec.model.gguf_model import UnsupportedModel, file_type, load_gguf
        from specdec.native import kernels

        if kernels() is None:
            raise UnsupportedModel("a GGUF target computes on specdec.native, which is unavailable here (the log says "
                                   "why: a C compiler is needed once)")
        t0 = time.perf_counter()
        model, quant, gguf = load_gguf(path, dequantize_blocks=False, strict=True)
        return cls(model, quant, gguf, file_type(gguf), time.perf_counter() - t0)

    def check(self, lm: Executor) -> None:
        """UnsupportedModel unless the whole forward runs on specdec's runner and kernels (the
        quantised weights have no transformers forward); logs each format's kernel."""
        from specdec.model.gguf_model import UnsupportedModel
        from specdec.native import kernels

        if lm.runner is None or lm.runner.native is None:
            raise UnsupportedModel(f"{self.file.path.name}: specdec's runner does not cover this model (the log says "
                                   "why), and its quantised weights have no other forward here")
        native = kernels()
        formats = sorted({fmt for fmt, _ in self.quant.values()})
        logger.info("GGUF target %s (%s): %d linears in their own format (%s), fp32 linears on %s",
                    self.file.path.name, self.file_type, len(self.quant),
                    ", ".join(f"{f} on {native.quant_isa(f)}" for f in formats) or "none", native.isa)
        # packed now: the raw blocks (and the copies of the q/k projections' reordered rows) go,
        # and the file's pages leave resident memory (embedding rows fault back in as looked up)
        self.quant = {}
        self.file.release_pages()


class TargetEngine:
    """Verifies drafts against a transformers causal LM with per-session KV caches."""

    backend = "transformers"

    def __init__(self, loaded: LoadedModel, store: SessionStore, *, max_draft_tokens: int = 32,
                 max_batch_rows: int = 256, overlap_threads: int = 0, shared_prefill_rows: int = 64,
                 pack_weights: bool = True, use_runner: bool = True, native: bool = True, gguf: GGUFModel | None = None,
                 max_queued_distribution_bytes: int = DEFAULT_MAX_QUEUED_DISTRIBUTION_BYTES) -> None:
        self.loaded = loaded
        self.held_distributions = HeldBytes(max_queued_distribution_bytes)
        self.budget = Budget.of(max_batch_rows, shared_prefill_rows, max_draft_tokens + 1)
        # Threads of a pass that verifies while a draft computes on this host (0: no change).
        self.overlap_threads = overlap_threads
        self.lm = Executor(loaded.model, store, pack_weights, use_runner, native=native,
                           quant=gguf.quant if gguf is not None else None)
        if gguf is not None:
            gguf.check(self.lm)
        self.store = store
        self.max_draft_tokens = max_draft_tokens
        # which engine computes it: specdec's runner on its own kernels, or transformers' forward
        self.backend = "native" if self.lm.runner is not None else "transformers"
        self._info = self._describe(gguf)
        # a GGUF target has no transformers tokenizer loaded: the one its file carries, on first use
        self.grammars = Grammars(lambda: loaded.tokenizer or load_tokenizer(loaded.source), self.lm.vocab_size,
                                 self._info.eos_token_ids)

    @property
    def max_batch_rows(self) -> int:
        return self.budget.max_rows

    @property
    def shared_prefill_rows(self) -> int:
        """Rows of long prefills in a pass that also decodes for other sessions (0: max_batch_rows)."""
        return self.budget.shared_prefill_rows

    def _describe(self, gguf: GGUFModel | None) -> ModelInfo:
        loaded, config = self.loaded, self.loaded.model.config
        if gguf is not None:
            fingerprint, _, eos = gguf_tokenizer_fingerprint(gguf.file)
            dtype, eos_tokens = gguf.file_type, sorted(eos)
            for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
                gguf.file.fields.pop(key, None)  # megabytes of Python strings for a large vocabulary, read once
        else:
            fingerprint, dtype = tokenizer_fingerprint(loaded.tokenizer), str(loaded.model.dtype).removeprefix("torch.")
            eos_tokens = eos_ids(config, loaded.tokenizer, getattr(loaded.model, "generation_config", None))
        return ModelInfo(
            model_id=loaded.model_id,
            architecture=(config.architectures or [type(loaded.model).__name__])[0],
            vocab_size=self.lm.vocab_size,
            tokenizer_fingerprint=fingerprint,
            max_context=self.lm.max_context,
            dtype=dtype,
            device=str(self.lm.device),
            backend=self.backend,
            max_draft_tokens=self.max_draft_tokens,
            eos_token_ids=eos_tokens,
        )

    @classmethod
    def from_settings(cls, settings: TargetSettings, *, loaded: LoadedModel | None = None) -> TargetEngine:
        """The engine the target service's settings describe; ``loaded``: the model, when the caller
        loaded it already (else ``settings.model`` is loaded here)."""
        gguf = None
        if loaded is None:
            path = target_gguf(settings.model, settings.quant, settings.cache_dir)
            if path is not None:
                if settings.device != "cpu" or settings.runner != "auto":
                    raise InvalidArgument(f"a GGUF target runs on specdec's CPU kernels: it needs device=cpu and "
                                          f"runner=auto, not device={settings.device!r}, runner={settings.runner!r}")
                gguf = GGUFModel.load(path)
                loaded = LoadedModel(gguf.model, None, settings.model, str(path), gguf.load_s)
            else:
                loaded = load_hf(settings.model, settings.dtype, settings.device, settings.cache_dir)
        return cls(loaded, SessionStore.from_settings(settings), max_draft_tokens=settings.max_draft_tokens,
                   max_batch_rows=settings.max_batch_rows, overlap_threads=settings.overlap_threads,
                   shared_prefill_rows=settings.shared_prefill_rows, pack_weights=settings.pack_weights,
                   use_runner=settings.runner == "auto", gguf=gguf,
                   max_queued_distribution_bytes=int(settings.max_queued_distributions_mb * (1 << 20)))

    def info(self) -> ModelInfo:
        self._info.max_context = self.lm.max_context
        self._info.sessions = len(self.store)
        self._info.kv_bytes = self.store.nbytes
        self._info.kv_budget_bytes = self.store.max_bytes
        return self._info

    def release(self, session_id: str) -> bool:
        validate_session_id(session_id)
        self.grammars.release(session_id)
        with self.lm.lock:
            return self.store.release(session_id)

    def verify(self, *args, **kwargs) -> Verification:
        """Verify ``draft`` after ``tokens`` in one forward pass, on the calling thread: the
        arguments of :meth:`prepare` (``draft_distributions`` are the draft's q, sparse, one per
        draft token, required when sampling with a non-empty draft)."""
        return self.run(self.prepare(*args, **kwargs))

    def run(self, job: VerifyJob) -> Verification:
        """Verify one prepared job on its own (step after step, for a long prompt's chunks)."""
        return run_alone(self, job)

    def prepare(
        self,
        session_id: str,
        tokens: Sequence[int],
        draft: Sequence[int] = (),
        sampling: Sampling = Sampling(),
        draft_distributions: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
        return_target_probs: bool = False,
        yield_cores: bool = False,
        logprobs: int | None = None,
        processed_logprobs: bool = False,
    ) -> VerifyJob:
        """Validate a Verify request (raises InvalidArgument) without touching the model.
        ``logprobs``: None for none, else each emitted token's raw log-probability and the
        ``logprobs`` most likely tokens' (at most MAX_TOP_LOGPROBS); ``processed_logprobs``: those
        of the distribution the token was chosen from (after logit processing, the grammar's mask and
        the sampling transform) instead."""
        t0 = time.perf_counter_ns()
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs is {logprobs}; at most {MAX_TOP_LOGPROBS}")
        tokens, draft = list(tokens), list(draft)
        validate_session_id(session_id)
        sampling.validate()
        if len(draft) > self.max_draft_tokens:
            raise InvalidArgument(f"draft_tokens holds {len(draft)} tokens, over the maximum of {self.max_draft_tokens}")
        # The verified draft and the next token must fit in the context.
        validate_context(len(tokens) + len(draft) + 1, self.lm.max_context, "tokens + draft_tokens + 1")
        validate_tokens(tokens, self.lm.vocab_size)
        validate_tokens(draft, self.lm.vocab_size, what="draft_tokens", allow_empty=True)
        validate_tokens([t for t, _ in sampling.logit_bias], self.lm.vocab_size, what="logit_bias", allow_empty=True)
        if sampling.grammar:
            self.grammars.check(sampling.grammar)  # here, off the model's thread (the first loads the tokenizer)
            if sampling.output_start > len(tokens):
                raise InvalidArgument(f"output_start {sampling.output_start} is past the {len(tokens)} tokens")
        q = None
        if not sampling.greedy and draft:
            if len(draft_distributions) != len(draft):
                raise InvalidArgument(
                    f"sampling verification needs one draft distribution per draft token: got "
                    f"{len(draft_distributions)} for {len(draft)} draft tokens"
                )
            q = [_sparse_distribution(i, ids, probs, x, self.lm.vocab_size)
                 for i, ((ids, probs), x) in enumerate(zip(draft_distributions, draft, strict=True))]
        return VerifyJob(session_id, tokens, draft, sampling, q, return_target_probs, yield_cores, logprobs,
                         processed_logprobs, prepare_ns=time.perf_counter_ns() - t0)

    def step(self, jobs: list[VerifyJob]) -> StepResult:
        """One batched forward pass over the jobs waiting (oldest first): see :class:`StepResult`.

        Planned by specdec.engine.planner under the row budget (``max_batch_rows``): greedy
        verify-sized work shares the pass, each sampling job gets a pass of its own, long prefills
        go in chunks with what is left, so one long prompt never stalls everyone else's decoding for
        its whole prefill. A job whose prefill is not finished stays PENDING (its cache keeps the
        chunk: the next step reuses it as a common prefix). One call per session per pass; a
        second call on the same session waits for the next step.
        """
        outcomes: list = [PENDING] * len(jobs)
        with self.lm.lock:
            shared, alone = self._plan(jobs)
            plan = shared + alone
            now = time.perf_counter_ns()
            for i, _ in plan:
                jobs[i].started_ns = jobs[i].started_ns or now
            threads = self.overlap_threads if any(jobs[i].yield_cores for i, _ in plan) else 0
            results = self.lm.run([r for _, r in shared], [r for _, r in alone], threads)
        rows = sum(r.rows for r in results if not isinstance(r, BaseException))
        ran = sum(1 for r in results if not isinstance(r, BaseException) and r.rows)
        for (i, request), result in zip(plan, results, strict=True):
            if isinstance(result, BaseException):
                outcomes[i] = result
            elif request.logits:
                try:
                    outcomes[i] = self._verify(jobs[i], result.logits, result.cached, ran, rows)
                except Exception as exc:  # noqa: BLE001 - that job's error, not the batch's
                    outcomes[i] = exc
        return StepResult(outcomes, ran, rows)

    def _plan(self, jobs: list[VerifyJob]) -> tuple[list[tuple[int, ForwardRequest]], list[tuple[int, ForwardRequest]]]:
        """The step's plan (called under the model's lock; see specdec.engine.planner): (job index,
        forward request) of the greedy jobs that share this pass, and of the sampling jobs that each
        get a pass alone (chunked as if nothing else waited: their output must not depend on the load)."""
        sessions: dict[str, Session] = {}
        sequences: dict[int, list[int]] = {}
        needs: list[Need] = []
        for i, job in enumerate(jobs):
            if job.session_id in sessions:
                continue  # one call per session a pass: a second waits for the next step
            try:  # never evicting a session this step computes for: more than the store holds wait
                session = sessions[job.session_id] = self.lm.session(job.session_id, keep=sessions)
            except SessionsFull:
                continue
            sequence = sequences[i] = job.tokens + job.draft
            needs.append(Need(i, self.lm.kv.reusable(session, sequence, len(job.draft) + 1), len(sequence),
                              len(job.draft) + 1, alone=not job.sampling.greedy))
        step = plan(needs, self.budget)

        def request(slot: Slot) -> tuple[int, ForwardRequest]:
            sequence = sequences[slot.index]
            tokens = sequence if slot.end == len(sequence) else sequence[:slot.end]
            return slot.index, ForwardRequest(sessions[jobs[slot.index].session_id], tokens, slot.logits)

        return [request(s) for s in step.shared], [request(s) for s in step.alone]

    def _verify(self, job: VerifyJob, logits: torch.Tensor, cached: int, batch_sessions: int,
                batch_rows: int) -> Verification:
        """Greedy or lossless-sampling verification of ``job`` from its logits [k + 1, V]."""
        tokens, draft, sampling = job.tokens, job.draft, job.sampling
        first = len(tokens)  # absolute position of draft[0] (and of the next token when k == 0)
        k = len(draft)
        return_target_probs = job.return_target_probs
        raw = logits
        if sampling.grammar:
            logits = self._constrain(job, logits)
            # the first draft token the grammar refuses (if any) is the last one verified: p' = 0 rejects it
            draft = draft[:len(logits)]
        # penalties and logit_bias, each row with its own history (the same function the draft runs)
        logits = process(logits, sampling, tokens, draft)
        if sampling.greedy:
            num_accepted, next_token = verify_greedy(logits.argmax(dim=-1).tolist(), draft)
            # Row by row: a softmax of all k + 1 rows at once is a fresh block of megabytes, which
            # malloc maps, the softmax faults in page by page and free unmaps (runner.OutputBuffer;
            # docs/performance.md). A row is below malloc's mmap threshold, so its block comes back
            # from the heap.
            p = [torch.softmax(row, dim=-1) for row in logits] if return_target_probs else None
            row = p[num_accepted] if p is not None else torch.softmax(logits[num_accepted], dim=-1)
            next_prob = float(row[next_token])
        else:
            # row by row too (each of the transform's temporaries a row, not a block of megabytes
            # faulted in page by page), as a plain step does it
            p = [probabilities(row, sampling) for row in logits]
            if k:
                num_accepted, next_token = verify_sampling(p, job.q, draft, sampling.seed, first)
            else:
                num_accepted, next_token = 0, sample(p[0], sampling.seed, first, STREAM_TARGET)
            next_prob = float(p[num_accepted][next_token])
        target_probs = [float(p[i][x]) for i, x in enumerate(draft)] if (return_target_probs and p is not None) else []
        logprobs = self._logprobs(job, raw, logits, p, [*draft[:num_accepted], next_token])
        if return_target_probs and sampling.grammar:
            target_probs += [0.0] * (k - len(target_probs))  # after a token the grammar refuses: never verified
        return Verification(
            num_accepted=num_accepted,
            next_token=next_token,
            target_probs=target_probs,
            next_token_prob=next_prob,
            cached_tokens=cached,
            compute_ns=time.perf_counter_ns() - job.started_ns + job.prepare_ns,
            batch_sessions=batch_sessions,
            batch_rows=batch_rows,
            queue_ns=job.queue_ns,
            logprobs=logprobs,
        )

    @staticmethod
    def _logprobs(job: VerifyJob, raw: torch.Tensor, logits: torch.Tensor, p: list[torch.Tensor] | None,
                  emitted: list[int]) -> list[tuple[float, list[int], list[float]]] | None:
        """Each emitted token's logprob and the top ``job.logprobs``: of the raw distribution of its
        position, row by row as a plain step computes its one row (the same bits whether the token
        came from the draft or the target), or with ``processed_logprobs`` of the distribution it
        was chosen from (``p``, or the processed ``logits`` when greedy), what that excludes at
        OpenAI's floor."""
        if job.logprobs is None:
            return None
        out = []
        for i, token in enumerate(emitted):
            if not job.processed_logprobs:
                lp = torch.log_softmax(raw[i], dim=-1)
            else:
                row = p[i] if p is not None and not job.sampling.greedy else None
                lp = (torch.log(row) if row is not None else torch.log_softmax(logits[i], dim=-1)).clamp(min=LOGPROB_FLOOR)
            top = torch.topk(lp, job.logprobs) if job.logprobs else None
            out.append((float(lp[token]), top.indices.tolist() if top is not None else [],
                        top.values.tolist() if top is not None else []))
        return out

    def _constrain(self, job: VerifyJob, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [k + 1, V] masked by the job's grammar: row i under the mask after the
        committed output and the draft tokens before i; only the rows up to the first draft token
        the grammar refuses (that one included) come back."""
        sampling = job.sampling
        state = self.grammars.state(job.session_id, sampling.grammar, sampling.output_start, job.tokens)
        if state is None:
            raise InvalidArgument("the committed tokens do not follow the request's grammar")
        allowed = state.masks(job.draft)
        if not bool(allowed[0].any()):
            raise InvalidArgument("the grammar allows no further token (it has ended; the output is complete)")
        return apply_mask(logits[:len(allowed)], allowed)


# Draft probabilities are float32 sums over up to the whole vocabulary: allow for rounding.
_Q_SUM_TOLERANCE = 1e-3


def _sparse_distribution(index: int, ids: Sequence[int], probs: Sequence[float], token: int,
                         vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft's sparse distribution as (ids int32, probs float32), validated (raises InvalidArgument)."""
    what = f"draft_distributions[{index}]"
    if len(ids) != len(probs):
        raise InvalidArgument(f"{what}: {len(ids)} token_ids but {len(probs)} probs")
    if not ids:
        raise InvalidArgument(f"{what} is empty")
    if len(ids) > vocab_size:
        raise InvalidArgument(f"{what} holds {len(ids)} entries, more than the vocabulary of {vocab_size}")
    index_t = torch.tensor(list(ids), dtype=torch.long)
    probs_t = torch.tensor(list(probs), dtype=torch.float32)
    if int(index_t.max()) >= vocab_size:
        raise InvalidArgument(f"{what} holds id {int(index_t.max())}, outside the vocabulary of {vocab_size} ids")
    if not bool(torch.isfinite(probs_t).all()) or bool((probs_t < 0).any()):
        raise InvalidArgument(f"{what} holds a negative or non-finite probability")
    total = float(probs_t.sum())
    if abs(total - 1.0) > _Q_SUM_TOLERANCE:
        raise InvalidArgument(f"{what} sums to {total:.6g}, not 1")
    if torch.unique(index_t).numel() != index_t.numel():
        raise InvalidArgument(f"{what} repeats a token id")
    if float(probs_t[index_t == token].sum()) <= 0:
        raise InvalidArgument(f"{what} gives probability 0 to its own draft token {token}")
    return index_t.to(torch.int32), probs_t


class HeldBytes:
    """Bytes of draft distributions held by the Verify calls waiting for or in compute, against a
    limit: a call that would pass it gets RESOURCE_EXHAUSTED before it waits. Distributions are
    sparse (the orchestrator's draft sends at most 512 entries a token: 128 KiB for 32 draft
    tokens), but a client may send the whole vocabulary per token (13 MB for 32 on GPT-2)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self._lock:
            if n and self.held + n > self.limit:
                raise ResourceExhausted(
                    f"the draft distributions of the verifications waiting hold {self.held} bytes; this one's {n} "
                    f"would pass the limit of {self.limit} (max_queued_distributions_mb); retry")
            self.held += n
        try:
            yield
        finally:
            with self._lock:
                self.held -= n
