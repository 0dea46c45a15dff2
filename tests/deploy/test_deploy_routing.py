"""The gateway's routing file in the Kubernetes manifests: mounted from a ConfigMap whose edits reach
the running gateways (the canary is shifted by editing it), naming every model a worker serves."""

from __future__ import annotations

import posixpath

import pytest
import yaml
from deploy_manifests import (
    OVERLAYS,
    by_name,
    container_of,
    environment,
    infermesh_deployments,
    loaded_config,
    service_of,
)

from services.gateway.routing.table import parse_routing_config


def _gateway(docs: list[dict]) -> dict:
    return next(d for d in infermesh_deployments(docs) if service_of(d) == "gateway")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_routes_by_the_mounted_routing_config_map(rendered, overlay):
    docs = rendered[overlay]
    gateway = _gateway(docs)
    routing_file = loaded_config(gateway, docs).routing_file
    mounts = {m["mountPath"]: m for m in container_of(gateway)["volumeMounts"]}
    mount = mounts[posixpath.dirname(routing_file)]
    assert mount["readOnly"] is True and "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    # A fixed name (no kustomize hash suffix): editing it updates the mounted file in place, where a
    # hashed name would roll every gateway for a canary step.
    assert volume["configMap"]["name"] == "infermesh-routing"
    config_map = by_name(docs, "ConfigMap", "infermesh-routing")
    assert config_map["metadata"]["labels"]["app.kubernetes.io/name"] == "gateway"
    assert posixpath.basename(routing_file) in config_map["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_routing_file_parses_and_names_exactly_the_models_workers_serve(rendered, overlay):
    docs = rendered[overlay]
    text = by_name(docs, "ConfigMap", "infermesh-routing")["data"]["routing.yaml"]
    routes = {r.model: r for r in parse_routing_config(yaml.safe_load(text), "infermesh-routing")}
    served = {}
    for worker in (d for d in infermesh_deployments(docs) if service_of(d) == "worker"):
        env = environment(worker, docs)
        served.setdefault(env["INFERMESH_WORKER_MODEL_NAME"], set()).add(env["INFERMESH_WORKER_MODEL_VERSION"])
    assert set(routes) == set(served), "a model missing from the routing file is NOT_FOUND at the gateway"
    for model, route in routes.items():
        assert route.default_version in served[model], f"{model}: no worker serves its default version"
        # Versions name no endpoints: they go to the schedulers the gateway discovers.
        assert all(not v.endpoints for v in route.versions), model
