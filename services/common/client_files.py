"""Blocking client channels from certificate files a tool or probe is given (CLI flags, a pod's env).

Kept apart from tls.py, which checks and watches a service's own files with `cryptography`: the
kubelet runs the health probe every few seconds, and importing that costs it ~40 ms of CPU each time.
"""

from __future__ import annotations

import grpc


def credentials_from_files(ca_file: str = "", cert_file: str = "", key_file: str = ""
                           ) -> grpc.ChannelCredentials | None:
    """For tools and probes that are given their files: trust ca_file (system roots when empty) and
    present cert_file/key_file when given; None when neither a CA nor a certificate is (plaintext).
    Raises OSError for a file it cannot read."""
    if not ca_file and not cert_file:
        return None
    ca_pem = _read_file(ca_file) if ca_file else None
    if not cert_file:
        return grpc.ssl_channel_credentials(ca_pem)
    return grpc.ssl_channel_credentials(ca_pem, _read_file(key_file), _read_file(cert_file))


def open_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A blocking channel: TLS with these credentials, plaintext without."""
    if credentials is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
