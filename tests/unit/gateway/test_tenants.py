from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.errors import PermissionDenied, Unauthenticated
from services.gateway.tenants.directory import (
    Priority,
    TenantConfigError,
    TenantConfigWatcher,
    TenantDirectory,
    hash_api_key,
    load_tenant_config,
    parse_tenant_config,
)

REPO = Path(__file__).resolve().parents[3]
KEY_A = "sk-acme-0123456789"
KEY_B = "sk-beta-9876543210"


def tenant_yaml(tenant_id: str = "acme", key: str = KEY_A, **fields: str) -> str:
    values = {
        "priority": "critical",
        "weight": "3",
        "allowed_models": '["digits"]',
        "requests_per_s": "10",
        "requests_burst": "20",
        "tokens_per_s": "100",
        "tokens_burst": "400",
        "max_in_flight": "5",
    }
    values.update(fields)
    return f"""
  - id: {tenant_id}
    api_key_sha256: ["{hash_api_key(key)}"]
    priority: {values["priority"]}
    weight: {values["weight"]}
    allowed_models: {values["allowed_models"]}
    quotas:
      requests_per_s: {values["requests_per_s"]}
      requests_burst: {values["requests_burst"]}
      tokens_per_s: {values["tokens_per_s"]}
      tokens_burst: {values["tokens_burst"]}
      max_in_flight: {values["max_in_flight"]}
"""


def config_text(*tenants: str) -> str:
    return "tenants:" + "".join(tenants)


def write(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


# --------------------------------------------------------------------------- parsing


def test_parses_every_field_of_a_tenant():
    config = parse_tenant_config(config_text(tenant_yaml()), "t.yaml")
    (tenant,) = config.tenants
    assert tenant.tenant_id == "acme"
    assert tenant.priority is Priority.CRITICAL
    assert tenant.weight == 3
    assert tenant.allowed_models == frozenset({"digits"})
    assert tenant.api_key_sha256 == (hash_api_key(KEY_A),)
    assert (tenant.quota.requests_per_s, tenant.quota.requests_burst) == (10.0, 20)
    assert (tenant.quota.tokens_per_s, tenant.quota.tokens_burst) == (100.0, 400)
    assert tenant.quota.max_in_flight == 5


def test_example_file_in_deploy_is_valid():
    config = load_tenant_config(REPO / "deploy/config/tenants.example.yaml")
    priorities = {t.tenant_id: t.priority for t in config.tenants}
    assert priorities == {
        "checkout": Priority.CRITICAL,
        "search": Priority.STANDARD,
        "batch-reports": Priority.SHEDDABLE,
    }
    assert TenantDirectory(config).authenticate("Bearer demo-critical-key").tenant_id == "checkout"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"priority": "urgent"},
            "t.yaml: tenant 'acme': field 'priority': must be one of critical, standard, sheddable, got 'urgent'",
        ),
        ({"weight": "0"}, "t.yaml: tenant 'acme': field 'weight': must be an integer >= 1, got 0"),
        (
            {"allowed_models": "[]"},
            "t.yaml: tenant 'acme': field 'allowed_models': must be '*' or a non-empty list of model names, got []",
        ),
        (
            {"requests_per_s": "-1"},
            "t.yaml: tenant 'acme': field 'quotas.requests_per_s': must be a number > 0, got -1",
        ),
        (
            {"tokens_burst": "1.5"},
            "t.yaml: tenant 'acme': field 'quotas.tokens_burst': must be an integer >= 1, got 1.5",
        ),
        (
            {"max_in_flight": "true"},
            "t.yaml: tenant 'acme': field 'quotas.max_in_flight': must be an integer >= 1, got True",
        ),
    ],
)
def test_rejects_bad_field_naming_file_tenant_and_field(fields, message):
    with pytest.raises(TenantConfigError) as info:
        parse_tenant_config(config_text(tenant_yaml(**fields)), "t.yaml")
    assert str(info.value) == message


def test_rejects_missing_quota_and_unknown_field():
    text = config_text(tenant_yaml()).replace("      max_in_flight: 5\n", "")
    with pytest.raises(
        TenantConfigError, match=r"^t.yaml: tenant 'acme': field 'quotas.max_in_flight': is required$"
    ):
        parse_tenant_config(text, "t.yaml")
    text = config_text(tenant_yaml()).replace("    weight: 3", "    wieght: 3")
    with pytest.raises(TenantConfigError, match=r"^t.yaml: tenant 'acme': field 'wieght': unknown field"):
        parse_tenant_config(text, "t.yaml")


def test_rejects_bad_id_by_position():
    with pytest.raises(TenantConfigError, match=r"^t.yaml: tenant #1: field 'id': must be 1-64 characters"):
        parse_tenant_config(config_text(tenant_yaml(), tenant_yaml("bad id!", KEY_B)), "t.yaml")


def test_rejects_duplicate_ids_and_shared_keys():
    with pytest.raises(TenantConfigError, match=r"^t.yaml: tenant 'acme': field 'id': duplicate tenant id$"):
        parse_tenant_config(config_text(tenant_yaml(), tenant_yaml("acme", KEY_B)), "t.yaml")
    with pytest.raises(
        TenantConfigError,
        match=r"^t.yaml: tenant 'beta': field 'api_key_sha256\[0\]': same key as tenant 'acme'$",
    ):
        parse_tenant_config(config_text(tenant_yaml(), tenant_yaml("beta", KEY_A)), "t.yaml")


def test_bad_digest_error_never_echoes_the_value():
    raw_key_pasted_by_mistake = "sk-live-supersecret"
    text = config_text(tenant_yaml()).replace(hash_api_key(KEY_A), raw_key_pasted_by_mistake)
    with pytest.raises(TenantConfigError) as info:
        parse_tenant_config(text, "t.yaml")
    assert str(info.value).startswith(
        "t.yaml: tenant 'acme': field 'api_key_sha256[0]': must be 64 hex characters"
    )
    assert raw_key_pasted_by_mistake not in str(info.value)


def test_reports_yaml_syntax_error_with_line():
    with pytest.raises(TenantConfigError) as info:
        parse_tenant_config("tenants:\n\t- id: acme\n", "t.yaml")
    assert str(info.value) == (
        "t.yaml: not valid YAML: found character '\\t' that cannot start any token at line 2, column 1"
    )


# --------------------------------------------------------------------------- directory


@pytest.fixture
def directory() -> TenantDirectory:
    text = config_text(tenant_yaml(), tenant_yaml("beta", KEY_B, allowed_models='"*"', priority="sheddable"))
    return TenantDirectory(parse_tenant_config(text, "t.yaml"))


def test_authenticates_bearer_key_to_its_tenant(directory):
    assert directory.authenticate(f"Bearer {KEY_A}").tenant_id == "acme"
    assert directory.authenticate(f"bearer {KEY_B}").tenant_id == "beta"


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, "missing API key: send metadata 'authorization: Bearer <key>'"),
        ("", "missing API key: send metadata 'authorization: Bearer <key>'"),
        (KEY_A, "malformed authorization metadata: expected 'Bearer <key>'"),
        ("Basic dXNlcjpwYXNz", "malformed authorization metadata: expected 'Bearer <key>'"),
        ("Bearer sk-wrong", "invalid API key"),
        ("Bearer demo\udcff", "invalid API key"),  # a non-UTF-8 header byte, as aiohttp decodes it
        ("Bearer demo\ud800", "invalid API key"),  # a surrogate no decoder makes
        (f"Bearer sk-wrong, Bearer {KEY_A}", "more than one authorization value: send one 'Bearer <key>'"),
    ],
)
def test_missing_malformed_or_wrong_key_is_unauthenticated(directory, authorization, message):
    with pytest.raises(Unauthenticated) as info:
        directory.authenticate(authorization)
    assert info.value.message == message


def test_forbidden_model_is_permission_denied(directory):
    acme = directory.authenticate(f"Bearer {KEY_A}")
    directory.check_model_allowed(acme, "digits")
    with pytest.raises(PermissionDenied) as info:
        directory.check_model_allowed(acme, "tinylm")
    assert info.value.message == "tenant 'acme' may not use model 'tinylm'"


def test_star_allows_every_model(directory):
    beta = directory.authenticate(f"Bearer {KEY_B}")
    directory.check_model_allowed(beta, "anything-at-all")


# --------------------------------------------------------------------------- reloading


def test_reload_on_change_swaps_directory_and_notifies(tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, config_text(tenant_yaml()), mtime_ns=1_000_000_000)
    seen = []
    watcher = TenantConfigWatcher(path, on_reload=lambda config: seen.append(config))
    assert watcher.poll() is None

    write(path, config_text(tenant_yaml(), tenant_yaml("beta", KEY_B)), mtime_ns=2_000_000_000)
    result = watcher.poll()

    assert result.applied and result.num_tenants == 2
    assert watcher.directory.authenticate(f"Bearer {KEY_B}").tenant_id == "beta"
    assert [len(c.tenants) for c in seen] == [1, 2]
    assert watcher.poll() is None


def test_reload_keeps_old_config_when_new_file_is_bad(tmp_path, caplog):
    path = tmp_path / "tenants.yaml"
    write(path, config_text(tenant_yaml()), mtime_ns=1_000_000_000)
    watcher = TenantConfigWatcher(path)
    old = watcher.directory

    write(path, config_text(tenant_yaml(priority="urgent")), mtime_ns=2_000_000_000)
    with caplog.at_level(logging.ERROR, logger="services.gateway.tenants.directory"):
        result = watcher.poll()

    assert not result.applied
    assert result.num_tenants == 1
    assert result.reason == (
        f"{path}: tenant 'acme': field 'priority': must be one of critical, standard, sheddable, got 'urgent'"
    )
    assert watcher.directory is old
    assert watcher.directory.authenticate(f"Bearer {KEY_A}").tenant_id == "acme"
    assert "refused tenant config, keeping the previous one (1 tenants)" in caplog.text
    assert KEY_A not in caplog.text and hash_api_key(KEY_A) not in caplog.text
    # Reported once, not on every poll; a fixed file is picked up on the next change.
    assert watcher.poll() is None
    write(path, config_text(tenant_yaml(priority="sheddable")), mtime_ns=3_000_000_000)
    assert watcher.poll().applied
    assert watcher.directory.authenticate(f"Bearer {KEY_A}").priority is Priority.SHEDDABLE


def test_reload_keeps_old_config_when_file_disappears(tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, config_text(tenant_yaml()), mtime_ns=1_000_000_000)
    watcher = TenantConfigWatcher(path)
    path.unlink()
    result = watcher.poll()
    assert not result.applied
    assert result.reason.startswith(f"{path}: cannot read:")
    assert watcher.directory.authenticate(f"Bearer {KEY_A}").tenant_id == "acme"


def test_forced_reload_rereads_even_without_change(tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, config_text(tenant_yaml()), mtime_ns=1_000_000_000)
    watcher = TenantConfigWatcher(path)
    old = watcher.directory
    result = watcher.reload()
    assert result.applied and watcher.directory is not old


def test_watcher_refuses_to_start_on_bad_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, "tenants: 3\n", mtime_ns=1_000_000_000)
    with pytest.raises(TenantConfigError, match=r"field 'tenants': must be a list of tenants"):
        TenantConfigWatcher(path)


def test_hash_key_cli_prints_sha256_of_stdin():
    result = subprocess.run(
        [sys.executable, "-m", "services.gateway.tenants", "hash-key"],
        input=f"{KEY_A}\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert result.stdout.strip() == hash_api_key(KEY_A)


def test_a_tenants_file_that_is_not_utf8_is_a_config_error(tmp_path):
    # Found by atheris (fuzz/tenants.py): UnicodeDecodeError escaped, so a bad edit crashed the
    # reload instead of being refused with the old tenants kept.
    path = tmp_path / "tenants.yaml"
    path.write_bytes(tenant_yaml().encode() + b"# caf\xe9\n")
    with pytest.raises(TenantConfigError, match="not UTF-8"):
        load_tenant_config(path)


def test_a_tenant_may_set_its_own_latency_objectives():
    from services.common.objectives import NO_OVERRIDE, ObjectiveOverride

    text = config_text(tenant_yaml() + "    objectives: {ttft_ms: 250, tpot_ms: 40.5}\n",
                       tenant_yaml("beta", KEY_B) + "    objectives: {tpot_ms: 80}\n",
                       tenant_yaml("gamma", "sk-gamma-000000000"))
    acme, beta, gamma = parse_tenant_config(text, "t.yaml").tenants
    assert acme.objectives == ObjectiveOverride(ttft_ms=250.0, tpot_ms=40.5)
    assert beta.objectives == ObjectiveOverride(ttft_ms=None, tpot_ms=80.0)
    assert gamma.objectives is NO_OVERRIDE


@pytest.mark.parametrize(("objectives", "message"), [
    ("{ttft_ms: 0}", "field 'objectives.ttft_ms': must be a number > 0, got 0"),
    ("{tpot_ms: fast}", "field 'objectives.tpot_ms': must be a number > 0, got 'fast'"),
    ("{ttft: 100}", "field 'objectives.ttft': unknown field (expected one of ttft_ms, tpot_ms)"),
    ("{}", "field 'objectives': must be a mapping with ttft_ms and/or tpot_ms"),
    ("250", "field 'objectives': must be a mapping with ttft_ms and/or tpot_ms"),
])
def test_bad_latency_objectives_in_the_tenants_file_name_the_field(objectives, message):
    text = config_text(tenant_yaml() + f"    objectives: {objectives}\n")
    with pytest.raises(TenantConfigError) as caught:
        parse_tenant_config(text, "t.yaml")
    assert str(caught.value) == f"t.yaml: tenant 'acme': {message}"
