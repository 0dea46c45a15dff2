"""Reading and checking certificate files, and noticing rotation (cert_files.py, fake clock)."""

from __future__ import annotations

import datetime as dt

import pytest

from services.common.cert_files import CertificateError, CertificateWatcher, TlsFiles, read_material
from tools.dev_ca import DevCA, write_service_certs
from tools.testbed.fake_clock import FakeClock


@pytest.fixture(scope="module")
def ca() -> DevCA:
    return DevCA()


@pytest.fixture
def files(tmp_path, ca) -> TlsFiles:
    paths = write_service_certs(tmp_path, ["scheduler"], ca)["scheduler"]
    return TlsFiles(str(paths.cert_path), str(paths.key_path), str(paths.ca_path))


def test_reads_a_matching_pair_and_its_expiry(files, ca):
    material = read_material(files)
    assert material.ca_pem == ca.cert_pem
    assert material.cert_pem.startswith(b"-----BEGIN CERTIFICATE-----")
    in_six_days = (dt.datetime.now(dt.UTC) + dt.timedelta(days=6)).timestamp()
    assert material.not_after_unix_s > in_six_days


def test_refuses_a_key_that_does_not_belong_to_the_certificate(files, ca, tmp_path):
    other = ca.issue_service("worker")
    (tmp_path / "other-key.pem").write_bytes(other.key_pem)
    mismatched = TlsFiles(files.cert_path, str(tmp_path / "other-key.pem"), files.ca_path)
    with pytest.raises(CertificateError, match="other-key.pem does not belong to the certificate in .*scheduler.pem"):
        read_material(mismatched)


def test_names_a_missing_file(files):
    with pytest.raises(CertificateError, match="cannot read the TLS CA file /nonexistent/ca.pem"):
        read_material(TlsFiles(files.cert_path, files.key_path, "/nonexistent/ca.pem"))


def test_names_a_file_that_is_not_pem(files, tmp_path):
    (tmp_path / "garbage.pem").write_bytes(b"not a certificate")
    with pytest.raises(CertificateError, match="garbage.pem holds no PEM certificate"):
        read_material(TlsFiles(str(tmp_path / "garbage.pem"), files.key_path, files.ca_path))


def test_watcher_reports_nothing_while_the_files_stay_the_same(files):
    clock = FakeClock()
    watcher = CertificateWatcher(files, clock, check_interval_s=1.0)
    clock.advance(5)
    assert watcher.poll() is None
    assert watcher.num_reloads == 0


def test_watcher_hands_out_rotated_files_once_the_check_interval_passed(files, ca, tmp_path):
    clock = FakeClock()
    watcher = CertificateWatcher(files, clock, check_interval_s=1.0)
    before = watcher.current
    write_service_certs(tmp_path, ["scheduler"], ca)
    clock.advance(0.5)
    assert watcher.poll() is None  # a handshake storm looks at the files once per interval
    clock.advance(0.6)
    rotated = watcher.poll()
    assert rotated is not None and rotated.cert_pem != before.cert_pem
    assert watcher.current is rotated and watcher.num_reloads == 1
    clock.advance(2)
    assert watcher.poll() is None


def test_watcher_keeps_the_old_pair_until_the_key_catches_up_with_the_certificate(files, ca, tmp_path):
    clock = FakeClock()
    watcher = CertificateWatcher(files, clock, check_interval_s=0.0)
    before = watcher.current
    new = ca.issue_service("scheduler")
    (tmp_path / "scheduler.pem").write_bytes(new.cert_pem)  # the key is not replaced yet
    assert watcher.poll() is None
    assert watcher.current is before
    assert watcher.poll() is None  # the same broken state is not re-read on every handshake
    (tmp_path / "scheduler-key.pem").write_bytes(new.key_pem)
    rotated = watcher.poll()
    assert rotated is not None and rotated.cert_pem == new.cert_pem


def test_watcher_refuses_to_start_on_bad_files(files, tmp_path):
    (tmp_path / "scheduler-key.pem").write_bytes(b"")
    with pytest.raises(CertificateError, match="scheduler-key.pem holds no unencrypted PEM private key"):
        CertificateWatcher(files, FakeClock())
