"""JWKS files: the issuers' public keys, read from disk and re-read when they change.

The gateway never fetches keys while serving: an operator (or the `fetch-jwks` command,
tenants/oidc_fetch.py, run as a sidecar or a cron job) writes each issuer's JWKS to a file,
and `JwksFiles.poll()` (the gateway's file-watch loop, once a second, and SIGHUP) re-reads the
files when their bytes change. A file that does not parse is refused with one log line and the
previous keys stay, as a bad tenants file is. Removing a key from the file revokes it: a token
signed with it is refused from the next poll on, cached or not (jwt_verifier.py keys its cache
by this set's generation).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jwt import PyJWK, PyJWKError

log = logging.getLogger(__name__)

# Which algorithms each key type can verify (a JWK without "alg" serves its whole family).
FAMILY_OF_KTY = {"RSA": ("RS", "PS"), "EC": ("ES",), "OKP": ("EdDSA",)}
MAX_JWKS_BYTES = 1 << 20


class JwksError(ValueError):
    """A JWKS file is unusable; the message names the file and the key."""


@dataclass(frozen=True)
class VerificationKey:
    kid: str
    kty: str
    # The JWK's own "alg", when it names one: then only that algorithm may use the key.
    algorithm: str | None
    key: Any  # a `cryptography` public key

    def can_verify(self, algorithm: str) -> bool:
        if self.algorithm is not None:
            return algorithm == self.algorithm
        return algorithm.startswith(FAMILY_OF_KTY.get(self.kty, ()))


KeySet = Mapping[str, VerificationKey]  # by kid


def parse_jwks(text: bytes, source: str) -> dict[str, VerificationKey]:
    """The signing keys of one JWKS document; raises JwksError naming the file and key."""
    if len(text) > MAX_JWKS_BYTES:
        raise JwksError(f"{source}: {len(text)} bytes, more than a JWKS needs ({MAX_JWKS_BYTES})")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise JwksError(f"{source}: not JSON: {exc}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise JwksError(f"{source}: must be a JSON object with a 'keys' list (a JWK Set, RFC 7517)")
    keys: dict[str, VerificationKey] = {}
    for index, entry in enumerate(entries):
        where = f"{source}: keys[{index}]"
        if not isinstance(entry, dict):
            raise JwksError(f"{where}: must be a JSON object (a JWK)")
        if entry.get("use", "sig") != "sig":
            continue  # an encryption key published beside the signing keys is not ours to use
        if "d" in entry:
            raise JwksError(f"{where}: holds a private key ('d'); publish only the public part")
        kid = entry.get("kid")
        if not isinstance(kid, str) or not kid:
            raise JwksError(f"{where}: needs a 'kid' (tokens name their key by it)")
        if kid in keys:
            raise JwksError(f"{where}: kid {kid!r} appears twice")
        kty = entry.get("kty")
        if kty not in FAMILY_OF_KTY:
            raise JwksError(f"{where} (kid {kid!r}): kty must be one of {', '.join(FAMILY_OF_KTY)}, got {kty!r}")
        algorithm = entry.get("alg")
        if algorithm is not None and (not isinstance(algorithm, str)
                                      or not algorithm.startswith(FAMILY_OF_KTY[kty])):
            raise JwksError(f"{where} (kid {kid!r}): alg {algorithm!r} does not fit a {kty} key")
        try:
            jwk = PyJWK(entry, algorithm)
        except (PyJWKError, ValueError, TypeError) as exc:
            raise JwksError(f"{where} (kid {kid!r}): not a usable {kty} public key: {exc}") from None
        keys[kid] = VerificationKey(kid, kty, algorithm, jwk.key)
    return keys


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_JWKS_BYTES + 1)
    except OSError as exc:
        raise JwksError(f"{path}: cannot read: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class JwksReload:
    applied: bool
    reason: str


class JwksFiles:
    """The keys of a set of JWKS files, by file; `generation` grows with every accepted change.

    The first read happens in the constructor and raises JwksError, so a gateway (or a tenants
    file reload) never starts with a key file it cannot use."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.paths = paths
        self._contents = tuple(_read(p) for p in paths)
        self.keys_by_file = self._parse(self._contents)
        self.generation = 0
        self._problem: str | None = None  # the last refusal, reported once

    def _parse(self, contents: tuple[bytes, ...]) -> dict[str, dict[str, VerificationKey]]:
        return {path: parse_jwks(text, path) for path, text in zip(self.paths, contents, strict=True)}

    def keys(self, paths: tuple[str, ...]) -> dict[str, VerificationKey]:
        """The keys of these files together (an issuer's); the first file wins a kid both hold."""
        merged: dict[str, VerificationKey] = {}
        for path in reversed(paths):
            merged.update(self.keys_by_file.get(path, {}))
        return merged

    def poll(self) -> JwksReload | None:
        """Re-read the files; new keys if their bytes changed into valid JWKS, else None (unchanged or bad)."""
        if not self.paths:
            return None
        try:
            contents = tuple(_read(p) for p in self.paths)
            if contents == self._contents:
                return None
            keys = self._parse(contents)
        except JwksError as exc:
            return self._refuse(exc)
        self._contents, self._problem = contents, None
        self.keys_by_file = keys
        self.generation += 1
        summary = f"{sum(len(k) for k in keys.values())} keys from {len(self.paths)} files"
        log.info("JWKS reloaded: %s", summary)
        return JwksReload(True, summary)

    def _refuse(self, exc: JwksError) -> JwksReload | None:
        if str(exc) == self._problem:
            return None
        self._problem = str(exc)
        log.error("refused JWKS change, keeping the previous keys: %s", exc)
        return JwksReload(False, str(exc))
