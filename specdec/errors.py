"""Domain errors raised by engines; servicers map them to gRPC status codes.

Engines never import grpc: each error names the status a client should see, so "your input is
wrong" (INVALID_ARGUMENT), "no room right now" (RESOURCE_EXHAUSTED) and "the server broke"
(INTERNAL) stay distinguishable.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class; ``code`` is the name of the grpc.StatusCode a servicer should return."""

    code = "INTERNAL"


class InvalidArgument(SpecdecError, ValueError):
    """The request is malformed: bad ids, empty sequences, out-of-range parameters."""

    code = "INVALID_ARGUMENT"


class ResourceExhausted(SpecdecError):
    """The request cannot fit (KV budget full with nothing evictable)."""

    code = "RESOURCE_EXHAUSTED"


class NotFound(SpecdecError):
    """A named thing (model file, session) does not exist."""

    code = "NOT_FOUND"


class Cancelled(SpecdecError):
    """The caller went away (deadline passed, client cancelled) before the work ran."""

    code = "CANCELLED"


class Unavailable(SpecdecError):
    """The service cannot take the call now (shutting down); another replica or a retry may."""

    code = "UNAVAILABLE"
