"""Container images (deploy/docker) and the compose file (deploy/compose.yaml).

No Docker engine runs here, so nothing is built: each Dockerfile is linted with hadolint and
its structure checked (pinned bases, non-root, ports, env the service reads, stubs generated
in the image); compose.yaml is validated against the Compose Specification's JSON schema.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import math
import re
import shlex
from concurrent import futures

import grpc
import pytest
import yaml
from deploy_manifests import CONFIG_OF
from deploy_tools import CHECK_JSONSCHEMA_PIP, DOCKERFILE_PARSE_PIP, REPO, pip_module, pip_tool, run
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import ConfigError, env_names, load_config

DOCKER = REPO / "deploy" / "docker"
COMPOSE = REPO / "deploy" / "compose.yaml"
IMAGES = {"gateway": "gateway", "scheduler": "scheduler", "worker-cpu": "worker", "worker-cuda": "worker"}
PROTOC = ("python -m grpc_tools.protoc -Iprotos --python_out=gen/python --pyi_out=gen/python "
          "--grpc_python_out=gen/python protos/infermesh/v1/*.proto protos/inference/*.proto")


def instructions(image: str) -> list[tuple[str, str]]:
    parser = pip_module("dockerfile_parse", DOCKERFILE_PARSE_PIP).DockerfileParser(str(DOCKER / f"{image}.Dockerfile"))
    return [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def final_stage(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (instruction, _) in enumerate(steps) if instruction == "FROM")
    return steps[last_from:]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, value in steps:
        if instruction == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(value))
    return env


def test_there_is_one_image_per_service_and_a_cpu_and_cuda_worker():
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKER.glob("*.Dockerfile")} == set(IMAGES)


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_passes_hadolint(hadolint, image):
    done = run([hadolint, "--no-color", str(DOCKER / f"{image}.Dockerfile")])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned_by_version_tag(image):
    for instruction, value in instructions(image):
        if instruction == "FROM":
            base = value.split()[0]
            name, _, tag = base.partition(":")
            assert re.fullmatch(r"\d+\.\d+\.\d+-slim-\w+", tag), f"{image}: unpinned base {base}"


@pytest.mark.parametrize("image", IMAGES)
def test_image_runs_its_service_as_a_non_root_user(image):
    final = final_stage(instructions(image))
    users = [value for instruction, value in final if instruction == "USER"]
    assert users, f"{image}: final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    (entrypoint,) = [value for instruction, value in final if instruction == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == ["python", "-m", f"services.{IMAGES[image]}"]


@pytest.mark.parametrize("image", IMAGES)
def test_image_env_is_read_by_the_service_and_matches_exposed_ports(image):
    service = IMAGES[image]
    final = final_stage(instructions(image))
    env = env_of(final)
    readable = env_names(CONFIG_OF[service], service)
    assert {n for n in env if n.startswith("INFERMESH_")} <= readable
    if service == "gateway":
        # The image alone fails closed: a deployment mounts the tenants file (k8s gateway.env, compose).
        with pytest.raises(ConfigError, match="no tenants file"):
            load_config(CONFIG_OF[service], service, argv=[], environ=env)
        env = {**env, "INFERMESH_GATEWAY_TENANTS_FILE": "/etc/infermesh/tenants/tenants.yaml"}
    config = load_config(CONFIG_OF[service], service, argv=[], environ=env)
    (exposed,) = [value for instruction, value in final if instruction == "EXPOSE"]
    assert {int(p) for p in exposed.split()} == {config.port, config.metrics_port}
    assert config.host == "0.0.0.0"
    assert "/app/gen/python" in env["PYTHONPATH"].split(":")
    # Writes only under /tmp: bytecode compiled at build time, caches pointed at /tmp.
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["HOME"] == "/tmp"
    if service == "worker":
        assert env["NUMBA_CACHE_DIR"].startswith("/tmp/")


@pytest.mark.parametrize("image", IMAGES)
def test_image_installs_only_its_services_set_and_generates_the_stubs(image):
    service = IMAGES[image]
    copies = [value for instruction, value in instructions(image) if instruction == "COPY"]
    assert f"requirements/{service}.txt requirements.txt" in copies, f"{image}: not its own dependency set"
    assert not any("requirements.lock" in value for value in copies), f"{image}: installs the whole lock"
    runs = " ".join(value for instruction, value in instructions(image) if instruction == "RUN")
    assert "pip install --no-cache-dir -r requirements.txt" in runs
    # The stub generator lives in its own venv, which the final stage does not copy.
    assert "/opt/protoc/bin/" + PROTOC in runs
    final_copies = [v for i, v in final_stage(instructions(image)) if i == "COPY"]
    assert not any("/opt/protoc" in value for value in final_copies)
    assert "compileall" in runs
    if image == "worker-cuda":
        assert "numba-cuda" in " ".join(v for i, v in instructions(image) if i == "ARG")
        assert '--index-url "${TORCH_INDEX_URL}"' in runs
    elif image == "worker-cpu":
        assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu" in runs
    else:
        assert "torch" not in runs, f"{image}: the gateway and the scheduler run without torch"


@pytest.mark.parametrize("image", IMAGES)
def test_dockerignore_lets_in_everything_the_dockerfile_copies(image):
    patterns = [line for line in (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    for instruction, value in instructions(image):
        if instruction == "COPY" and not value.startswith("--from"):
            for source in value.split()[:-1]:
                probe = source.rstrip("/") + ("/x.py" if source.endswith("/") else "")
                assert not ignored(probe, patterns), f"{image}: COPY {source} is excluded by its .dockerignore"
    # ...and keeps the rest of the repository (virtualenvs, tests, other models) out of the context;
    # only workers take the shipped demo models.
    outside = [".venv/bin/python", "model_repo/other/1/weights.pt", "tests/unit/x.py", "services/__pycache__",
               "requirements.lock", "tools/build_models.py"]
    if IMAGES[image] != "worker":
        outside.append("model_repo/digits/1/manifest.json")
    for path in outside:
        assert ignored(path, patterns), f"{image}: {path} would be sent to the build"


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!")
        if fnmatch.fnmatch(path, glob) or fnmatch.fnmatch(path, glob.removesuffix("/**") + "/*"):
            verdict = not negate
    return verdict


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_validates_against_the_compose_specification():
    pip_module("check_jsonschema", CHECK_JSONSCHEMA_PIP)
    checker = pip_tool("check-jsonschema", CHECK_JSONSCHEMA_PIP)
    done = run([checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)])
    assert done.returncode == 0, done.stdout + done.stderr


def infermesh_services(compose: dict):
    """Services running an infermesh image's own entry point (not the one-shot tls-init)."""
    for name, spec in compose["services"].items():
        image = spec["image"].split(":")[0].removeprefix("infermesh/")
        if image in IMAGES and "entrypoint" not in spec:
            yield name, spec, image


def test_compose_services_run_mtls_with_certificates_tls_init_writes_first(compose):
    init = compose["services"]["tls-init"]
    command = " ".join(init["command"])
    assert "python -m tools.dev_ca --out /etc/infermesh/tls" in command
    assert init["volumes"] == ["tls:/etc/infermesh/tls"] and init["network_mode"] == "none"
    assert init["cap_drop"] == ["ALL"] and set(init["cap_add"]) == {"CHOWN", "DAC_OVERRIDE"}
    dialed = set(schedulers(compose)) | {"gateway"}
    assert dialed <= set(command.split("--dns", 1)[1].split("&&")[0].split()), "names peers dial"
    for name, spec, image in infermesh_services(compose):
        service = IMAGES[image]
        env = {k: str(v) for k, v in spec["environment"].items()}
        config = load_config(CONFIG_OF[service], service, argv=[], environ=env)
        assert (config.tls_cert_file, config.tls_key_file, config.tls_ca_file) == (
            f"/etc/infermesh/tls/{service}.pem", f"/etc/infermesh/tls/{service}-key.pem", "/etc/infermesh/tls/ca.pem")
        assert spec["volumes"] == ["tls:/etc/infermesh/tls:ro"], name
        assert spec["depends_on"]["tls-init"] == {"condition": "service_completed_successfully"}, name


def test_compose_builds_every_infermesh_service_from_its_dockerfile(compose):
    seen = set()
    for name, spec, image in infermesh_services(compose):
        seen.add(image)
        assert spec["build"]["dockerfile"] == f"deploy/docker/{image}.Dockerfile", name
        assert (COMPOSE.parent / spec["build"]["context"]).resolve() == REPO
    assert seen == set(IMAGES)


def test_compose_services_are_hardened_and_stop_slower_than_they_drain(compose):
    for name, spec, image in infermesh_services(compose):
        assert spec["read_only"] is True and spec["cap_drop"] == ["ALL"], name
        assert spec["user"].split(":")[0] != "0", name
        assert any(t.startswith("/tmp") for t in spec["tmpfs"]), name
        service = IMAGES[image]
        env = {**env_of(final_stage(instructions(image))), **{k: str(v) for k, v in spec["environment"].items()}}
        assert {n for n in spec["environment"] if n.startswith("INFERMESH_")} <= env_names(CONFIG_OF[service], service)
        config = load_config(CONFIG_OF[service], service, argv=[], environ=env)
        stop_s = int(spec["stop_grace_period"].removesuffix("s"))
        assert stop_s > config.drain_grace_s, name
        if service != "scheduler":
            assert config.scheduler_address == ",".join(f"{s}:50052" for s in schedulers(compose)), name


def schedulers(compose: dict) -> list[str]:
    return [name for name, spec, image in infermesh_services(compose) if image == "scheduler"]


def test_compose_runs_two_schedulers_and_a_quota_store_the_gateway_leases_from(compose):
    assert schedulers(compose) == ["scheduler", "scheduler-2"]
    store = compose["services"]["quota-store"]
    repository, _, tag = store["image"].rpartition(":")
    assert repository == "valkey/valkey" and tag[0].isdigit() and tag.count(".") == 2, store["image"]
    assert store["read_only"] is True and store["cap_drop"] == ["ALL"] and store["user"].split(":")[0] != "0"
    assert "ports" not in store, "only the gateway (on the compose network) reaches the store"
    command = store["command"]
    assert command[command.index("--port") + 1] == "6379"
    assert "valkey-cli" in store["healthcheck"]["test"]
    gateway = compose["services"]["gateway"]
    assert gateway["environment"]["INFERMESH_GATEWAY_QUOTA_STORE_ADDRESS"] == "quota-store:6379"
    # A gateway serves without the store (fallback shares), so it does not wait for it to be healthy.
    assert gateway["depends_on"]["quota-store"] == {"condition": "service_started"}
    for name, spec, image in infermesh_services(compose):
        if image != "scheduler" and "depends_on" in spec:
            assert {s: {"condition": "service_healthy"} for s in schedulers(compose)}.items() <= spec["depends_on"].items(), name


def test_compose_workers_have_a_cpu_limit_and_threads_to_match(compose):
    workers = [(name, spec) for name, spec, image in infermesh_services(compose) if IMAGES[image] == "worker"]
    assert workers
    for name, spec in workers:
        config = load_config(CONFIG_OF["worker"], "worker", argv=[], environ={k: str(v) for k, v in
                                                                             spec["environment"].items()})
        assert float(spec["cpus"]) >= 1, name
        assert config.num_threads == math.ceil(float(spec["cpus"])), name


def test_compose_gateway_reads_the_tenants_secret(compose):
    gateway = compose["services"]["gateway"]
    (secret,) = gateway["secrets"]
    assert gateway["environment"]["INFERMESH_GATEWAY_TENANTS_FILE"] == f"/run/secrets/{secret['target']}"
    assert (COMPOSE.parent / compose["secrets"][secret["source"]]["file"]).is_file()


def test_compose_prometheus_scrapes_the_ports_the_images_serve_metrics_on(compose):
    config = yaml.safe_load((REPO / "deploy/observability/prometheus/prometheus-compose.yml").read_text())
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = set()
    for name, spec, image in infermesh_services(compose):
        if "profiles" not in spec:
            service = IMAGES[image]
            expected.add(f"{name}:{env_of(final_stage(instructions(image)))[f'INFERMESH_{service.upper()}_METRICS_PORT']}")
    assert targets == expected


# --------------------------------------------------------------------------- healthcheck.py


@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def healthcheck_main():
    spec = importlib.util.spec_from_file_location("infermesh_healthcheck", DOCKER / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_healthcheck_exits_zero_only_while_serving(health_server):
    servicer, port = health_server
    main = healthcheck_main()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["gateway"], {"INFERMESH_GATEWAY_PORT": str(port)}) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([f"127.0.0.1:{port}"], {}) == 1


def test_healthcheck_fails_on_no_server_and_on_usage_errors():
    main = healthcheck_main()
    assert main(["127.0.0.1:1"], {}) == 1
    assert main(["worker"], {}) == 2  # INFERMESH_WORKER_PORT unset
    assert main([], {}) == 2
