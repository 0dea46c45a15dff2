"""Gateway CPU per request for callers recognised by API key, client certificate and JWT (issue 38).

    .venv/bin/python -m bench.gateway.bench_identity [--quick] [--rounds 3]

A toy mesh over TLS (scheduler, toy classifier with no compute) and two gateways on it: today's
(server TLS, no client certificates, tenants by key) and one with --tls-client-auth require and a
tenants file that also names a SPIFFE id and a JWT subject. A grpc.aio client in this process
drives Classify on one channel per phase (the handshake is paid once, as a pooled client does).
Gateway CPU is read from /proc/<pid>/stat before and after each phase, minus its idle rate, as
bench_gateway.py does, and divided by the requests. Phases, each round in this order:

  today: key             the key path on a gateway without client certificates
  key                    the identity gateway: a certificate no tenant names, and a key
  mtls                   a certificate that is a tenant, no authorization
  jwt (cache warm)       a certificate no tenant names, and a JWT verified once before the phase
  refused: bad key       UNAUTHENTICATED, unknown key
  refused: no identity   UNAUTHENTICATED, a certificate no tenant names and nothing else
  refused: unknown kid   UNAUTHENTICATED before any signature check
  refused: expired jwt   UNAUTHENTICATED after a signature check (refusals are not cached)

The medians over rounds go in the table. The target: with the cache warm the JWT path adds at most
10% over the key path on the same gateway. Whole-request CPU on a shared box moves by more than
that between rounds, so the recognition itself is also timed in this process
(`TenantDirectory.recognize`, best of several repeats of 20 000 calls): what each path adds to a
request is that difference, against a whole request's CPU above. The client shares the machine's cores with the
gateway and (on the project's machines) with other work: compare phases of one run, not runs.
Writes ``bench/results/identity.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.gateway.classify_load import classify_codes
from bench.harness.cpu import busy_cpu_s, cpu_seconds, idle_rates
from bench.harness.results import RESULTS_DIR, write_report
from services.gateway.tenants.directory import hash_api_key
from tools.dev_ca import DevCA, IssuedCert
from tools.testbed import session_tls
from tools.testbed.jwt_issuer import ISSUER, TestIssuer
from tools.testbed.processes import ServiceProcess, free_port, running_mesh, wait_until

RESULTS_PATH = RESULTS_DIR / "identity.json"
KEY = "bench-identity-key"
SPIFFE = "spiffe://bench.test/ns/bench/sa/caller"
QUOTAS = ("{requests_per_s: 1000000, requests_burst: 1000000, tokens_per_s: 1000000, tokens_burst: 1000000, "
          "max_in_flight: 100000}")


def tenants_yaml(jwks: Path | None) -> str:
    jwt = (f'jwt:\n  issuers:\n    - {{issuer: "{ISSUER}", jwks_files: ["{jwks}"], audiences: [infermesh-gateway]}}\n'
           if jwks else "")
    identity = (f"    identities: {{spiffe_ids: ['{SPIFFE}'], jwt: [{{issuer: '{ISSUER}', subject: svc-bench}}]}}\n"
                if jwks else "")
    return (f"{jwt}tenants:\n  - id: bench\n    api_key_sha256: [{hash_api_key(KEY)}]\n    priority: critical\n"
            f"    allowed_models: '*'\n    quotas: {QUOTAS}\n{identity}")


@dataclass(frozen=True)
class Caller:
    cert: IssuedCert | None
    authorization: str | None
    expect: str  # the status code every request of the phase must end with


async def drive(address: str, ca_pem: bytes, caller: Caller, num_requests: int, concurrency: int) -> dict[str, int]:
    cert = caller.cert
    credentials = grpc.ssl_channel_credentials(ca_pem, cert.key_pem if cert else None, cert.cert_pem if cert else None)
    metadata = (("authorization", caller.authorization),) if caller.authorization else ()
    async with grpc.aio.secure_channel(address, credentials) as channel:
        return await classify_codes(channel, metadata, num_requests, concurrency)


def measure(pid: int, idle_cpu_per_s: float, run: Callable[[], dict[str, int]], num_requests: int,
            expect: str) -> float:
    """CPU microseconds per request of one phase on the gateway `pid`."""
    cpu_before, began = cpu_seconds(pid), time.perf_counter()
    codes = run()
    wall_s = time.perf_counter() - began
    if codes != {expect: num_requests}:
        raise RuntimeError(f"expected {num_requests} x {expect}, got {codes}")
    return busy_cpu_s(pid, cpu_before, idle_cpu_per_s, wall_s) / num_requests * 1e6


def run(num_admitted: int, num_refused: int, concurrency: int, rounds: int, idle_s: float) -> dict:
    pki = session_tls.session_pki()
    clients = DevCA("bench clients CA")
    issuer = TestIssuer()
    issuer.add_key("k1")
    with tempfile.TemporaryDirectory(prefix="bench-identity-") as tmp_dir, \
            running_mesh(Path(tmp_dir), tls=True) as mesh:
        tmp = Path(tmp_dir)
        jwks = tmp / "jwks.json"
        issuer.write_jwks(jwks)
        (tmp / "today.yaml").write_text(tenants_yaml(None))
        (tmp / "identity.yaml").write_text(tenants_yaml(jwks))
        bundle = tmp / "cas.pem"
        bundle.write_bytes(pki.ca_path.read_bytes() + clients.cert_pem)
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        today = mesh.start_gateway("--tenants-file", str(tmp / "today.yaml"), "--log-level", "WARNING")
        identity = ServiceProcess(
            "gateway-identity", "gateway", free_port(),
            ["--scheduler-address", mesh.scheduler.address, "--tenants-file", str(tmp / "identity.yaml"),
             "--log-level", "WARNING", "--tls-ca-file", str(bundle), "--tls-client-auth", "require"],
            {}, tmp / "gateway-identity.log")
        mesh.processes.append(identity)
        identity.start()
        wait_until(lambda: identity.alive() and _serving(identity.address, pki.ca_path.read_bytes(), clients),
                   timeout_s=60, interval_s=0.2, message="identity gateway serving")
        ca_pem = pki.ca_path.read_bytes()
        matched, unmatched = clients.issue("bench", uris=[SPIFFE]), clients.issue("other", uris=["spiffe://bench.test/x"])
        token = issuer.token("svc-bench")
        expired = issuer.token(claims=issuer.claims("svc-bench", now_s=time.time() - 3600))
        unknown_kid = TestIssuer()
        unknown_kid.add_key("k-unknown")
        phases: dict[str, tuple[ServiceProcess, Caller, int]] = {
            "today: key": (today, Caller(None, f"Bearer {KEY}", "OK"), num_admitted),
            "key": (identity, Caller(unmatched, f"Bearer {KEY}", "OK"), num_admitted),
            "mtls": (identity, Caller(matched, None, "OK"), num_admitted),
            "jwt (cache warm)": (identity, Caller(unmatched, f"Bearer {token}", "OK"), num_admitted),
            "refused: bad key": (identity, Caller(unmatched, "Bearer no-such-key", "UNAUTHENTICATED"), num_refused),
            "refused: no identity": (identity, Caller(unmatched, None, "UNAUTHENTICATED"), num_refused),
            "refused: unknown kid": (identity, Caller(unmatched, f"Bearer {unknown_kid.token('svc-bench')}",
                                                      "UNAUTHENTICATED"), num_refused),
            "refused: expired jwt": (identity, Caller(unmatched, f"Bearer {expired}", "UNAUTHENTICATED"), num_refused),
        }
        for gateway, caller, _ in phases.values():  # warm channels, code paths and the token cache
            asyncio.run(drive(gateway.address, ca_pem, caller, 200, concurrency))
        idle = idle_rates({p.name: p.proc.pid for p in (today, identity)}, idle_s)
        samples: dict[str, list[float]] = {name: [] for name in phases}
        for _ in range(rounds):
            for name, (gateway, caller, count) in phases.items():
                samples[name].append(measure(
                    gateway.proc.pid, idle[gateway.name],
                    lambda g=gateway, c=caller, n=count: asyncio.run(drive(g.address, ca_pem, c, n, concurrency)),
                    count, caller.expect))
        recognition = recognition_us(tmp)
    medians = {name: round(statistics.median(values), 1) for name, values in samples.items()}
    return {
        "recognition_us_per_call": recognition,
        "benchmark": "identity",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "load_average_1m": os.getloadavg()[0]},
        "settings": {"num_admitted": num_admitted, "num_refused": num_refused, "concurrency": concurrency,
                     "rounds": rounds},
        "idle_gateway_cpu_ms_per_s": {k: round(v * 1000, 2) for k, v in idle.items()},
        "cpu_us_per_request": {name: [round(v, 1) for v in values] for name, values in samples.items()},
        "median_cpu_us_per_request": medians,
        "jwt_over_key": round(medians["jwt (cache warm)"] / medians["key"], 3),
        "mtls_over_key": round(medians["mtls"] / medians["key"], 3),
        "key_over_today": round(medians["key"] / medians["today: key"], 3),
    }


def recognition_us(jwks_dir: Path, repeats: int = 5, calls: int = 20_000) -> dict[str, float]:
    """Microseconds per TenantDirectory.recognize call for each kind of caller (best of `repeats`)."""
    import timeit

    from services.common.errors import InfermeshError
    from services.common.identity import PeerIdentity
    from services.gateway.tenants.credentials import Credentials
    from services.gateway.tenants.directory import TenantDirectory, parse_tenant_config

    issuer = TestIssuer()
    issuer.add_key("k1")
    jwks = jwks_dir / "jwks.json"
    issuer.write_jwks(jwks)
    directory = TenantDirectory(parse_tenant_config(tenants_yaml(jwks), "bench"))
    other = PeerIdentity(("spiffe://bench.test/x",))
    expired = issuer.token(claims=issuer.claims("svc-bench", now_s=time.time() - 3600))
    callers = {
        "key": f"Bearer {KEY}",
        "key + unmatched cert": Credentials(f"Bearer {KEY}", other),
        "mtls": Credentials(None, PeerIdentity((SPIFFE,))),
        "jwt (cache warm)": f"Bearer {issuer.token('svc-bench')}",
        "refused: bad key": "Bearer no-such-key",
        "refused: expired jwt": f"Bearer {expired}",
    }

    def call(authorization) -> None:
        try:
            directory.recognize(authorization)
        except InfermeshError:
            pass

    out = {}
    for name, authorization in callers.items():
        call(authorization)  # the token's one signature check happens here, not in the timing
        n = calls if not name.endswith("expired jwt") else calls // 20
        best_s = min(timeit.repeat(lambda a=authorization: call(a), number=n, repeat=repeats))
        out[name] = round(best_s / n * 1e6, 2)
    return out


def _serving(address: str, ca_pem: bytes, clients: DevCA) -> bool:
    cert = clients.issue("probe", uris=["spiffe://bench.test/probe"])
    codes = asyncio.run(drive(address, ca_pem, Caller(cert, None, ""), 1, 1))
    return codes.get("UNAUTHENTICATED") == 1


def print_table(results: dict) -> None:
    print("TenantDirectory.recognize alone, us per call: " + ", ".join(
        f"{name} {us:.2f}" for name, us in results["recognition_us_per_call"].items()))
    print(f"{'phase':<22} {'median CPU us/req':>18}   rounds")
    for name, median in results["median_cpu_us_per_request"].items():
        print(f"{name:<22} {median:>18.1f}   {results['cpu_us_per_request'][name]}")
    print(f"jwt / key {results['jwt_over_key']:.3f} (target <= 1.10); mtls / key {results['mtls_over_key']:.3f}; "
          f"key with client certificates / today's key {results['key_over_today']:.3f}; "
          f"load average {results['host']['load_average_1m']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-admitted", type=int, default=2000)
    parser.add_argument("--num-refused", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    args = parser.parse_args()
    if args.quick:
        args.num_admitted, args.num_refused = args.num_admitted // 4, args.num_refused // 4
    results = run(args.num_admitted, args.num_refused, args.concurrency, args.rounds, args.idle_s)
    print_table(results)
    write_report(RESULTS_PATH, results)


if __name__ == "__main__":
    main()
