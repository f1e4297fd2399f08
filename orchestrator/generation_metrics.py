"""The Prometheus metrics of generation (the loop's counters, gauges and histograms), and the
per-step count every step of orchestrator.loop adds to them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DRAFTS = Counter("specdec_drafts_total", "Steps that verified a non-empty draft.")
DRAFT_TOKENS = Counter("specdec_draft_tokens_total", "Draft tokens proposed and verified.")
ACCEPTED_TOKENS = Counter("specdec_accepted_tokens_total", "Draft tokens the target accepted.")
ACCEPTED_PER_POSITION = Counter(
    "specdec_accepted_per_position_total", "Accepted draft tokens by position in the draft (0-based).", ["position"]
)
GENERATED_TOKENS = Counter("specdec_generated_tokens_total", "Tokens generated (accepted + target tokens).", ["mode"])
STEPS = Counter("specdec_steps_total", "Loop iterations (one target forward pass each).", ["mode"])
K_CHOSEN = Histogram("specdec_k", "Draft length chosen per step.", buckets=tuple(range(0, 17)))
TOKENS_PER_SECOND = Histogram(
    "specdec_request_tokens_per_second", "Generation speed per request.", ["mode"],
    buckets=(1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 240, 320),
)
DRAFT_FALLBACKS = Counter("specdec_draft_fallbacks_total", "Steps run without a draft because the draft failed.", ["reason"])
ACTIVE = Gauge("specdec_active_requests", "Generations in progress.")
# The same figures under vLLM's names, buckets and model_name label (prefix specdec: for vllm:), so a
# dashboard made for vLLM works with the prefix changed (README, "Observability"). Latencies
# are timed from the start of the generation (after tokenisation and admission).
_MODEL = ["model_name"]
TTFT = Histogram("specdec:time_to_first_token_seconds", "Time to the first generated token.", _MODEL,
                 buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0, 160.0, 640.0, 2560.0))
ITL = Histogram("specdec:inter_token_latency_seconds", "Time between two steps' tokens (one observation per step, "
                "as vLLM's: a speculative step lands several tokens).", _MODEL,
                buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                         40.0, 80.0))
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
E2E = Histogram("specdec:e2e_request_latency_seconds", "Wall time of a whole generation.", _MODEL,
                buckets=_REQUEST_BUCKETS)
QUEUE_TIME = Histogram("specdec:request_queue_time_seconds", "Time a generation waited for a slot in the "
                       "orchestrator's admission queue plus the time its first Verify waited in the target's queue "
                       "before its forward pass.", _MODEL, buckets=_REQUEST_BUCKETS)
NUM_DRAFTS = Counter("specdec:spec_decode_num_drafts", "Steps that verified a non-empty draft.", _MODEL)
NUM_DRAFT_TOKENS = Counter("specdec:spec_decode_num_draft_tokens", "Draft tokens verified.", _MODEL)
NUM_ACCEPTED = Counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", _MODEL)
NUM_ACCEPTED_PER_POS = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted draft tokens by position in the draft (0-based).", ["model_name", "position"])
PROMPT_TOKENS = Counter("specdec:prompt_tokens", "Prompt tokens of the generations started.", _MODEL)
GENERATION_TOKENS = Counter("specdec:generation_tokens", "Tokens generated.", _MODEL)
RUNNING = Gauge("specdec:num_requests_running", "Generations in progress.", _MODEL)

PREFIX_TOKENS = Counter(
    "specdec_target_prefix_tokens_total",
    "Committed tokens sent to Verify, by whether the target found them in the session's KV cache "
    "(cached) or computed them again (computed: the prompt's prefill, or a re-prefill after a replica moved).",
    ["source"],
)


def count_step(mode: str, generated: int, proposed: int, accepted: int, model: str = "") -> None:
    """One step's tokens: ``generated`` landed, ``proposed`` drafted, ``accepted`` of them taken."""
    STEPS.labels(mode).inc()
    GENERATED_TOKENS.labels(mode).inc(generated)
    GENERATION_TOKENS.labels(model).inc(generated)
    if proposed:
        DRAFTS.inc()
        DRAFT_TOKENS.inc(proposed)
        ACCEPTED_TOKENS.inc(accepted)
        NUM_DRAFTS.labels(model).inc()
        NUM_DRAFT_TOKENS.labels(model).inc(proposed)
        NUM_ACCEPTED.labels(model).inc(accepted)
        for pos in range(accepted):
            ACCEPTED_PER_POSITION.labels(str(pos)).inc()
            NUM_ACCEPTED_PER_POS.labels(model, str(pos)).inc()
