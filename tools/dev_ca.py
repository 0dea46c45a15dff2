"""A throwaway certificate authority and per-service certificates, for tests and the local mesh.

    python -m tools.dev_ca --out run/tls            # ca.pem, <service>.pem, <service>-key.pem
    python -m tools.dev_ca --out run/tls --keep-valid-days 1   # reuse them while all are good for a day more

Every service certificate serves both ends of mTLS (server and client auth) and names
the service three ways: a SPIFFE URI SAN (`spiffe://infermesh/<service>`, the identity
the scheduler authorizes by), a DNS SAN (`<service>`, `localhost`) and 127.0.0.1, so
a client dialing the local mesh verifies the host without a name override.

Keys are ECDSA P-256: fast to generate (a test makes a dozen) and what cert-manager
issues by default for ECDSA. Nothing here is for production: the CA key sits next to
the certificates. Built with `cryptography` (pinned in requirements.lock), never by
shelling out to openssl, so the same code runs in tests, CI and `make up`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SPIFFE_TRUST_DOMAIN = "infermesh"
SERVICES = ("gateway", "scheduler", "worker")
DEFAULT_VALIDITY = dt.timedelta(days=7)
# Clock skew between the CA's host and a peer's must not make a fresh cert "not yet valid".
BACKDATE = dt.timedelta(minutes=5)


def spiffe_id(service: str) -> str:
    return f"spiffe://{SPIFFE_TRUST_DOMAIN}/{service}"


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Key first, then certificate, each replaced atomically (a reloading server never reads half a file)."""
        _replace(key_path, self.key_pem, mode=0o600)
        _replace(cert_path, self.cert_pem, mode=0o644)


def _replace(path: Path, data: bytes, mode: int) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(staging, path)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "infermesh dev"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


class DevCA:
    """A self-signed root that issues leaf certificates; `now` is injected so tests can issue expired ones."""

    def __init__(self, common_name: str = "infermesh dev CA", now: dt.datetime | None = None,
                 validity: dt.timedelta = DEFAULT_VALIDITY) -> None:
        self._key = _new_key()
        self._name = _name(common_name)
        now = now or dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                              key_encipherment=False, data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        *,
        uris: Iterable[str] = (),
        dns_names: Iterable[str] = (),
        ip_addresses: Iterable[str] = (),
        not_before: dt.datetime | None = None,
        not_after: dt.datetime | None = None,
    ) -> IssuedCert:
        """A leaf certificate for server and client auth with the given subject alternative names."""
        key = _new_key()
        now = dt.datetime.now(dt.UTC)
        not_before = not_before or now - BACKDATE
        not_after = not_after or now + DEFAULT_VALIDITY
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.DNSName(d) for d in dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )
        if names:
            # SPIFFE X.509-SVIDs mark the SAN critical when the subject is empty; ours has a CN, so not critical.
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return IssuedCert(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def issue_service(self, service: str, *, dns_names: Iterable[str] = (), ip_addresses: Iterable[str] = (),
                      **validity: dt.datetime) -> IssuedCert:
        """The local mesh's certificate for one service: SPIFFE id, service DNS name, localhost, 127.0.0.1,
        and any further names peers dial it by (compose service names, test network addresses)."""
        return self.issue(
            service,
            uris=[spiffe_id(service)],
            dns_names=_unique([service, "localhost", *dns_names]),
            ip_addresses=_unique(["127.0.0.1", *ip_addresses]),
            **validity,
        )


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


@dataclass(frozen=True)
class ServiceFiles:
    """Where one service's certificate, key and the CA bundle were written."""

    cert_path: Path
    key_path: Path
    ca_path: Path

    def server_args(self) -> list[str]:
        """The service flags that turn TLS on with these files."""
        return ["--tls-cert-file", str(self.cert_path), "--tls-key-file", str(self.key_path),
                "--tls-ca-file", str(self.ca_path)]

    def server_env(self, service: str) -> dict[str, str]:
        """The same as environment variables of `service` (INFERMESH_<SERVICE>_TLS_*), as `make up` sets them."""
        prefix = f"INFERMESH_{service.upper()}_TLS_"
        return {f"{prefix}CERT_FILE": str(self.cert_path), f"{prefix}KEY_FILE": str(self.key_path),
                f"{prefix}CA_FILE": str(self.ca_path)}


def service_files(out_dir: Path, services: Iterable[str] = SERVICES) -> dict[str, ServiceFiles]:
    """Where write_service_certs puts each service's files under out_dir."""
    ca_path = out_dir / "ca.pem"
    return {s: ServiceFiles(out_dir / f"{s}.pem", out_dir / f"{s}-key.pem", ca_path) for s in services}


def write_service_certs(out_dir: Path, services: Iterable[str] = SERVICES, ca: DevCA | None = None, *,
                        dns_names: Iterable[str] = (), ip_addresses: Iterable[str] = ()) -> dict[str, ServiceFiles]:
    """A fresh CA (unless given) and one certificate per service, written under out_dir; dns_names and
    ip_addresses are added to every service's certificate."""
    ca = ca or DevCA()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = service_files(out_dir, services)
    dns_names, ip_addresses = list(dns_names), list(ip_addresses)
    for service, paths in files.items():
        issued = ca.issue_service(service, dns_names=dns_names, ip_addresses=ip_addresses)
        issued.write(paths.cert_path, paths.key_path)
    # The CA last: a folder with a ca.pem holds a whole set (a run stopped half way is redone next time).
    _replace(out_dir / "ca.pem", ca.cert_pem, mode=0o644)
    return files


def still_valid(files: dict[str, ServiceFiles], for_at_least: dt.timedelta,
                now: dt.datetime | None = None) -> bool:
    """True when every file exists, every certificate is signed by the CA beside it and none expires
    within `for_at_least`; anything unreadable counts as not valid."""
    deadline = (now or dt.datetime.now(dt.UTC)) + for_at_least
    try:
        ca_paths = {paths.ca_path for paths in files.values()}
        cas = [x509.load_pem_x509_certificate(path.read_bytes()) for path in ca_paths]
        for paths in files.values():
            cert = x509.load_pem_x509_certificate(paths.cert_path.read_bytes())
            serialization.load_pem_private_key(paths.key_path.read_bytes(), password=None)
            cert.verify_directly_issued_by(next(ca for ca in cas if ca.subject == cert.issuer))
            if min(cert.not_valid_after_utc, *(ca.not_valid_after_utc for ca in cas)) <= deadline:
                return False
    except (OSError, ValueError, TypeError, StopIteration, InvalidSignature):
        return False
    return True


def ensure_service_certs(out_dir: Path, services: Iterable[str] = SERVICES, *,
                         keep_valid_for: dt.timedelta = dt.timedelta(days=1), **names: Iterable[str]
                         ) -> tuple[dict[str, ServiceFiles], bool]:
    """The service certs under out_dir, issued anew (with a new CA) unless the ones there are still
    good for `keep_valid_for`; returns the files and whether they were issued now."""
    services = list(services)
    files = service_files(out_dir, services)
    if still_valid(files, keep_valid_for):
        return files, False
    return write_service_certs(out_dir, services, **names), True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.dev_ca", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for ca.pem and the service certs")
    parser.add_argument("--services", nargs="+", default=list(SERVICES), help="services to issue certs for")
    parser.add_argument("--dns", nargs="*", default=[], help="more DNS names for every certificate "
                        "(the names peers dial, e.g. compose service names)")
    parser.add_argument("--ip", nargs="*", default=[], help="more IP addresses for every certificate")
    parser.add_argument("--keep-valid-days", type=float, default=None,
                        help="keep the files already in --out when every one is still valid this many days "
                             "(make up); default: always issue a new set")
    args = parser.parse_args(argv)
    names = {"dns_names": args.dns, "ip_addresses": args.ip}
    if args.keep_valid_days is None:
        files, issued = write_service_certs(args.out, args.services, **names), True
    else:
        files, issued = ensure_service_certs(args.out, args.services,
                                             keep_valid_for=dt.timedelta(days=args.keep_valid_days), **names)
    if not issued:
        print(f"dev CA: the certificates in {args.out} are valid for {args.keep_valid_days:g} more days; kept")
        return
    for service, paths in files.items():
        print(f"{service}: {paths.cert_path} {paths.key_path} ({spiffe_id(service)})")
    print(f"CA: {args.out / 'ca.pem'} (throwaway: its key was never written)")


if __name__ == "__main__":
    main()
