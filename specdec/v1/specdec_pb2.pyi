from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftStopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_STOP_REASON_UNSPECIFIED: _ClassVar[DraftStopReason]
    DRAFT_STOP_REASON_MAX_TOKENS: _ClassVar[DraftStopReason]
    DRAFT_STOP_REASON_LOW_CONFIDENCE: _ClassVar[DraftStopReason]
    DRAFT_STOP_REASON_EOS: _ClassVar[DraftStopReason]
    DRAFT_STOP_REASON_CONTEXT_LIMIT: _ClassVar[DraftStopReason]
    DRAFT_STOP_REASON_NO_CANDIDATE: _ClassVar[DraftStopReason]
DRAFT_STOP_REASON_UNSPECIFIED: DraftStopReason
DRAFT_STOP_REASON_MAX_TOKENS: DraftStopReason
DRAFT_STOP_REASON_LOW_CONFIDENCE: DraftStopReason
DRAFT_STOP_REASON_EOS: DraftStopReason
DRAFT_STOP_REASON_CONTEXT_LIMIT: DraftStopReason
DRAFT_STOP_REASON_NO_CANDIDATE: DraftStopReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "grammar", "output_start", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    grammar: str
    output_start: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., grammar: _Optional[str] = ..., output_start: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "max_draft_tokens", "confidence_threshold", "sampling", "return_distributions", "yield_cores")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    YIELD_CORES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    max_draft_tokens: int
    confidence_threshold: float
    sampling: SamplingParams
    return_distributions: bool
    yield_cores: bool
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., max_draft_tokens: _Optional[int] = ..., confidence_threshold: _Optional[float] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_distributions: _Optional[bool] = ..., yield_cores: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_tokens", "confidences", "stop_reason", "distributions", "cached_tokens", "compute_ns", "batch_sessions", "steps", "queue_ns", "step_cpu_ns")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_CPU_NS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: DraftStopReason
    distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    cached_tokens: int
    compute_ns: int
    batch_sessions: float
    steps: int
    queue_ns: int
    step_cpu_ns: int
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[_Union[DraftStopReason, str]] = ..., distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., compute_ns: _Optional[int] = ..., batch_sessions: _Optional[float] = ..., steps: _Optional[int] = ..., queue_ns: _Optional[int] = ..., step_cpu_ns: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "draft_tokens", "sampling", "draft_distributions", "return_target_probs", "yield_cores", "return_logprobs", "top_logprobs", "processed_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    YIELD_CORES_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    draft_distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    return_target_probs: bool
    yield_cores: bool
    return_logprobs: bool
    top_logprobs: int
    processed_logprobs: bool
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., draft_distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., return_target_probs: _Optional[bool] = ..., yield_cores: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., processed_logprobs: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "target_probs", "next_token_prob", "cached_tokens", "compute_ns", "batch_sessions", "batch_rows", "queue_ns", "step_cpu_ns", "logprobs")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_PROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_CPU_NS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    target_probs: _containers.RepeatedScalarFieldContainer[float]
    next_token_prob: float
    cached_tokens: int
    compute_ns: int
    batch_sessions: int
    batch_rows: int
    queue_ns: int
    step_cpu_ns: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., target_probs: _Optional[_Iterable[float]] = ..., next_token_prob: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., compute_ns: _Optional[int] = ..., batch_sessions: _Optional[int] = ..., batch_rows: _Optional[int] = ..., queue_ns: _Optional[int] = ..., step_cpu_ns: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "tokenizer_fingerprint", "max_context", "dtype", "device", "backend", "max_draft_tokens", "sessions", "kv_bytes", "kv_budget_bytes", "eos_token_ids", "scheduler", "host_id", "cpu_cores")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context: int
    dtype: str
    device: str
    backend: str
    max_draft_tokens: int
    sessions: int
    kv_bytes: int
    kv_budget_bytes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    scheduler: SchedulerStats
    host_id: str
    cpu_cores: float
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., backend: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., scheduler: _Optional[_Union[SchedulerStats, _Mapping]] = ..., host_id: _Optional[str] = ..., cpu_cores: _Optional[float] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("forwards", "sessions", "rows", "busy_ns", "calls", "queue_wait_ns", "queued", "max_queued", "cpu_ns", "gather_ns", "gather_waits")
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    CPU_NS_FIELD_NUMBER: _ClassVar[int]
    GATHER_NS_FIELD_NUMBER: _ClassVar[int]
    GATHER_WAITS_FIELD_NUMBER: _ClassVar[int]
    forwards: int
    sessions: int
    rows: int
    busy_ns: int
    calls: int
    queue_wait_ns: int
    queued: int
    max_queued: int
    cpu_ns: int
    gather_ns: int
    gather_waits: int
    def __init__(self, forwards: _Optional[int] = ..., sessions: _Optional[int] = ..., rows: _Optional[int] = ..., busy_ns: _Optional[int] = ..., calls: _Optional[int] = ..., queue_wait_ns: _Optional[int] = ..., queued: _Optional[int] = ..., max_queued: _Optional[int] = ..., cpu_ns: _Optional[int] = ..., gather_ns: _Optional[int] = ..., gather_waits: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
