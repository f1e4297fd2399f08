"""What the draft-length controllers decide under and learn from: the :class:`Load` of the next
step (streams in progress, overlap, where each party computes) and the :class:`StepObservation`
of the step just done."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepObservation:
    """What one step cost and yielded."""

    k: int  # draft length asked for
    proposed: int  # draft tokens actually proposed (early stop can make it < k)
    accepted: int  # draft tokens the target accepted
    draft_ms: float  # wall time of Propose as the client saw it (0 when no draft)
    verify_ms: float  # wall time of Verify as the client saw it
    draft_compute_ms: float = 0.0  # server-side compute of Propose
    draft_catch_up: int = 1  # tokens the draft processed besides its proposals (missed since its last call)
    warm: bool = True  # False for the first step, whose cost is dominated by the prompt's prefill
    verify_rows: int = 0  # token rows of the batched forward that verified it, all sessions (0: unknown)
    verify_sessions: int = 1  # sessions in that forward
    draft_sessions: float = 1.0  # mean sessions per batched draft step of the Propose
    verify_cpu_ms: float = 0.0  # CPU time of the target's process on that forward (0: unknown)
    draft_step_cpu_ms: float = 0.0  # mean CPU time of the draft's process per draft step (0: unknown)
    predrafted: bool = False  # overlapped mode: the draft was made during the previous Verify


Site = tuple[str, float]  # where a service computes and its capacity: see compute_site


@dataclass(frozen=True)
class Topology:
    """Where each party computes (from the services' Info; None: unknown, no CPU term)."""

    target: Site | None = None
    draft: Site | None = None
    own: Site | None = None  # this process

    def draft_shares_target(self) -> bool:
        return self.target is not None and self.draft is not None and self.target[0] == self.draft[0]


@dataclass(frozen=True)
class Load:
    """What the next step is decided under, as the loop sees it: an input of :meth:`Controller.next_k`."""

    streams: int = 1  # generations in progress through this process, this one included
    overlap: bool = False  # the step runs overlapped (see CostController)
    topology: Topology = Topology()


ALONE = Load()  # one stream, alternating, hosts unknown


def compute_site(host_id: str, device: str, cpu_cores: float) -> tuple[str, float] | None:
    """Where a model service computes, from its Info: (site, capacity), None when its host is unknown.

    Services whose sites are equal compete for the same compute. A service on the CPU computes on
    its host's cores: the site is the host (``host_id``) and the capacity its cores. One on an
    accelerator computes there: the site is the host and the device (a bare ``cuda`` is device 0,
    as torch and llama.cpp take it), with the capacity of one device running one pass at a time.
    So a target on ``cuda:0`` and a draft on the CPU of the same host do not share compute (the
    target's host-side work, launching kernels, is small next to a CPU draft's), while two
    services on one GPU do.
    """
    if not host_id:
        return None
    kind = device.split(":", 1)[0]
    if kind in ("", "cpu"):
        return host_id, cpu_cores
    return f"{host_id}/{device if ':' in device else device + ':0'}", 1.0
