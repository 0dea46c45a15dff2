"""Kubernetes manifests (deploy/k8s): rendered with kustomize, checked against the API schemas
and against what the services actually read and serve."""

from __future__ import annotations

import copy
import math
import posixpath
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_manifests import (
    DOWNWARD_HELPERS,
    OTEL_ENV,
    OVERLAYS,
    SERVICES,
    by_name,
    container_of,
    cpu_cores,
    env_names_of,
    environment,
    infermesh_deployments,
    loaded_config,
    of_kind,
    pod_labels,
    quota_store,
    references,
    resource_field_value,
    selects,
    service_of,
)
from deploy_tools import KUBERNETES_VALIDATE_PIP, REPO, pip_module

from services.common.config import env_names

# Oldest supported (preStop sleep action) and newest the schemas know.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
DOCKERFILES = {p.name.removesuffix(".Dockerfile") for p in (REPO / "deploy" / "docker").glob("*.Dockerfile")}


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pip_module("kubernetes_validate", KUBERNETES_VALIDATE_PIP)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kustomization", [*OVERLAYS, "observability"])
def test_every_manifest_validates_against_the_kubernetes_schema(rendered, kubernetes_validate, kustomization, version):
    failures = []
    for doc in rendered[kustomization]:
        try:
            if doc["apiVersion"].startswith(CERT_MANAGER_GROUP):
                cert_manager_validator(doc["kind"]).validate(doc)
            else:
                kubernetes_validate.validate(doc, version, strict=True)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not failures, "\n".join(failures)


CERT_MANAGER_GROUP = "cert-manager.io/"
CERT_MANAGER_SCHEMA = Path(__file__).parent / "schemas" / "cert-manager-v1.yaml"


def cert_manager_validator(kind: str) -> jsonschema.protocols.Validator:
    """cert-manager's CRDs are not in kubernetes-validate: their objects are checked against the
    vendored subset of the CRD schemas, which refuses unknown fields as strict mode does."""
    schema = yaml.safe_load(CERT_MANAGER_SCHEMA.read_text())
    if kind not in schema["$defs"]:
        raise jsonschema.ValidationError(f"no vendored cert-manager schema for kind {kind}")
    return jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{kind}"})


def test_cert_manager_schema_rejects_a_misspelt_field(rendered):
    certificate = copy.deepcopy(next(c for c in of_kind(rendered["cpu"], "Certificate") if "dnsNames" in c["spec"]))
    cert_manager_validator("Certificate").validate(certificate)
    certificate["spec"]["dnsName"] = certificate["spec"].pop("dnsNames")
    with pytest.raises(jsonschema.ValidationError):
        cert_manager_validator("Certificate").validate(certificate)


def test_schema_validation_rejects_a_misspelt_probe_field(rendered, kubernetes_validate):
    # Proves the check above is not vacuous: strict mode refuses unknown fields.
    deployment = copy.deepcopy(infermesh_deployments(rendered["cpu"])[0])
    container_of(deployment)["readinessProbe"]["grpc"] = {"prot": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_has_deployment_service_account_config_map_and_disruption_budget(rendered, overlay):
    docs = rendered[overlay]
    deployments = infermesh_deployments(docs)
    assert {service_of(d) for d in deployments} == set(SERVICES)
    for deployment in deployments:
        name, labels = deployment["metadata"]["name"], pod_labels(deployment)
        assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
        pod_spec = deployment["spec"]["template"]["spec"]
        by_name(docs, "ServiceAccount", pod_spec["serviceAccountName"])
        for source in container_of(deployment)["envFrom"]:
            by_name(docs, "ConfigMap", source["configMapRef"]["name"])
        services = [s for s in of_kind(docs, "Service") if selects(s["spec"]["selector"], labels)]
        # The gateway has two: a ClusterIP and a headless one for clients that round_robin over its pods.
        expected = 2 if service_of(deployment) == "gateway" else 1
        assert len(services) == expected, f"{name}: expected {expected} Services selecting its pods, found {len(services)}"
        budgets = [p for p in of_kind(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(budgets) == 1, f"{name}: expected one PodDisruptionBudget, found {len(budgets)}"
        # A budget must never select another Deployment's pods.
        others = [pod_labels(d) for d in deployments if d is not deployment]
        assert not any(selects(budgets[0]["spec"]["selector"]["matchLabels"], o) for o in others), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_can_be_applied_alone_by_its_name_label(rendered, overlay):
    # `kubectl apply -l app.kubernetes.io/name=<service>` must carry everything the pods need.
    docs = rendered[overlay]
    for deployment in infermesh_deployments(docs):
        service = service_of(deployment)
        labelled = {(d["kind"], d["metadata"]["name"]) for d in docs
                    if d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == service}
        pod = deployment["spec"]["template"]["spec"]
        needed = {("Deployment", deployment["metadata"]["name"]), ("ServiceAccount", pod["serviceAccountName"])}
        needed |= {("ConfigMap", s["configMapRef"]["name"]) for s in container_of(deployment)["envFrom"]}
        needed |= {(d["kind"], d["metadata"]["name"]) for d in of_kind(docs, "PodDisruptionBudget") + of_kind(docs, "Service")
                   if selects(d["spec"].get("selector", {}).get("matchLabels", d["spec"].get("selector")), pod_labels(deployment))}
        assert needed <= labelled, f"{service}: not labelled {needed - labelled}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_names_are_ones_the_service_config_reads(rendered, overlay):
    docs = rendered[overlay]
    for deployment in infermesh_deployments(docs):
        service = service_of(deployment)
        readable = env_names(type(loaded_config(deployment, docs)), service)
        raw_env = {item["name"]: item for item in container_of(deployment).get("env", [])}
        used_helpers = set().union(*(references(item.get("value", "")) for item in raw_env.values()))
        for name, origin in env_names_of(deployment, docs).items():
            if name.startswith("INFERMESH_"):
                assert name in readable, f"{deployment['metadata']['name']}: {name} ({origin}) is not read by {service}"
            elif name in DOWNWARD_HELPERS:
                assert name in used_helpers, f"{deployment['metadata']['name']}: helper {name} is never substituted"
            else:
                assert name in OTEL_ENV, f"{deployment['metadata']['name']}: {name} ({origin}) is read by nothing"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_config_loads_from_the_manifest_environment(rendered, overlay):
    docs = rendered[overlay]
    for deployment in infermesh_deployments(docs):
        config = loaded_config(deployment, docs)
        ports = {p["name"]: p["containerPort"] for p in container_of(deployment)["ports"]}
        assert config.host == "0.0.0.0", "bind all interfaces inside the pod"
        assert (config.port, config.metrics_port) == (ports["grpc"], ports["metrics"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_serve_a_pinned_model_version_and_use_their_pod_name_as_id(rendered, overlay):
    docs = rendered[overlay]
    workers = [d for d in infermesh_deployments(docs) if service_of(d) == "worker"]
    assert {loaded_config(w, docs).model_name for w in workers} == {"digits", "tinylm"}
    for worker in workers:
        config = loaded_config(worker, docs)
        assert config.model_version.isdigit(), "versions are immutable numbers; there is no 'latest'"
        assert pod_labels(worker)["infermesh.dev/model"] == config.model_name
        assert pod_labels(worker)["infermesh.dev/version"] == config.model_version
        assert worker["metadata"]["name"].endswith(f"-{config.model_name}-v{config.model_version}")
        assert config.worker_id == "fieldref-metadata-name"


def scheduler_deployment(docs: list[dict]) -> dict:
    (scheduler,) = [d for d in infermesh_deployments(docs) if service_of(d) == "scheduler"]
    return scheduler


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_and_workers_discover_every_scheduler_through_the_headless_service(rendered, overlay):
    docs = rendered[overlay]
    scheduler = scheduler_deployment(docs)
    (service,) = [s for s in of_kind(docs, "Service") if selects(s["spec"]["selector"], pod_labels(scheduler))]
    # Headless: DNS answers with every ready pod's address, so a client sees each replica rather
    # than one virtual IP that pins its HTTP/2 connection to one pod.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False, "a draining scheduler must leave DNS"
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    container_port = next(p["containerPort"] for p in container_of(scheduler)["ports"] if p["name"] == "grpc")
    # Headless Services do no port mapping: clients dial the pod's own port.
    assert grpc_port["port"] == container_port and grpc_port["targetPort"] == "grpc"
    for deployment in infermesh_deployments(docs):
        if service_of(deployment) in ("gateway", "worker"):
            address = loaded_config(deployment, docs).scheduler_address
            assert address == f"dns:///{service['metadata']['name']}:{container_port}", deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clients_can_round_robin_over_every_gateway_through_a_headless_service_its_certificate_names(
        rendered, overlay):
    # Issue 35: a stock gRPC client with round_robin and health checking needs one DNS record per
    # gateway pod; a ClusterIP's one virtual IP pins its connection to one pod.
    docs = rendered[overlay]
    (gateway,) = [d for d in infermesh_deployments(docs) if service_of(d) == "gateway"]
    service = by_name(docs, "Service", "infermesh-gateway-headless")
    assert selects(service["spec"]["selector"], pod_labels(gateway))
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False, "a draining gateway must leave DNS"
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    container_port = next(p["containerPort"] for p in container_of(gateway)["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == container_port and grpc_port["targetPort"] == "grpc"
    certificate = next(c for c in of_kind(docs, "Certificate") if c["spec"].get("uris") == ["spiffe://infermesh/gateway"])
    name = service["metadata"]["name"]
    namespace = by_name(docs, "Namespace", "infermesh")["metadata"]["name"]
    for dialled in (name, f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"):
        assert dialled in certificate["spec"]["dnsNames"], f"clients dialling {dialled} verify it"
    assert f"dns:///{name}.{namespace}.svc" in (REPO / "docs" / "operations.md").read_text(), "documented for clients"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_two_active_schedulers_of_which_evictions_leave_one(rendered, overlay):
    docs = rendered[overlay]
    scheduler = scheduler_deployment(docs)
    replicas = scheduler["spec"]["replicas"]
    assert replicas == 2
    (budget,) = [p for p in of_kind(docs, "PodDisruptionBudget")
                 if selects(p["spec"]["selector"]["matchLabels"], pod_labels(scheduler))]
    assert budget["spec"]["minAvailable"] == 1 and "maxUnavailable" not in budget["spec"]
    # The budget still lets a node drain evict one (minAvailable == replicas would block every drain).
    assert replicas - budget["spec"]["minAvailable"] >= 1
    (spread,) = scheduler["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert selects(spread["labelSelector"]["matchLabels"], pod_labels(scheduler))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scheduler_hands_streams_over_early_in_its_grace_period(rendered, overlay):
    # A roll must not wait for long generations: streams are handed over (and resumed by the
    # gateway elsewhere) after drain_grace_ms, well inside the drain grace and the pod's grace.
    docs = rendered[overlay]
    scheduler = scheduler_deployment(docs)
    config = loaded_config(scheduler, docs)
    assert "INFERMESH_SCHEDULER_DRAIN_GRACE_MS" in environment(scheduler, docs), "say the handover grace explicitly"
    pause_s = container_of(scheduler)["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = scheduler["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert config.drain_grace_ms / 1000 <= 5, "streams wait at most a few seconds before handover"
    assert pause_s + config.drain_grace_ms / 1000 < pause_s + config.drain_grace_s < grace_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_check_grpc_health_on_the_grpc_port_with_the_pods_own_certificate(rendered, overlay):
    # The kubelet's native gRPC probe sends no client certificate and the ports require one (mTLS):
    # each pod probes itself with services.common.health_probe, which dials 127.0.0.1 on the port
    # its config names, with the TLS files its config names.
    docs = rendered[overlay]
    for deployment in infermesh_deployments(docs):
        service, container = service_of(deployment), container_of(deployment)
        config = loaded_config(deployment, docs)
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert config.port == grpc_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == ["python", "-m", "services.common.health_probe", service]
            assert container[probe]["timeoutSeconds"] >= 5, "a Python start fits in the probe's timeout"
        assert config.tls_enabled and config.tls_ca_file, deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_runs_mtls_with_a_cert_manager_certificate_naming_its_identity(rendered, overlay):
    docs = rendered[overlay]
    certificates = {c["spec"]["secretName"]: c for c in of_kind(docs, "Certificate")}
    for deployment in infermesh_deployments(docs):
        name, service = deployment["metadata"]["name"], service_of(deployment)
        config = loaded_config(deployment, docs)
        pod = deployment["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in container_of(deployment)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        paths = (config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
        folders = {posixpath.dirname(path) for path in paths}
        assert len(folders) == 1, f"{name}: TLS files in {folders}"
        secret = volumes[mounts[folders.pop()]]["secret"]["secretName"]
        assert [posixpath.basename(path) for path in paths] == ["tls.crt", "tls.key", "ca.crt"], name
        spec = certificates[secret]["spec"]
        assert spec["uris"] == [f"spiffe://infermesh/{service}"], name
        assert {"server auth", "client auth"} <= set(spec["usages"]), name
        assert "127.0.0.1" in spec["ipAddresses"], f"{name}: its exec probe dials 127.0.0.1"
        assert config.tls_client_auth == "auto" and config.tls_identity_check, name
        if service != "scheduler":  # the scheduler's callers verify the name they dial
            host = config.scheduler_address.removeprefix("dns:///").rsplit(":", 1)[0]
            scheduler_certificate = next(c for c in certificates.values()
                                         if c["spec"].get("uris") == ["spiffe://infermesh/scheduler"])
            assert host in scheduler_certificate["spec"]["dnsNames"], name
    # The self-signed CA bootstrap: selfSigned Issuer -> CA Certificate -> CA Issuer -> the leaves.
    issuers = {i["metadata"]["name"]: i["spec"] for i in of_kind(docs, "Issuer")}
    ca = next(c["spec"] for c in of_kind(docs, "Certificate") if c["spec"].get("isCA"))
    assert "selfSigned" in issuers[ca["issuerRef"]["name"]]
    leaf_issuers = {c["spec"]["issuerRef"]["name"] for c in certificates.values() if not c["spec"].get("isCA")}
    assert [issuers[name]["ca"]["secretName"] for name in leaf_issuers] == [ca["secretName"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_the_prestop_pause_and_the_drain(rendered, overlay):
    docs = rendered[overlay]
    for deployment in infermesh_deployments(docs):
        name = deployment["metadata"]["name"]
        drain_grace_s = loaded_config(deployment, docs).drain_grace_s
        container = container_of(deployment)
        pause_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s > pause_s + drain_grace_s, f"{name}: {grace_s}s <= {pause_s}s + {drain_grace_s}s"
        # Health turns NOT_SERVING when the drain starts; liveness must not kill a draining pod.
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_grace_s, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollouts_never_drop_below_the_desired_count_except_gpu_workers(rendered, overlay):
    for deployment in infermesh_deployments(rendered[overlay]):
        strategy = deployment["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        gpu_worker = overlay == "gpu" and service_of(deployment) == "worker"
        expected = {"maxSurge": 0, "maxUnavailable": 1} if gpu_worker else {"maxUnavailable": 0}
        assert expected.items() <= strategy["rollingUpdate"].items(), deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_non_root_read_only_without_privileges(rendered, overlay):
    docs = rendered[overlay]
    for deployment in infermesh_deployments(docs):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        assert by_name(docs, "ServiceAccount", pod["serviceAccountName"])["automountServiceAccountToken"] is False
        context = container_of(deployment)["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["capabilities"] == {"drop": ["ALL"]}, name
        assert context.get("privileged", False) is False, name
        # The one writable place is /tmp, an emptyDir.
        mounts = {m["mountPath"]: m["name"] for m in container_of(deployment)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], name
        writable = [path for path, volume in mounts.items() if "emptyDir" in volumes[volume]]
        assert writable == ["/tmp"], f"{name}: writable mounts {writable}"


def test_namespace_enforces_the_restricted_pod_security_standard(rendered):
    namespace = by_name(rendered["cpu"], "Namespace", "infermesh")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {d["metadata"].get("namespace") for d in rendered["cpu"] if d["kind"] != "Namespace"} == {"infermesh"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_cpu_and_memory_requests_and_limits(rendered, overlay):
    for deployment in infermesh_deployments(rendered[overlay]):
        resources = container_of(deployment)["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= resources[kind].keys(), f"{deployment['metadata']['name']} {kind}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_threads_follow_the_containers_cpu_limit(rendered, overlay):
    docs = rendered[overlay]
    for worker in (d for d in infermesh_deployments(docs) if service_of(d) == "worker"):
        container = container_of(worker)
        (item,) = [e for e in container["env"] if e["name"] == "INFERMESH_WORKER_NUM_THREADS"]
        ref = item["valueFrom"]["resourceFieldRef"]
        assert (ref["containerName"], ref["resource"]) == (container["name"], "limits.cpu")
        limit_cores = cpu_cores(container["resources"]["limits"]["cpu"])
        assert loaded_config(worker, docs).num_threads == math.ceil(limit_cores) >= 1
        if overlay == "cpu":
            # Threads sized to the limit need the limit's CPU time: a lower request would let busy
            # neighbours squeeze the pool below its size.
            assert cpu_cores(container["resources"]["requests"]["cpu"]) == limit_cores


def test_resource_field_values_round_up_like_the_kubelet():
    worker = {"spec": {"template": {"spec": {"containers": [
        {"name": "worker", "resources": {"limits": {"cpu": "1500m"}, "requests": {"cpu": "250m"}}}]}}}}
    assert resource_field_value(worker, {"resource": "limits.cpu"}) == 2
    assert resource_field_value(worker, {"resource": "requests.cpu", "containerName": "worker"}) == 1
    assert resource_field_value(worker, {"resource": "limits.cpu", "divisor": "500m"}) == 3


def test_only_gpu_overlay_workers_request_a_gpu(rendered):
    for overlay in OVERLAYS:
        for deployment in infermesh_deployments(rendered[overlay]):
            resources = container_of(deployment)["resources"]
            wants_gpu = overlay == "gpu" and service_of(deployment) == "worker"
            gpus = (resources["requests"].get("nvidia.com/gpu"), resources["limits"].get("nvidia.com/gpu"))
            assert gpus == ((1, 1) if wants_gpu else (None, None)), f"{overlay} {deployment['metadata']['name']}"
            if wants_gpu:
                tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
                assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_the_ones_deploy_docker_builds_with_pinned_tags(rendered, overlay):
    expected = {"gateway": "gateway", "scheduler": "scheduler", "worker": f"worker-{'cuda' if overlay == 'gpu' else 'cpu'}"}
    for deployment in infermesh_deployments(rendered[overlay]):
        repository, _, tag = container_of(deployment)["image"].rpartition(":")
        assert repository == f"infermesh/{expected[service_of(deployment)]}"
        assert repository.removeprefix("infermesh/") in DOCKERFILES
        assert tag and tag != "latest"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_reads_tenants_from_the_mounted_secret(rendered, overlay):
    docs = rendered[overlay]
    gateway = next(d for d in infermesh_deployments(docs) if service_of(d) == "gateway")
    tenants_file = loaded_config(gateway, docs).tenants_file
    mounts = {m["name"]: m for m in container_of(gateway)["volumeMounts"]}
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    secret_volumes = [name for name, v in volumes.items() if v.get("secret", {}).get("secretName") == "infermesh-tenants"]
    assert len(secret_volumes) == 1
    volume, mount = volumes[secret_volumes[0]], mounts[secret_volumes[0]]
    assert mount["readOnly"] is True and "subPath" not in mount, "subPath mounts never see Secret updates"
    item_paths = {item["path"] for item in volume["secret"]["items"]}
    assert posixpath.dirname(tenants_file) == mount["mountPath"]
    assert posixpath.basename(tenants_file) in item_paths


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_scales_on_cpu_and_each_worker_on_its_model_queue_time(rendered, overlay):
    docs = rendered[overlay]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    for deployment in infermesh_deployments(docs):
        name, service = deployment["metadata"]["name"], service_of(deployment)
        if service == "scheduler":
            assert name not in hpas, "schedulers are a fixed set of active replicas; workers are what scales"
            continue
        (metric,) = hpas[name]["spec"]["metrics"]
        if service == "gateway":
            assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
        else:
            assert metric["type"] == "External"
            assert metric["external"]["metric"]["name"] == "infermesh_scheduler_queue_time_p90_seconds"
            model = loaded_config(deployment, docs).model_name
            assert metric["external"]["metric"]["selector"]["matchLabels"] == {"model": model}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_traces_go_to_the_collector_service(rendered, overlay):
    collector = by_name(rendered["observability"], "Service", "otel-collector")
    grpc_port = next(p["port"] for p in collector["spec"]["ports"] if p["name"] == "otlp-grpc")
    expected = f"http://{collector['metadata']['name']}.{collector['metadata']['namespace']}.svc:{grpc_port}"
    for deployment in infermesh_deployments(rendered[overlay]):
        assert environment(deployment, rendered[overlay])["OTEL_EXPORTER_OTLP_ENDPOINT"] == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_quota_store_is_one_pinned_hardened_valkey_behind_a_service(rendered, overlay):
    docs = rendered[overlay]
    store = quota_store(docs)
    # A StatefulSet of one: never two stores at once, even mid-roll (a surge pod would split counters).
    assert store["spec"]["replicas"] == 1
    container = container_of(store)
    repository, _, tag = container["image"].rpartition(":")
    assert repository == "valkey/valkey" and tag[0].isdigit() and tag.count(".") == 2, container["image"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"valkey": 6379}
    assert by_name(docs, "Service", store["spec"]["serviceName"])
    (service,) = [s for s in of_kind(docs, "Service") if selects(s["spec"]["selector"], pod_labels(store))]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(6379, "valkey")]
    assert {"readinessProbe", "livenessProbe"} <= container.keys()
    args = container["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    pod = store["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all("emptyDir" in volumes[m["name"]] for m in container["volumeMounts"]), "writes go to emptyDirs only"
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_share_quotas_through_the_store(rendered, overlay):
    docs = rendered[overlay]
    gateway = next(d for d in infermesh_deployments(docs) if service_of(d) == "gateway")
    config = loaded_config(gateway, docs)
    store = quota_store(docs)
    (service,) = [s for s in of_kind(docs, "Service") if selects(s["spec"]["selector"], pod_labels(store))]
    assert config.quota_store_address == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    # Each gateway is named in the store by its pod, so leases and liveness are per replica.
    assert config.gateway_id == "fieldref-metadata-name"
    # Before the store has reported the live gateways, the fallback divides by the fewest there are.
    hpa = next(h for h in of_kind(docs, "HorizontalPodAutoscaler")
               if h["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"])
    assert config.quota_expected_gateways == hpa["spec"]["minReplicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_model_keeps_a_worker_per_scheduler(rendered, overlay):
    # A scheduler serves only the workers attached to it: with fewer workers of a model than
    # schedulers, rolling or losing the one that holds them leaves the model unserved while they move.
    docs = rendered[overlay]
    num_schedulers = scheduler_deployment(docs)["spec"]["replicas"]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    for worker in (d for d in infermesh_deployments(docs) if service_of(d) == "worker"):
        name = worker["metadata"]["name"]
        assert hpas[name]["spec"]["minReplicas"] >= num_schedulers, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaled_deployments_leave_the_count_to_their_hpa(rendered, overlay):
    # `replicas` on an HPA-managed Deployment resets it on every apply, fighting the autoscaler.
    docs = rendered[overlay]
    scaled = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(docs, "HorizontalPodAutoscaler")}
    for deployment in of_kind(docs, "Deployment"):
        if deployment["metadata"]["name"] in scaled:
            assert "replicas" not in deployment["spec"], deployment["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_rollout_or_a_drain_always_leaves_a_pod_of_each_service_serving(rendered, overlay):
    # The gpu overlay replaces workers one at a time (maxSurge 0): safe only with two or more.
    docs = rendered[overlay]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    budgets = of_kind(docs, "PodDisruptionBudget")
    for deployment in infermesh_deployments(docs):
        name = deployment["metadata"]["name"]
        fewest = hpas[name]["spec"]["minReplicas"] if name in hpas else deployment["spec"]["replicas"]
        rolling = deployment["spec"]["strategy"]["rollingUpdate"]
        unavailable = rolling["maxUnavailable"]
        unavailable = -(-fewest * int(unavailable[:-1]) // 100) if isinstance(unavailable, str) else unavailable
        assert fewest - unavailable >= 1, f"{overlay} {name}: a rollout may take every pod down"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        allowed = budget["spec"].get("maxUnavailable", fewest - budget["spec"].get("minAvailable", 0))
        assert fewest - allowed >= 1, f"{overlay} {name}: a node drain may evict every pod"
        assert allowed >= 1, f"{overlay} {name}: the budget blocks every drain"
