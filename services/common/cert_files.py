"""Certificate, key and CA files: read them, check them, and notice when they rotate.

No grpc here: `tls.py` turns what this module returns into gRPC credentials.

Rotation is seen by the files' bytes, read at most once per check interval: every way
of replacing them is caught (an atomic rename as `tools/dev_ca.py` does, the symlink swap
of a Kubernetes Secret volume, an in-place rewrite), where inode and mtime miss a
same-size rewrite inside the file system's timestamp tick. A rotation is taken only once the new files form a valid set (the key matches the
certificate): a writer that replaces the certificate before the key would otherwise
hand every new handshake a pair that cannot work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from services.common.config import ConfigError

log = logging.getLogger(__name__)

# How often a connection storm may stat the files: every new handshake asks, one in this window looks.
DEFAULT_CHECK_INTERVAL_S = 1.0


class CertificateError(ConfigError):
    """A certificate, key or CA file is missing, unreadable or does not fit; the message names the file."""


@dataclass(frozen=True)
class TlsFiles:
    """Where one process's TLS material lives; ca_path is empty when peers are not verified."""

    cert_path: str
    key_path: str
    ca_path: str = ""


@dataclass(frozen=True)
class PemMaterial:
    """The contents of TlsFiles, checked: the key belongs to the certificate, every PEM parses."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes | None
    not_after_unix_s: float  # when the certificate expires


FileContents = tuple[bytes, ...]


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CertificateError(f"cannot read the TLS {what} file {path}: {exc.strerror}") from None


def read_material(files: TlsFiles) -> PemMaterial:
    """Read and check the files; raises CertificateError naming the file at fault."""
    cert_pem = _read(files.cert_path, "certificate")
    key_pem = _read(files.key_path, "key")
    ca_pem = _read(files.ca_path, "CA") if files.ca_path else None
    return check_material(files, cert_pem, key_pem, ca_pem)


def check_material(files: TlsFiles, cert_pem: bytes, key_pem: bytes, ca_pem: bytes | None) -> PemMaterial:
    """Parse and check PEM bytes read from files; raises CertificateError naming the file at fault."""
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise CertificateError(f"{files.cert_path} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise CertificateError(f"{files.key_path} holds no unencrypted PEM private key") from None
    if ca_pem is not None:
        try:
            x509.load_pem_x509_certificates(ca_pem)
        except ValueError:
            raise CertificateError(f"{files.ca_path} holds no PEM CA certificate") from None
    leaf = chain[0]
    if leaf.public_key().public_bytes(*_SPKI) != key.public_key().public_bytes(*_SPKI):
        raise CertificateError(f"the key in {files.key_path} does not belong to the certificate in {files.cert_path}")
    return PemMaterial(cert_pem, key_pem, ca_pem, leaf.not_valid_after_utc.timestamp())


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def file_contents(files: TlsFiles) -> FileContents:
    """The raw bytes of the three files; a missing or unreadable file reads as empty."""
    contents = []
    for path in (files.cert_path, files.key_path, files.ca_path):
        try:
            with open(path, "rb") as f:
                contents.append(f.read())
        except OSError:
            contents.append(b"")
    return tuple(contents)


class CertificateWatcher:
    """Hands out the current material, and new material once the files rotate to a valid set.

    `poll()` is called on every new TLS handshake (gRPC's certificate fetcher); it looks
    at the files at most once per check interval of the injected clock.
    """

    def __init__(self, files: TlsFiles, clock: Callable[[], float],
                 check_interval_s: float = DEFAULT_CHECK_INTERVAL_S) -> None:
        if check_interval_s < 0:
            raise ValueError(f"check_interval_s must be >= 0, got {check_interval_s}")
        self.files = files
        self._clock = clock
        self._check_interval_s = check_interval_s
        self._contents = file_contents(files)
        self.current = read_material(files)
        self._next_check_s = clock() + check_interval_s
        self._rejected: FileContents | None = None
        self.num_reloads = 0

    def poll(self) -> PemMaterial | None:
        """New material if the files changed into a valid set since the last poll, else None."""
        now_s = self._clock()
        if now_s < self._next_check_s:
            return None
        self._next_check_s = now_s + self._check_interval_s
        contents = file_contents(self.files)
        if contents == self._contents or contents == self._rejected:
            return None
        try:
            cert_pem, key_pem, ca_pem = contents
            material = check_material(self.files, cert_pem, key_pem, ca_pem if self.files.ca_path else None)
        except CertificateError as exc:
            # Mid-rotation or broken: keep serving the old pair, say so once per bad state, look again later.
            self._rejected = contents
            log.warning("TLS files changed but are not usable yet, keeping the previous certificate: %s", exc)
            return None
        self._contents = contents
        self._rejected = None
        self.current = material
        self.num_reloads += 1
        log.info("TLS certificate reloaded from %s (expires at unix %.0f)", self.files.cert_path,
                 material.not_after_unix_s)
        return material
