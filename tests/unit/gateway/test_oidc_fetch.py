"""The optional JWKS fetcher against a local OIDC issuer on 127.0.0.1: it writes what the gateway
reads, and refuses (keeping the old file) an issuer mismatch, plain http and unusable keys."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from services.gateway.tenants.jwks import JwksFiles
from services.gateway.tenants.oidc_fetch import FetchError, fetch_jwks, main
from tools.testbed.jwt_issuer import TestIssuer

REPO = Path(__file__).resolve().parents[3]


class LocalIssuer:
    """Serves a discovery document and a JWKS; a test may change either."""

    def __init__(self) -> None:
        self.keys = TestIssuer()
        self.keys.add_key("k1")
        documents = self.documents = {}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = documents.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/realms/mesh"
        self.set(issuer=self.url, jwks=self.keys.jwks())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def set(self, issuer: str, jwks: object) -> None:
        self.documents["/realms/mesh/.well-known/openid-configuration"] = json.dumps(
            {"issuer": issuer, "jwks_uri": self.url + "/certs"}).encode()
        self.documents["/realms/mesh/certs"] = json.dumps(jwks).encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def idp():
    issuer = LocalIssuer()
    yield issuer
    issuer.close()


def test_writes_a_jwks_file_the_gateway_reads(idp, tmp_path):
    out = tmp_path / "jwks.json"
    assert main(["--issuer", idp.url, "--out", str(out), "--allow-http"]) == 0
    assert set(JwksFiles((str(out),)).keys((str(out),))) == {"k1"}


def test_refuses_a_discovery_document_of_another_issuer_and_keeps_the_file(idp, tmp_path):
    out = tmp_path / "jwks.json"
    out.write_text('{"keys": []}')
    idp.set(issuer="https://evil.invalid", jwks=idp.keys.jwks())
    assert main(["--issuer", idp.url, "--out", str(out), "--allow-http"]) == 1
    assert out.read_text() == '{"keys": []}'
    with pytest.raises(FetchError, match="names issuer 'https://evil.invalid'"):
        fetch_jwks(idp.url, allow_http=True)


def test_refuses_plain_http_unless_allowed(idp):
    with pytest.raises(FetchError, match="only https URLs"):
        fetch_jwks(idp.url)


def test_refuses_unusable_keys(idp):
    idp.set(issuer=idp.url, jwks={"keys": [{"kty": "oct", "kid": "s", "k": "c2VjcmV0"}]})
    with pytest.raises(FetchError, match="kty must be one of"):
        fetch_jwks(idp.url, allow_http=True)


def test_the_command_is_reachable_from_the_tenants_module(idp, tmp_path):
    out = tmp_path / "jwks.json"
    done = subprocess.run([sys.executable, "-m", "services.gateway.tenants", "fetch-jwks", "--issuer", idp.url,
                           "--out", str(out), "--allow-http"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["keys"][0]["kid"] == "k1"
