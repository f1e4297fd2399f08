"""protobuf <-> domain conversions shared by servicers and clients."""

from __future__ import annotations

from typing import Any

from specdec import process
from specdec.params import ModelInfo, Sampling
from specdec.v1 import specdec_pb2 as pb


def sampling_from_pb(msg: pb.SamplingParams) -> Sampling:
    # proto3 zero values mean "off": top_p 0 is no nucleus filtering.
    top_p = msg.top_p if msg.top_p > 0 else 1.0
    return Sampling(temperature=msg.temperature, top_p=top_p, top_k=msg.top_k, seed=msg.seed, grammar=msg.grammar,
                       output_start=msg.output_start, presence_penalty=msg.presence_penalty,
                       frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty or 1.0,
                       logit_bias=tuple(sorted(msg.logit_bias.items())), min_p=msg.min_p)


def sampling_to_pb(s: Sampling) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, grammar=s.grammar,
                             output_start=s.output_start, presence_penalty=s.presence_penalty,
                             frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
                             min_p=s.min_p, logit_bias=dict(s.logit_bias))


def info_to_pb(info: ModelInfo, scheduler: Any = None) -> pb.InfoResponse:
    """``scheduler``: the service's SchedulerStats (specdec.engine.compute), when it has a scheduler."""
    stats = pb.SchedulerStats(**vars(scheduler)) if scheduler is not None else None
    return pb.InfoResponse(
        model_id=info.model_id,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        max_context=info.max_context,
        dtype=info.dtype,
        device=info.device,
        backend=info.backend,
        max_draft_tokens=info.max_draft_tokens,
        sessions=info.sessions,
        kv_bytes=info.kv_bytes,
        kv_budget_bytes=info.kv_budget_bytes,
        eos_token_ids=info.eos_token_ids,
        scheduler=stats,
        host_id=process.host_id(),
        cpu_cores=process.cpu_cores(),
    )
