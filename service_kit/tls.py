"""TLS on the gateway's public ports (gRPC and HTTP), from PEM files, and the client side of it.

The gateway serves TLS when given `--ssl-certfile` and `--ssl-keyfile` (vLLM's flag names). The certificate file
holds the chain, leaf first. Internal hops (gateway -> verifier -> drafter) stay on the private network in
plaintext. Clients (`ddtree generate`, `ddtree health`) connect with `--tls` to trust the system's roots, or
`--tls-ca FILE` to trust the roots in FILE (e.g. a private CA); `--tls-server-name` checks the certificate against
another name than the address's host.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


def read_pair(certfile: str, keyfile: str) -> tuple[bytes, bytes]:
    """(certificate chain, private key) PEM bytes; ValueError naming the option whose file is unusable."""
    out = []
    for name, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: cannot read {path}: {e.strerror}") from e
        if b"-----BEGIN" not in data:
            raise ValueError(f"{name}: {path} is not PEM")
        out.append(data)
    return out[0], out[1]


def server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    chain, key = read_pair(certfile, keyfile)
    return grpc.ssl_server_credentials([(key, chain)])


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The HTTP port's context (TLS 1.2 and later, the `ssl` module's defaults)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"ssl_certfile, ssl_keyfile: {e}") from e
    return ctx


def channel(address: str, *, tls: bool = False, ca_file: str | None = None, server_name: str | None = None,
            options=None) -> grpc.Channel:
    """A sync channel to `address`: plaintext, or TLS trusting `ca_file`'s roots (else the system's) and checking
    the certificate against `server_name` (else the address's host: a health check on localhost of a gateway whose
    certificate names its public host passes that host)."""
    if not (tls or ca_file or server_name):
        return grpc.insecure_channel(address, options=options)
    roots = Path(ca_file).read_bytes() if ca_file else None
    options = [*(options or []), *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots), options=options)


def client_channel(args) -> grpc.Channel:
    """The channel of a command-line client's --address and its `add_client_arguments` flags."""
    return channel(args.address, tls=args.tls, ca_file=args.tls_ca, server_name=args.tls_server_name)


def add_client_arguments(p) -> None:
    """`--tls` / `--tls-ca` of the command-line clients."""
    p.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's root certificates")
    p.add_argument("--tls-ca", metavar="FILE", help="connect over TLS, trusting the PEM root certificates in FILE")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="connect over TLS, checking the certificate against NAME instead of the address's host")
