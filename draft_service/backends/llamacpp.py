"""Draft backend on llama.cpp (llama-cpp-python): a GGUF model, quantised, fast on CPU.

All sessions share one llama.cpp context with a unified KV pool; each session owns a sequence
slot (seq_id) in it. Prefix reuse crops the slot with ``llama_memory_seq_rm`` and decodes only the
new suffix, exactly like the transformers backends crop their DynamicCache. The pool is sized
from the KV budget, so the SessionStore's byte accounting is what keeps it from overflowing.

**Lookup guesses** (greedy jobs, ``lookup_ngram`` > 0). When the sequence's last n tokens occurred
earlier in it, what followed them there is decoded as a guess in the same pass as the job's next
token, with logits for every guessed row. The draft then picks its tokens exactly as it would one
pass at a time, and keeps reading the guessed rows while its own token equals the guess: each
guessed token it would have drafted itself costs a row of a batched pass instead of a pass of its
own (a pass of several rows costs far less than as many single passes: docs/benchmarks.md,
"Lookup guesses in the draft"). The first wrong guess ends it, and its rows leave the cache. A
guess starts at 2 tokens and doubles while it is taken whole, so text that does not repeat pays at
most a 2-row guess per pass when a spurious match turns up. The draft proposed
is the one drafting one pass at a time gives, up to llama.cpp's rounding in batched passes (which
the target's verification makes harmless).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from prometheus_client import Counter

from draft_service.backends.ngram import find_continuation
from draft_service.proposer import DEFAULT_BUDGET, DraftPlan, Planned, ProposeJob, Proposer, budget_of, plan_drafts
from specdec.engine.compute import StepResult
from specdec.engine.kv import KVManager
from specdec.engine.planner import Budget
from specdec.engine.sessions import SessionStore, common_prefix_len
from specdec.errors import ResourceExhausted
from specdec.model.gguf_convert import draft_gguf
from specdec.model.gguf_model import file_type_name
from specdec.models import gguf_tokenizer_fingerprint
from specdec.params import ModelInfo
from specdec.process import cpu_cores

if TYPE_CHECKING:
    from draft_service.settings import DraftSettings

logger = logging.getLogger(__name__)

LOOKUP_TOKENS = Counter("specdec_draft_lookup_tokens_total",
                        "Tokens guessed by lookup (decoded ahead in a draft pass), and those the draft kept.",
                        ["outcome"])
FIRST_GUESS = 2  # tokens of a job's first lookup guess; doubled after each guess taken whole



def _offloads(llama_cpp: Any, gpu_layers: int) -> bool:
    """Whether the draft's layers go to the GPU (``gpu_layers``: how many, -1 all). A build without
    a GPU backend ignores them and computes on the CPU (a warning says so; Info's device says which
    happened)."""
    offload = gpu_layers != 0 and bool(llama_cpp.llama_supports_gpu_offload())
    if gpu_layers != 0 and not offload:
        logger.warning("gpu_layers=%d, but this llama-cpp-python build has no GPU backend: the draft runs on the "
                       "CPU (build it with SPECDEC_LLAMACPP_CUDA=1 scripts/install_llamacpp.sh)", gpu_layers)
    return offload

class _SeqSlot:
    """A llama.cpp sequence slot as the KV manager's cache (specdec.engine.kv.Cache): positions held
    in the shared pool, by sequence id; what it holds is counted exactly (the pool is shared, so
    nothing is held ahead)."""

    __slots__ = ("_owner", "seq", "length", "capacity")

    def __init__(self, owner: LlamaCppProposer, seq: int) -> None:
        self._owner, self.seq = owner, seq
        self.length = self.capacity = 0

    def capacity_for(self, tokens: int, limit: int) -> int:
        return tokens

    def ensure(self, tokens: int, limit: int) -> None:
        self.capacity = tokens

    def crop(self, length: int) -> None:
        if length < self.length:
            self._owner._ctx.kv_cache_seq_rm(self.seq, length, -1)
            self.length = length

    def commit(self, length: int) -> None:
        if length < self.capacity:  # decoded past it: a guess not taken
            self._owner._ctx.kv_cache_seq_rm(self.seq, length, -1)
        self.length = self.capacity = length

    def clear(self) -> None:
        self._owner._ctx.kv_cache_seq_rm(self.seq, -1, -1)
        self.length = self.capacity = 0

    def free(self) -> None:
        self.clear()
        self._owner._free_slots.append(self.seq)


class LlamaCppProposer(Proposer):
    backend = "llamacpp"

    def __init__(self, model_path: str, max_sessions: int, kv_budget_bytes: int, ttl_s: float,
                 max_draft_tokens: int, threads: int = 0, n_batch: int = 512, overlap_threads: int = 1,
                 lookup_ngram: int = 3, lookup_max_tokens: int = 16, gpu_layers: int = 0,
                 budget: Budget = DEFAULT_BUDGET) -> None:
        import llama_cpp
        from llama_cpp import _logger as llama_logger

        # llama.cpp prints its load and graph logs unless told otherwise; keep errors only.
        llama_logger.set_verbose(False)
        self._ll = llama_cpp
        self.model_path = model_path
        self.lookup_ngram = lookup_ngram
        self.lookup_max_tokens = lookup_max_tokens
        self.lock = threading.Lock()
        llama_cpp.llama_backend_init()
        offload = self._load_model(gpu_layers)
        slots, pool = self._pool(max_sessions, kv_budget_bytes)
        self._open_context(pool, slots, n_batch, threads, overlap_threads)
        self.budget = Budget(min(budget.max_rows, n_batch), budget.shared_prefill_rows)
        self._free_slots = list(range(slots - 1, -1, -1))
        store = SessionStore(slots, pool * self.bytes_per_token, ttl_s)
        self.kv = KVManager(store, self._new_slot, self.bytes_per_token, llama_cpp.llama_model_n_ctx_train(self._m))
        super().__init__(store, max_draft_tokens)
        self._info = self._describe(offload, max_draft_tokens)
        logger.info("llama.cpp on the %s: %d threads (%d when yielding cores to the target), KV pool %d tokens in %d "
                    "slots (%d B/token)", self._info.device, self.threads, self.overlap_threads, pool, slots,
                    self.bytes_per_token)

    def _load_model(self, gpu_layers: int) -> bool:
        """Load the GGUF file; whether its layers went to the GPU."""
        from llama_cpp import _internals as internals

        ll = self._ll
        offload = _offloads(ll, gpu_layers)
        model_params = ll.llama_model_default_params()
        model_params.n_gpu_layers = gpu_layers if offload else 0
        self._model = internals.LlamaModel(path_model=self.model_path, params=model_params, verbose=False)
        self._m = self._model.model
        n_head = ll.llama_model_n_head(self._m)
        head_dim = ll.llama_model_n_embd(self._m) // max(1, n_head)
        # K and V, f16 each (llama.cpp's default KV type).
        self.bytes_per_token = 2 * ll.llama_model_n_layer(self._m) * ll.llama_model_n_head_kv(self._m) * head_dim * 2
        self._vocab = ll.llama_model_get_vocab(self._m)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        return offload

    def _pool(self, max_sessions: int, kv_budget_bytes: int) -> tuple[int, int]:
        """Sequence slots and pool tokens the KV budget holds."""
        slots = min(max_sessions, self._ll.llama_max_parallel_sequences())
        pool = int(min(kv_budget_bytes // self.bytes_per_token, slots * self._ll.llama_model_n_ctx_train(self._m)))
        if pool < 64:
            raise ValueError(f"KV budget of {kv_budget_bytes} bytes holds only {pool} tokens of this model")
        return slots, pool

    def _open_context(self, pool: int, slots: int, n_batch: int, threads: int, overlap_threads: int) -> None:
        from llama_cpp import _internals as internals

        params = self._ll.llama_context_default_params()
        params.n_ctx = pool
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = slots
        params.kv_unified = True  # sessions share one pool; any one may grow to the whole of it
        params.no_perf = True
        # 0 means every whole core this process may use (its affinity and CPU quota). The steps of a
        # Propose that yields cores (the target computes on this host meanwhile) run on
        # overlap_threads instead: next to a busy target, two threads would wait for each other at
        # every op's barrier (the OpenMP spin is bounded: see specdec.process.SPIN_COUNT).
        nthreads = threads or max(1, int(cpu_cores()))
        self.threads = self._threads_now = nthreads
        self.overlap_threads = min(overlap_threads, nthreads) if overlap_threads else nthreads
        params.n_threads = params.n_threads_batch = nthreads
        self._ctx = internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
        self.n_batch = n_batch

    def _describe(self, offload: bool, max_draft_tokens: int) -> ModelInfo:
        fingerprint, _, eos = gguf_tokenizer_fingerprint(self.model_path)
        eog = {t for t in range(self.n_vocab) if self._ll.llama_vocab_is_eog(self._vocab, t)}
        self._eos = eog | set(eos)
        metadata = self._model.metadata()
        return ModelInfo(
            model_id=self.model_path, architecture=metadata.get("general.architecture", "gguf"),
            vocab_size=self.n_vocab, tokenizer_fingerprint=fingerprint, max_context=self.kv.max_context,
            dtype=file_type_name(metadata.get("general.file_type", "")),
            device="cuda" if offload else "cpu", backend=self.backend, max_draft_tokens=max_draft_tokens,
            eos_token_ids=sorted(self._eos),
        )

    @classmethod
    def from_settings(cls, settings: DraftSettings) -> LlamaCppProposer:
        path = draft_gguf(settings.model, settings.target_model, settings.quant, settings.cache_dir)
        return cls(str(path), settings.max_sessions, settings.kv_budget_bytes,
                   settings.session_ttl_s, settings.max_draft_tokens, settings.threads,
                   overlap_threads=settings.overlap_threads, lookup_ngram=settings.lookup_ngram,
                   lookup_max_tokens=settings.lookup_max_tokens, gpu_layers=settings.gpu_layers,
                   budget=budget_of(settings))

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    def grammar_tokenizer(self):
        from specdec.models import load_tokenizer

        return load_tokenizer(self.model_path)  # the one the file carries, once, for the first grammar

    def release(self, session_id: str) -> bool:
        with self.lock:
            return super().release(session_id)

    def _new_slot(self) -> _SeqSlot:
        if not self._free_slots:  # all slots held: the store's count bound makes this rare
            raise ResourceExhausted("no free llama.cpp sequence slot")
        return _SeqSlot(self, self._free_slots.pop())

    def step(self, jobs: list[ProposeJob]) -> StepResult:
        """One ``llama_decode`` over the jobs the planner takes (draft_service.proposer.plan_drafts;
        each session its own sequence in the shared KV pool): each job advances by one draft token;
        a job's first step also decodes the tokens its sequence missed, in chunks past the budget
        (at most the decode batch, ``n_batch``). Greedy jobs may decode a lookup guess beside."""
        with self.lock:
            step = plan_drafts(jobs, self.kv, self.budget, self._info.max_context)
            passes = self._open(step, jobs)
            if not passes:
                return StepResult(step.outcomes)
            self._use_threads(self.overlap_threads if any(jobs[p.index].yield_cores for p in passes) else self.threads)
            try:
                logits = self._decode_groups(passes, jobs)
            except BaseException as exc:
                for p in passes:
                    self.kv.fail(p.session)  # the sequence's contents are unknown: afresh next time
                    step.outcomes[p.index] = exc
                return StepResult(step.outcomes)
            for p, rows in zip(passes, logits, strict=True):
                if self._finish(jobs[p.index], p, rows, len(passes)):
                    step.outcomes[p.index] = jobs[p.index].proposal()
        return StepResult(step.outcomes, len(passes), sum(p.end - p.cached + len(p.guess) for p in passes))

    def _open(self, step: DraftPlan, jobs: list[ProposeJob]) -> list[Planned]:
        """Each planned job's sequence opened in the KV manager (room for its rows and guess), in
        plan order; a job refused room gets its error and leaves the step."""
        pinned = {p.session.session_id for p in step.planned}
        used = sum(p.end - p.cached for p in step.planned)
        passes = []
        for p in step.planned:
            guess = self._guess(jobs[p.index], p) if p.logits else []
            if used + len(guess) > self.n_batch or (  # a guess never evicts another session's cache
                    self.kv.store.nbytes + (p.end + len(guess)) * self.bytes_per_token - p.session.nbytes
                    > self.kv.store.max_bytes):
                guess = []
            try:
                self.kv.open(p.session, p.sequence[:p.end], p.cached, pinned, extra=len(guess))
            except BaseException as exc:  # noqa: BLE001 - that job's error
                step.outcomes[p.index] = exc
                continue
            used += len(guess)
            p.guess = guess
            passes.append(p)
        return passes

    def _finish(self, job: ProposeJob, p: Planned, rows: list[torch.Tensor], batch_sessions: int) -> bool:
        """Draft from a job's decoded rows and commit what its sequence keeps; True when the job is done."""
        if job.cached_tokens < 0:
            job.cached_tokens = p.cached
        if not p.logits:  # a prefill chunk
            self.kv.commit(p.session, p.sequence[:p.end])
            return False
        before = len(job.drafted)
        done = self._advance(job, rows, p.guess, batch_sessions)
        # The cache keeps the guessed tokens the draft drafted itself; the rest leave it.
        taken = common_prefix_len(job.drafted[before:], p.guess)
        if p.guess:
            LOOKUP_TOKENS.labels("guessed").inc(len(p.guess))
            LOOKUP_TOKENS.labels("taken").inc(taken)
            job.guess_len = min(2 * len(p.guess), self.lookup_max_tokens) if taken == len(p.guess) else FIRST_GUESS
        self.kv.commit(p.session, p.sequence + p.guess[:taken] if taken else p.sequence)
        return done

    def _guess(self, job: ProposeJob, p: Planned) -> list[int]:
        """Tokens to decode ahead for ``job`` in this pass (see the module doc); [] for none."""
        if not self.lookup_ngram or not job.sampling.greedy:
            return []
        room = job.k - len(job.drafted) - 1  # the pass drafts one token beyond the guess
        if room <= 0:
            return []
        return find_continuation(p.sequence, min(room, job.guess_len or FIRST_GUESS), self.lookup_ngram,
                                 self.lookup_ngram)

    def _advance(self, job: ProposeJob, rows: list[torch.Tensor], guess: list[int], batch_sessions: int) -> bool:
        """Draft from the pass's rows: row j + 1 follows guess[j], so it is read only while every
        token drafted so far in this pass equals the guess. True when the job is done."""
        for j, row in enumerate(rows):
            if job.advance(job.probabilities(row), self._eos, batch_sessions):
                return True
            if j >= len(guess) or job.drafted[-1] != guess[j]:
                return False
        return False

    def _use_threads(self, n: int) -> None:
        if n != self._threads_now:  # a field of the context: switching costs nothing measurable
            self._ll.llama_set_n_threads(self._ctx.ctx, n, n)
            self._threads_now = n

    def _decode_groups(self, plan: list[Planned], jobs: list[ProposeJob]) -> list[list[torch.Tensor]]:
        """Greedy jobs share one decode; each sampling job is decoded on its own. llama.cpp's batched
        kernels change a sequence's logits with the batch around it, which never changes a greedy
        output but would make a seeded sampling request's draws, and so its output, depend on the load."""
        greedy = [p for p in plan if jobs[p.index].sampling.greedy]
        groups = ([greedy] if greedy else []) + [[p] for p in plan if not jobs[p.index].sampling.greedy]
        logits: dict[int, list[torch.Tensor]] = {}
        for group in groups:
            for p, rows in zip(group, self._decode(group), strict=True):
                logits[p.index] = rows
        return [logits[p.index] for p in plan]

    def _decode(self, plan: list[Planned]) -> list[list[torch.Tensor]]:
        """Decode each planned sequence's new tokens and guess (at their positions, in their own
        sequence); return, per sequence, the logits after its last token and after each guessed one
        (none for a prefill chunk)."""
        rows = [(p.session.cache.seq, tok, pos, p.logits > 0 and pos >= p.end - 1)
                for p in plan for pos, tok in enumerate(p.sequence[p.cached:p.end] + p.guess, start=p.cached)]
        if len(rows) > self.n_batch:  # the planner and _open keep a pass within it; never write past the batch
            raise RuntimeError(f"a decode of {len(rows)} rows, over the batch of {self.n_batch}")
        b = self._batch.batch
        wanted: list[int] = []
        for i, (slot, tok, pos, last) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.seq_id[i][0] = slot
            b.n_seq_id[i] = 1
            b.logits[i] = last
            if last:
                wanted.append(i)
        b.n_tokens = len(rows)
        rc = self._ll.llama_decode(self._ctx.ctx, b)
        if rc == 1:
            raise ResourceExhausted("llama.cpp KV pool has no room for these sequences")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out, at = [], 0
        for p in plan:
            n = 1 + len(p.guess) if p.logits else 0
            out.append([self._logits(i) for i in wanted[at : at + n]])
            at += n
        return out

    def _logits(self, row: int) -> torch.Tensor:
        ptr = self._ll.llama_get_logits_ith(self._ctx.ctx, row)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

