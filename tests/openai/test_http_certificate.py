"""The HTTP port's certificate follows rotation of the gateway's files (as the gRPC port and /metrics do)."""

from __future__ import annotations

import asyncio
import ssl
import time

from cryptography import x509

from services.common.cert_files import TlsFiles
from services.gateway.fronts.http_server import HttpServer
from tests.support.tls_fixtures import DevPki
from tools.testbed.processes import free_port


class _NoRoutes:
    def routes(self) -> list:
        return []

    async def close(self) -> None:
        pass


def _serial(port: int) -> int:
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=5)
    return x509.load_pem_x509_certificate(pem.encode()).serial_number


async def test_new_connections_get_the_rotated_certificate(tmp_path):
    pki = DevPki.create(tmp_path / "pki")
    files = pki.files["gateway"]
    port = free_port()
    server = HttpServer(_NoRoutes(), "127.0.0.1", port, TlsFiles(str(files.cert_path), str(files.key_path), ""),
                        max_body_bytes=1 << 20)
    await server.start()
    try:
        first = await asyncio.to_thread(_serial, port)
        rotated = pki.ca.issue_service("gateway")
        rotated.write(files.cert_path, files.key_path)
        new_serial = x509.load_pem_x509_certificate(rotated.cert_pem).serial_number
        give_up = time.monotonic() + 10
        while (served := await asyncio.to_thread(_serial, port)) != new_serial and time.monotonic() < give_up:
            await asyncio.sleep(0.2)
        assert (first != new_serial, served) == (True, new_serial)
    finally:
        await server.close()
