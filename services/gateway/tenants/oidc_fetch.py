"""Fetch an OIDC issuer's JWKS into the file the gateway reads (an optional sidecar or cron job).

    python -m services.gateway.tenants fetch-jwks --issuer https://idp.example/realms/mesh \\
        --out /etc/infermesh/jwks/idp.json [--every-s 300]

The gateway itself never goes to the network for keys (tenants/jwks.py reads files): this command
is the only part that does, and only when an operator runs it. It reads the issuer's discovery
document (`<issuer>/.well-known/openid-configuration`), checks that it names the same issuer (OIDC
Discovery 1.0, section 4.3: otherwise another issuer's keys could be planted), fetches `jwks_uri`,
checks the keys as the gateway will (tenants/jwks.py), and replaces the file atomically. A failed
fetch leaves the previous file in place. https only, unless --allow-http (tests on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.gateway.tenants.jwks import MAX_JWKS_BYTES, JwksError, parse_jwks

log = logging.getLogger(__name__)
DISCOVERY_PATH = "/.well-known/openid-configuration"


class FetchError(RuntimeError):
    """The discovery document or the JWKS could not be fetched or is not usable."""


def _get(url: str, timeout_s: float, allow_http: bool) -> bytes:
    if not url.startswith("https://") and not (allow_http and url.startswith("http://")):
        raise FetchError(f"{url}: only https URLs are fetched (--allow-http for a local test issuer)")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - scheme checked above
            body = response.read(MAX_JWKS_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError(f"{url}: {exc}") from None
    if len(body) > MAX_JWKS_BYTES:
        raise FetchError(f"{url}: more than {MAX_JWKS_BYTES} bytes")
    return body


def fetch_jwks(issuer: str, timeout_s: float = 10.0, allow_http: bool = False) -> bytes:
    """The issuer's JWKS document, checked; raises FetchError naming the URL and the problem."""
    discovery_url = issuer.rstrip("/") + DISCOVERY_PATH
    try:
        discovery = json.loads(_get(discovery_url, timeout_s, allow_http))
    except ValueError:
        raise FetchError(f"{discovery_url}: not JSON") from None
    if not isinstance(discovery, dict) or discovery.get("issuer") != issuer:
        named = discovery.get("issuer") if isinstance(discovery, dict) else None
        raise FetchError(f"{discovery_url}: names issuer {named!r}, not {issuer!r}")
    jwks_uri = discovery.get("jwks_uri")
    if not isinstance(jwks_uri, str):
        raise FetchError(f"{discovery_url}: no jwks_uri")
    body = _get(jwks_uri, timeout_s, allow_http)
    try:
        keys = parse_jwks(body, jwks_uri)
    except JwksError as exc:
        raise FetchError(str(exc)) from None
    if not keys:
        raise FetchError(f"{jwks_uri}: no signing keys")
    return body


def write_atomically(path: Path, data: bytes) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    with open(staging, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(staging, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway.tenants fetch-jwks",
                                     description="Write an OIDC issuer's JWKS to the file the gateway reads.")
    parser.add_argument("--issuer", required=True, help="the issuer, exactly as tokens carry it in 'iss'")
    parser.add_argument("--out", required=True, type=Path, help="the JWKS file (a jwks_files entry)")
    parser.add_argument("--every-s", type=float, default=0.0, help="fetch again every this many seconds; 0: once")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--allow-http", action="store_true", help="accept http:// URLs (a local test issuer only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fetch-jwks %(levelname)s %(message)s")
    while True:
        try:
            body = fetch_jwks(args.issuer, args.timeout_s, args.allow_http)
        except FetchError as exc:
            log.error("keeping %s as it is: %s", args.out, exc)
            if args.every_s <= 0:
                return 1
        else:
            if not args.out.exists() or args.out.read_bytes() != body:
                write_atomically(args.out, body)
                log.info("wrote %s (%d bytes) from %s", args.out, len(body), args.issuer)
            if args.every_s <= 0:
                return 0
        time.sleep(args.every_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
