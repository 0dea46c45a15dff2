"""tools/dev_ca.py issues what the mesh's TLS expects: SPIFFE id, DNS and IP SANs, both EKUs, a CA that verifies them."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from tools.dev_ca import DevCA, main, spiffe_id, write_service_certs


def test_service_certificates_carry_the_spiffe_id_names_and_both_usages(tmp_path):
    files = write_service_certs(tmp_path)
    ca = x509.load_pem_x509_certificate(files["gateway"].ca_path.read_bytes())
    for service, paths in files.items():
        cert = x509.load_pem_x509_certificate(paths.cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [spiffe_id(service)]
        assert san.get_values_for_type(x509.DNSName) == [service, "localhost"]
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        cert.verify_directly_issued_by(ca)
        assert stat.S_IMODE(paths.key_path.stat().st_mode) == 0o600


def test_validity_can_be_set_to_issue_an_expired_certificate():
    now = dt.datetime.now(dt.UTC)
    issued = DevCA().issue_service("gateway", not_before=now - dt.timedelta(days=2),
                                   not_after=now - dt.timedelta(days=1))
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    assert cert.not_valid_after_utc < now


def test_a_second_ca_with_the_same_name_does_not_verify_the_first_cas_certificates():
    cert = x509.load_pem_x509_certificate(DevCA().issue_service("worker").cert_pem)
    impostor = x509.load_pem_x509_certificate(DevCA().cert_pem)  # same subject, another key
    with pytest.raises(InvalidSignature):
        cert.verify_directly_issued_by(impostor)


def test_command_line_writes_the_ca_and_each_services_files(tmp_path, capsys):
    main(["--out", str(tmp_path), "--services", "scheduler", "worker"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ca.pem", "scheduler-key.pem", "scheduler.pem", "worker-key.pem", "worker.pem"]
    assert "spiffe://infermesh/scheduler" in capsys.readouterr().out
