"""HTTPS /metrics whose certificate follows the files as they rotate, as the gRPC port's does.

prometheus_client's server wraps its listening socket once, with a context made from the files at
start; every accepted connection is wrapped with that socket's context. When the watcher sees the
files rotate to a valid pair, a fresh context replaces the socket's, so new scrapes get the new
certificate and a scrape in flight keeps its own (cert-manager renews every 20 days; without this a
pod would serve an expired certificate on /metrics after 30).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable

from services.common.cert_files import CertificateWatcher, TlsFiles

log = logging.getLogger(__name__)


class RotatingMetricsCertificate:
    def __init__(self, listening_socket: ssl.SSLSocket, files: TlsFiles, clock: Callable[[], float]) -> None:
        self._socket = listening_socket
        self._files = files
        self._watcher = CertificateWatcher(files, clock)
        self.num_reloads = 0

    def refresh(self) -> bool:
        """Swap in a context with the new certificate if the files rotated; True when it did."""
        if self._watcher.poll() is None:
            return False
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self._files.cert_path, self._files.key_path)
        except (OSError, ssl.SSLError) as exc:  # rotated again between the check and this read
            log.warning("/metrics keeps its certificate: %s", exc)
            return False
        # SSLSocket.accept() wraps each connection with `self.context`, which reads `_context`; the
        # public setter needs a connected socket, which a listening one is not.
        self._socket._context = context  # type: ignore[attr-defined]
        self.num_reloads += 1
        log.info("/metrics certificate reloaded from %s", self._files.cert_path)
        return True
