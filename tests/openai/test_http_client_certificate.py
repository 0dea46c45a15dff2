"""The HTTP port's client certificates (--tls-client-auth optional | require): the caller's verified
SAN names reach the fronts (fronts/caller.py, http_authorization), a connection without a certificate
is served under optional and refused at the handshake under require."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from services.common.cert_files import TlsFiles
from services.common.config import ConfigError
from services.gateway.fronts.caller import http_authorization
from services.gateway.fronts.http_server import HttpServer
from services.gateway.tenants.credentials import Credentials
from tests.support.tls_fixtures import DevPki
from tools.testbed.processes import free_port


class _WhoAmI:
    """One route that answers what http_authorization saw."""

    def routes(self) -> list:
        async def whoami(request: web.Request) -> web.Response:
            seen = http_authorization(request)
            if isinstance(seen, Credentials):
                return web.Response(text=f"{seen.authorization} {' '.join(seen.peer.names)}")
            return web.Response(text=f"{seen} -")
        return [web.get("/whoami", whoami)]

    async def close(self) -> None:
        pass


def _get(port: int, pki: DevPki, folder: Path, cert: str | None) -> str:
    context = ssl.create_default_context(cadata=pki.ca.cert_pem.decode())
    if cert is not None:
        issued = pki.ca.issue(cert, uris=[f"spiffe://clients.test/ns/{cert}"], dns_names=[f"{cert}.clients.test"])
        (folder / "c.pem").write_bytes(issued.cert_pem)
        (folder / "c-key.pem").write_bytes(issued.key_pem)
        context.load_cert_chain(folder / "c.pem", folder / "c-key.pem")
    request = urllib.request.Request(f"https://127.0.0.1:{port}/whoami", headers={"Authorization": "Bearer k"})
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.read().decode()
    except (urllib.error.URLError, ssl.SSLError, ConnectionError) as exc:
        return f"refused: {type(exc).__name__}"


async def _serve(tmp_path: Path, mode: str) -> tuple[HttpServer, int, DevPki]:
    pki = DevPki.create(tmp_path / "pki")
    files = pki.files["gateway"]
    port = free_port()
    server = HttpServer(_WhoAmI(), "127.0.0.1", port, TlsFiles(str(files.cert_path), str(files.key_path),
                                                              str(files.ca_path)),
                        max_body_bytes=1 << 20, client_cert=mode)
    await server.start()
    return server, port, pki


async def test_optional_serves_callers_with_and_without_a_certificate(tmp_path):
    server, port, pki = await _serve(tmp_path, "optional")
    try:
        with_cert = await asyncio.to_thread(_get, port, pki, tmp_path, "search")
        without = await asyncio.to_thread(_get, port, pki, tmp_path, None)
    finally:
        await server.close()
    assert with_cert == "Bearer k spiffe://clients.test/ns/search search.clients.test"
    assert without == "Bearer k -"


async def test_require_refuses_a_connection_without_a_certificate(tmp_path):
    server, port, pki = await _serve(tmp_path, "require")
    try:
        without = await asyncio.to_thread(_get, port, pki, tmp_path, None)
        with_cert = await asyncio.to_thread(_get, port, pki, tmp_path, "search")
    finally:
        await server.close()
    assert without.startswith("refused")
    assert with_cert.startswith("Bearer k spiffe://clients.test/ns/search")


async def test_none_never_asks(tmp_path):
    server, port, pki = await _serve(tmp_path, "none")
    try:
        assert await asyncio.to_thread(_get, port, pki, tmp_path, "search") == "Bearer k -"
    finally:
        await server.close()


def test_client_certificates_need_a_ca_file(tmp_path):
    with pytest.raises(ConfigError, match="need TLS and --tls-ca-file"):
        HttpServer(_WhoAmI(), "127.0.0.1", free_port(), TlsFiles("c.pem", "k.pem", ""), max_body_bytes=1,
                   client_cert="optional")


def _handshake(port: int, context: ssl.SSLContext, session: ssl.SSLSession | None = None
               ) -> tuple[bool, ssl.SSLSession | None]:
    """(served, the session to resume with) of one GET over a raw TLS connection."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost", session=session) as tls:
                tls.sendall(b"GET /whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                reply = b""
                while chunk := tls.recv(4096):
                    reply += chunk
                return reply.startswith(b"HTTP/1.1 200"), tls.session
        except (ssl.SSLError, ConnectionError):
            return False, None


async def test_a_resumed_session_cannot_outlive_its_ca_and_tls_1_2_is_refused(tmp_path):
    server, port, pki = await _serve(tmp_path, "require")
    files = pki.files["gateway"]
    issued = pki.ca.issue("search", uris=["spiffe://clients.test/ns/search"])
    (tmp_path / "c.pem").write_bytes(issued.cert_pem)
    (tmp_path / "c-key.pem").write_bytes(issued.key_pem)

    def client(version: ssl.TLSVersion) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=pki.ca.cert_pem.decode())
        context.load_cert_chain(tmp_path / "c.pem", tmp_path / "c-key.pem")
        context.maximum_version = version
        return context

    try:
        tls13 = client(ssl.TLSVersion.TLSv1_3)
        served, session = await asyncio.to_thread(_handshake, port, tls13)
        assert served
        assert (await asyncio.to_thread(_handshake, port, client(ssl.TLSVersion.TLSv1_2)))[0] is False
        other_ca = DevPki.create(tmp_path / "other").ca
        files.ca_path.write_bytes(other_ca.cert_pem)  # the callers' CA leaves the bundle
        give_up = asyncio.get_running_loop().time() + 10
        while (await asyncio.to_thread(_handshake, port, tls13))[0]:
            assert asyncio.get_running_loop().time() < give_up, "the bundle was not reloaded"
            await asyncio.sleep(0.2)
        assert (await asyncio.to_thread(_handshake, port, tls13, session))[0] is False
    finally:
        await server.close()
