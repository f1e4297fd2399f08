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
own (a pass of 9 rows costs ~4 single ones here). The first wrong guess ends it, and its rows
leave the cache. A guess starts at 2 tokens and doubles while it is taken whole, so text that does
not repeat pays at most a 2-row guess per pass when a spurious match turns up. The draft proposed
is the one drafting one pass at a time gives, up to llama.cpp's rounding in batched passes (which
the target's verification makes harmless).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from prometheus_client import Counter

from draft_service.backends.ngram import find_continuation
from draft_service.proposer import ProposeJob, Proposer, batch_of_distinct_sessions
from specdec.engine.compute import StepResult
from specdec.engine.sessions import Session, SessionsFull, SessionStore, common_prefix_len
from specdec.errors import Cancelled, ResourceExhausted
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

class LlamaCppProposer(Proposer):
    backend = "llamacpp"

    def __init__(self, model_path: str, max_sessions: int, kv_budget_bytes: int, ttl_s: float,
                 max_draft_tokens: int, threads: int = 0, n_batch: int = 512, overlap_threads: int = 1,
                 lookup_ngram: int = 3, lookup_max_tokens: int = 16, gpu_layers: int = 0) -> None:
        import llama_cpp
        from llama_cpp import _internals as internals
        from llama_cpp import _logger as llama_logger

        # llama.cpp prints its load and graph logs unless told otherwise; keep errors only.
        llama_logger.set_verbose(False)

        self._ll = llama_cpp
        self.model_path = model_path
        self.lookup_ngram = lookup_ngram
        self.lookup_max_tokens = lookup_max_tokens
        self.lock = threading.Lock()
        llama_cpp.llama_backend_init()
        offload = _offloads(llama_cpp, gpu_layers)
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = gpu_layers if offload else 0
        self._model = internals.LlamaModel(path_model=model_path, params=model_params, verbose=False)
        m = self._model.model
        n_layer = llama_cpp.llama_model_n_layer(m)
        n_head = llama_cpp.llama_model_n_head(m)
        n_head_kv = llama_cpp.llama_model_n_head_kv(m)
        head_dim = llama_cpp.llama_model_n_embd(m) // max(1, n_head)
        # K and V, f16 each (llama.cpp's default KV type).
        self.bytes_per_token = 2 * n_layer * n_head_kv * head_dim * 2
        n_ctx_train = llama_cpp.llama_model_n_ctx_train(m)
        slots = min(max_sessions, llama_cpp.llama_max_parallel_sequences())
        pool = int(min(kv_budget_bytes // self.bytes_per_token, slots * n_ctx_train))
        if pool < 64:
            raise ValueError(f"KV budget of {kv_budget_bytes} bytes holds only {pool} tokens of this model")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = pool
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = slots
        params.kv_unified = True  # sessions share one pool; any one may grow to the whole of it
        params.no_perf = True
        # 0 means every whole core this process may use (its affinity and CPU quota). The steps of a
        # Propose that yields cores (the target computes on this host meanwhile) run on
        # overlap_threads instead. On the 2-core machines measured, the embedded draft decoded a
        # token in 8.5-12 ms on two threads and 13-18 ms on one with the cores to itself (with the
        # OpenMP spin bounded, not passive: see specdec.process.SPIN_COUNT); next to a busy target, two
        # threads would wait for each other at every op's barrier.
        nthreads = threads or max(1, int(cpu_cores()))
        self.threads = nthreads
        self.overlap_threads = min(overlap_threads, nthreads) if overlap_threads else nthreads
        self._threads_now = nthreads
        params.n_threads = nthreads
        params.n_threads_batch = nthreads
        self._ctx = internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
        self.n_batch = n_batch
        self._vocab = llama_cpp.llama_model_get_vocab(m)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._free_slots = list(range(slots - 1, -1, -1))
        store = SessionStore(slots, pool * self.bytes_per_token, ttl_s, on_evict=self._free_slot)
        super().__init__(store, max_draft_tokens)

        fingerprint, _, eos = gguf_tokenizer_fingerprint(model_path)
        eog = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)}
        self._eos = eog | set(eos)
        metadata = self._model.metadata()
        self._info = ModelInfo(
            model_id=model_path, architecture=metadata.get("general.architecture", "gguf"), vocab_size=self.n_vocab,
            tokenizer_fingerprint=fingerprint, max_context=min(n_ctx_train, pool),
            dtype=file_type_name(metadata.get("general.file_type", "")),
            device="cuda" if offload else "cpu", backend=self.backend, max_draft_tokens=max_draft_tokens,
            eos_token_ids=sorted(self._eos),
        )
        logger.info("llama.cpp on the %s: %d threads (%d when yielding cores to the target), KV pool %d tokens in %d "
                    "slots (%d B/token)", self._info.device, nthreads, self.overlap_threads, pool, slots,
                    self.bytes_per_token)

    @classmethod
    def from_settings(cls, settings: DraftSettings) -> LlamaCppProposer:
        path = draft_gguf(settings.model, settings.target_model, settings.quant, settings.cache_dir)
        return cls(str(path), settings.max_sessions, settings.kv_budget_bytes,
                   settings.session_ttl_s, settings.max_draft_tokens, settings.threads,
                   overlap_threads=settings.overlap_threads, lookup_ngram=settings.lookup_ngram,
                   lookup_max_tokens=settings.lookup_max_tokens, gpu_layers=settings.gpu_layers)

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    def grammar_tokenizer(self):
        from specdec.models import load_tokenizer

        return load_tokenizer(self.model_path)  # the one the file carries, once, for the first grammar

    def release(self, session_id: str) -> bool:
        with self.lock:
            return super().release(session_id)

    def _free_slot(self, session: Session) -> None:
        if session.cache is not None:
            self._ctx.kv_cache_seq_rm(session.cache, -1, -1)
            self._free_slots.append(session.cache)
            session.cache = None

    def step(self, jobs: list[ProposeJob]) -> StepResult:
        """One ``llama_decode`` over every job waiting (one per session, each its own sequence in
        the shared KV pool): each job advances by one draft token; a job's first step also decodes
        the tokens its sequence missed. Rows beyond the decode batch (``n_batch``) wait for the
        next step, except a lone long prompt, which is decoded in several passes."""
        chosen, outcomes = batch_of_distinct_sessions(jobs)
        plan: list[_Planned] = []
        used = 0
        with self.lock:
            pinned = {jobs[i].session_id for i in chosen}
            taken: set[str] = set()
            for i in chosen:
                job = jobs[i]
                if not job.begin(self._info.max_context):
                    outcomes[i] = job.proposal()
                    continue
                seq = job.tokens + job.drafted
                try:
                    session = self.store.get_or_create(job.session_id, lambda: None, job.issued, taken)
                except Cancelled as exc:  # released since the call was made
                    outcomes[i] = exc
                    continue
                except SessionsFull:  # never evicting a session of this step: the next step
                    continue
                taken.add(job.session_id)
                cached = min(common_prefix_len(session.tokens, seq), len(seq) - 1) if session.cache is not None else 0
                new = len(seq) - cached
                if used and used + new > self.n_batch:
                    continue  # the decode batch is full: next step
                guess = self._guess(job, seq)
                if used + new + len(guess) > self.n_batch or (
                        # a guess never evicts another session's cache
                        self.store.nbytes + (len(seq) + len(guess)) * self.bytes_per_token - session.nbytes
                        > self.store.max_bytes):
                    guess = []
                try:
                    if session.cache is None:
                        if not self._free_slots:  # all slots held: the store's count bound makes this rare
                            raise ResourceExhausted("no free llama.cpp sequence slot")
                        session.cache = self._free_slots.pop()
                        session.tokens = []
                    # Room first: a refusal here leaves the sequence exactly as it was.
                    self.store.reserve(session, (len(seq) + len(guess)) * self.bytes_per_token - session.nbytes, pinned)
                except BaseException as exc:  # noqa: BLE001 - that job's error
                    outcomes[i] = exc
                    continue
                self._ctx.kv_cache_seq_rm(session.cache, cached, -1)
                self.store.update(session, seq[:cached], (len(seq) + len(guess)) * self.bytes_per_token)
                plan.append(_Planned(i, session, seq, cached, guess))
                used += new + len(guess)
            if not plan:
                return StepResult(outcomes)
            self._use_threads(self.overlap_threads if any(jobs[p.index].yield_cores for p in plan) else self.threads)
            try:
                logits = self._decode_groups(plan, jobs)
            except BaseException as exc:
                for p in plan:
                    # The sequence's contents are unknown after a failed decode: start it afresh next time.
                    self._ctx.kv_cache_seq_rm(p.session.cache, -1, -1)
                    self.store.reset(p.session)
                    outcomes[p.index] = exc
                return StepResult(outcomes)
            for p, rows in zip(plan, logits, strict=True):
                job = jobs[p.index]
                if job.cached_tokens < 0:
                    job.cached_tokens = p.cached
                before = len(job.drafted)
                done = self._advance(job, rows, p.guess, len(plan))
                # The cache keeps the guessed tokens the draft drafted itself; the rest leave it.
                taken = common_prefix_len(job.drafted[before:], p.guess)
                if p.guess:
                    self._ctx.kv_cache_seq_rm(p.session.cache, len(p.seq) + taken, -1)
                    LOOKUP_TOKENS.labels("guessed").inc(len(p.guess))
                    LOOKUP_TOKENS.labels("taken").inc(taken)
                    job.guess_len = min(2 * len(p.guess), self.lookup_max_tokens) if taken == len(p.guess) else FIRST_GUESS
                kept = p.seq + p.guess[:taken] if taken else p.seq  # no copy of the sequence per pass
                self.store.update(p.session, kept, len(kept) * self.bytes_per_token)
                if done:
                    outcomes[p.index] = job.proposal()
        return StepResult(outcomes, len(plan), used)

    def _guess(self, job: ProposeJob, seq: list[int]) -> list[int]:
        """Tokens to decode ahead for ``job`` in this pass (see the module doc); [] for none."""
        if not self.lookup_ngram or not job.sampling.greedy:
            return []
        room = job.k - len(job.drafted) - 1  # the pass drafts one token beyond the guess
        if room <= 0:
            return []
        return find_continuation(seq, min(room, job.guess_len or FIRST_GUESS), self.lookup_ngram, self.lookup_ngram)

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

    def _decode_groups(self, plan: list[_Planned], jobs: list[ProposeJob]) -> list[list[torch.Tensor]]:
        """Greedy jobs share one decode; each sampling job is decoded on its own. llama.cpp's batched
        kernels change a sequence's logits with the batch around it (draft probabilities moved by up to
        0.06 on the embedded model), which never changes a greedy output but would make a seeded
        sampling request's draws, and so its output, depend on the load."""
        greedy = [p for p in plan if jobs[p.index].sampling.greedy]
        groups = ([greedy] if greedy else []) + [[p] for p in plan if not jobs[p.index].sampling.greedy]
        logits: dict[int, list[torch.Tensor]] = {}
        for group in groups:
            for p, rows in zip(group, self._decode(group), strict=True):
                logits[p.index] = rows
        return [logits[p.index] for p in plan]

    def _decode(self, plan: list[_Planned]) -> list[list[torch.Tensor]]:
        """Decode each planned sequence's new tokens and guess (at their positions, in their own
        sequence); return, per sequence, the logits after its last token and after each guessed one."""
        rows = [(p.session.cache, tok, pos, pos >= len(p.seq) - 1)
                for p in plan for pos, tok in enumerate(p.seq[p.cached:] + p.guess, start=p.cached)]
        b = self._batch.batch
        wanted: list[int] = []
        for start in range(0, len(rows), self.n_batch):
            chunk = rows[start : start + self.n_batch]
            wanted = []
            for i, (slot, tok, pos, last) in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos
                b.seq_id[i][0] = slot
                b.n_seq_id[i] = 1
                b.logits[i] = last
                if last:
                    wanted.append(i)
            b.n_tokens = len(chunk)
            rc = self._ll.llama_decode(self._ctx.ctx, b)
            if rc == 1:
                raise ResourceExhausted("llama.cpp KV pool has no room for these sequences")
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        # Several passes happen only for a lone long sequence (with no guess), whose one wanted row
        # is in the last.
        out, at = [], 0
        for p in plan:
            out.append([self._logits(i) for i in wanted[at : at + 1 + len(p.guess)]])
            at += 1 + len(p.guess)
        return out

    def _logits(self, row: int) -> torch.Tensor:
        ptr = self._ll.llama_get_logits_ith(self._ctx.ctx, row)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())


@dataclasses.dataclass
class _Planned:
    """A job's part of a pass: its new tokens (``seq[cached:]``) and the guess decoded after them."""

    index: int  # of the job in the step's list
    session: Session
    seq: list[int]  # the job's sequence so far (request tokens + drafted)
    cached: int  # leading tokens of seq already in its cache
    guess: list[int]
