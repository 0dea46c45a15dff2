"""Reading rendered manifests: which service a workload is, its container, its environment."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

CONFIG_OF = {"gateway": GatewayConfig, "scheduler": SchedulerConfig, "worker": WorkerConfig}
SERVICES = tuple(CONFIG_OF)
OVERLAYS = ("cpu", "gpu")
# Standard OpenTelemetry SDK variables the services' tracing setup reads.
OTEL_ENV = {
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
}
# Downward-API values that exist only to be substituted into another variable ($(POD_NAME)).
DOWNWARD_HELPERS = {"POD_NAME", "POD_NAMESPACE"}
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def by_name(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def service_of(workload: Mapping) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def infermesh_deployments(docs: list[dict]) -> list[dict]:
    return [d for d in of_kind(docs, "Deployment") if service_of(d) in SERVICES]


def quota_store(docs: list[dict]) -> dict:
    """The Valkey StatefulSet gateways share tenant quotas through."""
    (store,) = [d for d in of_kind(docs, "StatefulSet") if service_of(d) == "quota-store"]
    return store


def container_of(workload: Mapping) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    return containers[0]


def pod_labels(workload: Mapping) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: Mapping, labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def env_names_of(workload: Mapping, docs: list[dict]) -> dict[str, str]:
    """Every variable name the container gets -> where it comes from (for messages)."""
    container = container_of(workload)
    names: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = by_name(docs, "ConfigMap", source["configMapRef"]["name"])
        names.update({key: f"ConfigMap {config_map['metadata']['name']}" for key in config_map.get("data", {})})
    names.update({item["name"]: "env" for item in container.get("env", [])})
    return names


def environment(workload: Mapping, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet would build it (downward API as placeholders)."""
    container = container_of(workload)
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        values.update(by_name(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for item in container.get("env", []):
        if "value" in item:
            values[item["name"]] = _REFERENCE.sub(lambda m: values.get(m.group(1), m.group(0)), item["value"])
        elif "resourceFieldRef" in item["valueFrom"]:
            values[item["name"]] = str(resource_field_value(workload, item["valueFrom"]["resourceFieldRef"]))
        else:
            field_path = item["valueFrom"]["fieldRef"]["fieldPath"]
            values[item["name"]] = f"fieldref-{field_path.replace('.', '-')}"
    return values


def cpu_cores(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity ("4", "1500m", 2) in cores."""
    text = str(quantity)
    return int(text.removesuffix("m")) / 1000 if text.endswith("m") else float(text)


def resource_field_value(workload: Mapping, ref: Mapping) -> int:
    """What the kubelet puts in a resourceFieldRef variable: the container's CPU request or limit
    divided by the divisor, rounded up (only CPU is modelled here)."""
    containers = {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}
    container = containers[ref.get("containerName") or container_of(workload)["name"]]
    kind, resource = ref["resource"].split(".")
    assert resource == "cpu", f"only cpu resourceFieldRefs are modelled, got {ref['resource']}"
    return math.ceil(cpu_cores(container["resources"][kind]["cpu"]) / cpu_cores(ref.get("divisor", "1")))


def references(value: str) -> set[str]:
    return set(_REFERENCE.findall(value))


def loaded_config(workload: Mapping, docs: list[dict]):
    service = service_of(workload)
    return load_config(CONFIG_OF[service], service, argv=[], environ=environment(workload, docs))
