"""Configuration: one frozen dataclass per service, read from flags and env in one place.

Every field `foo_bar` of a service's config can be set as `--foo-bar` or as
`INFERMESH_<SERVICE>_FOO_BAR`; a flag wins over the environment, which wins over
the default. Bad values fail at start with a message naming the variable, and so
does an `INFERMESH_<SERVICE>_*` variable the service does not know (a typo).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common import build_info

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A service's config class: a dataclass.
T = typing.TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A configuration value is missing or malformed; the message names its source."""


def env_name(service: str, field_name: str) -> str:
    return f"INFERMESH_{service.upper()}_{field_name.upper()}"


def env_names(config_cls: type, service: str) -> set[str]:
    """Every environment variable a service reads (the deploy manifests are checked against it)."""
    return {env_name(service, f.name) for f in dataclasses.fields(config_cls)}


def describe(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def setting(default, help: str, *, minimum: int | float | None = None):  # noqa: A002 - mirrors argparse's keyword
    """A config field with its documentation. `minimum`: the least value allowed, checked when the config
    is made (check_minimums), so a config's __post_init__ keeps only the checks that relate fields."""
    if isinstance(default, list | dict | set):
        raise TypeError("use a tuple for sequence defaults")
    metadata: dict[str, object] = {"help": help}
    if minimum is not None:
        metadata["minimum"] = minimum
    return field(default=default, metadata=metadata)


def _convert(raw: str, type_: object, source: str) -> object:
    origin = typing.get_origin(type_)
    if origin in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(type_) if t is not type(None)]
        if raw == "":
            return None
        return _convert(raw, options[0], source)
    if origin is tuple:
        (item_type, *_rest) = typing.get_args(type_)
        return tuple(_convert(part.strip(), item_type, source) for part in raw.split(",") if part.strip())
    if type_ is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{source}={raw!r}: expected true or false")
    if type_ is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{source}={raw!r}: expected an integer") from None
    if type_ is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{source}={raw!r}: expected a number") from None
    return raw


def load_config(
    config_cls: type[T],
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(config_cls)
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}")
    parser.add_argument("--version", action="version", version=build_info.current().line(service))
    for f in dataclasses.fields(config_cls):
        # A bool flag alone means true (`--allow-anonymous`); `--allow-anonymous false` still reads.
        bare: dict[str, typing.Any] = {"nargs": "?", "const": "true"} if hints[f.name] is bool else {}
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            help=f"{describe(f)} (env {env_name(service, f.name)}, default {f.default!r})",
            **bare,
        )
    args = parser.parse_args(argv)
    _refuse_unknown_variables(config_cls, service, environ)
    values: dict[str, object] = {}
    for f in dataclasses.fields(config_cls):
        raw = getattr(args, f.name)
        source = "--" + f.name.replace("_", "-")
        if raw is None:
            source = env_name(service, f.name)
            raw = environ.get(source)
        if raw is not None:
            values[f.name] = _convert(raw, hints[f.name], source)
    try:
        return config_cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{service} config: {exc}") from None


def _refuse_unknown_variables(config_cls: type, service: str, environ: Mapping[str, str]) -> None:
    """A mistyped INFERMESH_<SERVICE>_* variable would otherwise be ignored without a word,
    leaving the default in force (and the operator believing otherwise)."""
    prefix = f"INFERMESH_{service.upper()}_"
    known = env_names(config_cls, service)
    unknown = sorted(name for name in environ if name.startswith(prefix) and name not in known)
    if not unknown:
        return
    hints = []
    suffixes = [name[len(prefix):] for name in sorted(known)]
    for name in unknown:
        # Compare what follows the shared prefix, or every name would look alike.
        close = difflib.get_close_matches(name[len(prefix):], suffixes, n=1, cutoff=0.75)
        hints.append(f"{name} (did you mean {prefix}{close[0]}?)" if close else name)
    raise ConfigError(f"unknown variable{'s' if len(unknown) > 1 else ''} for the {service}: {', '.join(hints)}; "
                      f"`python -m services.{service} --help` lists every setting")


def require(condition: bool, message: str) -> None:
    """Validation inside a config's __post_init__."""
    if not condition:
        raise ConfigError(message)


def check_minimums(config: DataclassInstance) -> None:
    """Every field declared with `setting(..., minimum=m)` holds at least m, all refused in one wording."""
    for f in dataclasses.fields(config):
        minimum = f.metadata.get("minimum")
        if minimum is not None:
            value = getattr(config, f.name)
            require(value >= minimum, f"{f.name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ServerSettings:
    """Fields every service has; each service's config extends this."""

    host: str = setting("127.0.0.1", "address the gRPC server binds to")
    port: int = setting(0, "gRPC port; 0 picks a free port")
    metrics_port: int = setting(-1, "Prometheus /metrics HTTP port; 0 picks a free one, -1 disables")
    drain_grace_s: float = setting(10.0, "on SIGTERM, how long in-flight work may finish")
    drain_notice_ms: float = setting(
        0.0, "on SIGTERM, how long to go on serving new calls after health turns NOT_SERVING and before the "
        "server stops (GOAWAY): clients with client-side health checking move off meanwhile, so no call "
        "reaches the server as it stops (grpc/grpc#41785); it then serves on until the calls grpc queued before "
        "are handed over (at most drain_grace_s less 1 s)", minimum=0)
    max_message_bytes: int = setting(8 * 1024 * 1024, "largest gRPC message accepted")
    keepalive_min_ping_interval_ms: int = setting(
        10_000, "shortest gap between a client's pings on a connection with no data that this server accepts "
        "(faster pingers are sent GOAWAY); workers' --attach-keepalive-ms must not be below it")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = setting("text", "text (one line per record, request and trace ids in brackets) or json "
                                      "(one object per line); docs/operations.md")
    # TLS (docs/security.md). Plaintext while tls_cert_file is empty, with a loud warning at start.
    tls_cert_file: str = setting("", "PEM certificate (chain) this process presents as server and client; empty: plaintext")
    tls_key_file: str = setting("", "PEM private key of tls_cert_file; both files are re-read when they rotate")
    tls_ca_file: str = setting("", "PEM CA bundle that verifies peers (client certs here, server certs upstream)")
    tls_client_auth: str = setting(
        "auto", "require (mTLS: verify client certs), none, or auto: none at the gateway (tenants use API keys), "
        "require at the scheduler and workers; optional (gateway HTTP port: ask for a client certificate and "
        "verify one if sent; grpcio cannot ask without requiring, so the gRPC port does not ask)")
    tls_identity_check: bool = setting(
        True, "with client certs required, allow each method only to the identities in the policy; "
        "off only where a service mesh does mTLS and authorization instead")
    tls_allowed_gateway_ids: tuple[str, ...] = setting(
        ("spiffe://infermesh/gateway",), "peer ids (SPIFFE URI or DNS SAN) that may call the scheduler as a gateway")
    tls_allowed_worker_ids: tuple[str, ...] = setting(
        ("spiffe://infermesh/worker",), "peer ids (SPIFFE URI or DNS SAN) that may Attach to the scheduler as workers")
    tls_allowed_admin_ids: tuple[str, ...] = setting(
        ("spiffe://infermesh/operator",), "peer ids (SPIFFE URI or DNS SAN) that may call Admin/GetStatus "
        "(infermesh status) under mTLS")
    metrics_tls: bool = setting(True, "with TLS on, serve /metrics over HTTPS with the same certificate; "
                                      "off when scrapes stay inside the pod")
    plaintext: bool = setting(False, "serve gRPC without TLS (development only; logged as a warning): without it, "
                                     "a process given no --tls-cert-file refuses to start")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert_file)

    def require_listener_security(self, service_name: str) -> None:
        """Plaintext only when asked for by name: a process started without its certificate files
        (a lost mount, a mistyped variable) must not quietly serve in clear. Checked at start, not in
        __post_init__, so that code building settings for other purposes needs neither."""
        require(self.tls_enabled or self.plaintext,
                f"no TLS certificate: give --tls-cert-file and --tls-key-file (and --tls-ca-file for mutual TLS; "
                f"INFERMESH_{service_name.upper()}_TLS_* in the environment), or --plaintext "
                f"(INFERMESH_{service_name.upper()}_PLAINTEXT=true) to serve without TLS (development only)")

    def __post_init__(self) -> None:
        check_minimums(self)  # the subclass's declared minimums too: a service's config extends this
        require(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        require(-1 <= self.metrics_port <= 65535, f"metrics_port must be -1..65535, got {self.metrics_port}")
        require(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        require(self.max_message_bytes >= 1024, f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        require(self.keepalive_min_ping_interval_ms >= 1000,
                f"keepalive_min_ping_interval_ms must be >= 1000, got {self.keepalive_min_ping_interval_ms}")
        require(
            self.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"),
            f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}",
        )
        require(self.log_format in ("text", "json"), f"log_format must be text or json, got {self.log_format!r}")
        require(bool(self.tls_cert_file) == bool(self.tls_key_file),
                "tls_cert_file and tls_key_file go together: set both or neither")
        require(self.tls_client_auth in ("auto", "require", "optional", "none"),
                f"tls_client_auth must be auto, require, optional or none, got {self.tls_client_auth!r}")
        require(not (self.plaintext and self.tls_enabled),
                "--plaintext and --tls-cert-file contradict each other: give the certificate files, or --plaintext")
        require(not self.tls_ca_file or self.tls_enabled,
                "tls_ca_file is set but tls_cert_file is not: TLS needs this process's own certificate too")
