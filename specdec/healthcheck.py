"""``python -m specdec.healthcheck TARGET [SERVICE]``: exit 0 when TARGET is healthy, else 1.

The container health checks of compose.yaml, with nothing but the image's Python (slim images
have no curl or grpc_health_probe):

- ``host:port``: a gRPC server answering the standard ``grpc.health.v1.Health/Check`` with
  SERVING, for SERVICE (default ``""``: the whole server), e.g. ``localhost:50051``;
- ``http://...`` or ``https://...``: a URL answering 2xx, e.g. ``http://localhost:8000/ready``.

The reason of a failure is written as one line to stderr, which ``docker inspect`` shows.

A model service serving TLS is checked over TLS: ``--tls-ca`` (and for mutual TLS ``--tls-cert``
and ``--tls-key``), or the variables ``SPECDEC_HEALTHCHECK_TLS_CA_FILE``, ``…_TLS_CERT_FILE``,
``…_TLS_KEY_FILE`` and ``…_TLS_SERVER_NAME``, which let the compose health check keep its command.
The health service needs no token.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.auth import ChannelSecurity

# Defaults of the --tls-* flags, so a TLS deployment configures the unchanged compose command.
ENV_PREFIX = "SPECDEC_HEALTHCHECK_TLS_"


def check_grpc(address: str, service: str = "", timeout_s: float = 3.0,
               security: ChannelSecurity | None = None) -> str | None:
    """None when the gRPC server at ``address`` reports ``service`` SERVING, else the reason.

    ``security`` with a CA switches to TLS; the default is plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.auth import channel as open_channel

    with open_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{address}: {exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def check_http(url: str, timeout_s: float = 3.0) -> str | None:
    """None when ``url`` answers with a 2xx status, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as exc:  # 4xx/5xx: the server is up but not healthy
        body = exc.read(300).decode("utf-8", "replace").strip()
        return f"{url}: HTTP {exc.code} {body}".rstrip()
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {getattr(exc, 'reason', exc)}"
    return None if 200 <= status < 300 else f"{url}: HTTP {status}"


def check(target: str, service: str = "", timeout_s: float = 3.0, security: ChannelSecurity | None = None) -> str | None:
    """Dispatch on the form of ``target``: an http(s) URL or a gRPC ``host:port``."""
    if target.startswith(("http://", "https://")):
        return check_http(target, timeout_s)
    return check_grpc(target, service, timeout_s, security)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="gRPC host:port, or an http(s) URL")
    parser.add_argument("service", nargs="?", default="", help="gRPC service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    env = os.environ.get
    parser.add_argument("--tls-ca", default=env(f"{ENV_PREFIX}CA_FILE"), help="gRPC over TLS, trusting this PEM CA")
    parser.add_argument("--tls-cert", default=env(f"{ENV_PREFIX}CERT_FILE"), help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", default=env(f"{ENV_PREFIX}KEY_FILE"), help="private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=env(f"{ENV_PREFIX}SERVER_NAME"),
                        help="name expected in the server's certificate (default: the host of TARGET)")
    args = parser.parse_args(argv)
    security = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        from specdec.auth import ChannelSecurity

        try:
            security = ChannelSecurity.from_files(ca_file=args.tls_ca or None, cert_file=args.tls_cert or None,
                                                  key_file=args.tls_key or None, server_name=args.tls_server_name)
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"unhealthy: {exc}\n")
            return 1
    reason = check(args.target, args.service, args.timeout, security)
    if reason is not None:
        sys.stderr.write(f"unhealthy: {reason}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
