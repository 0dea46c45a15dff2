"""tools/dev_ca.py issues what the mesh's TLS expects: SPIFFE id, DNS and IP SANs, both EKUs, a CA that verifies them."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from tools.dev_ca import DevCA, ensure_service_certs, main, spiffe_id, still_valid, write_service_certs


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


def test_extra_names_go_on_every_certificate_after_the_defaults(tmp_path):
    files = write_service_certs(tmp_path, ["scheduler"], dns_names=["scheduler-2"], ip_addresses=["10.0.0.7"])
    cert = x509.load_pem_x509_certificate(files["scheduler"].cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["scheduler", "localhost", "scheduler-2"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(a) for a in ("127.0.0.1", "10.0.0.7")]


def test_ensure_keeps_a_valid_set_and_reissues_one_that_expires_soon_or_is_incomplete(tmp_path):
    files, issued = ensure_service_certs(tmp_path, keep_valid_for=dt.timedelta(days=1))
    assert issued and still_valid(files, dt.timedelta(days=1))
    first_ca = files["gateway"].ca_path.read_bytes()
    assert ensure_service_certs(tmp_path, keep_valid_for=dt.timedelta(days=1)) == (files, False)
    assert files["gateway"].ca_path.read_bytes() == first_ca
    # Certificates issued for 7 days do not last 8 more: a new CA and a new set.
    assert not still_valid(files, dt.timedelta(days=8))
    assert ensure_service_certs(tmp_path, keep_valid_for=dt.timedelta(days=8))[1]
    assert files["gateway"].ca_path.read_bytes() != first_ca
    files["worker"].key_path.unlink()
    assert not still_valid(files, dt.timedelta(days=1))
    # A certificate from another CA than the ca.pem beside it (a run stopped half way) is not kept.
    DevCA().issue_service("worker").write(files["worker"].cert_path, files["worker"].key_path)
    assert not still_valid(files, dt.timedelta(days=1))


def test_command_line_keeps_valid_files_when_asked(tmp_path, capsys):
    main(["--out", str(tmp_path), "--keep-valid-days", "1"])
    ca_pem = (tmp_path / "ca.pem").read_bytes()
    main(["--out", str(tmp_path), "--keep-valid-days", "1", "--dns", "ignored-while-kept"])
    assert (tmp_path / "ca.pem").read_bytes() == ca_pem
    assert "kept" in capsys.readouterr().out
