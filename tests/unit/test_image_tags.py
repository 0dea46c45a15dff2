"""Image tags come from the version the code reports (`--version`), which is pyproject's, and the
Kubernetes manifests pin exactly those tags."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from tools import images

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def test_tag_source_is_the_pyproject_version():
    assert images.release_version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_each_dockerfile_builds_its_image_tagged_with_the_release():
    commands = {name: images.build_command(name, "9.8.7", "abc123") for name in images.image_names()}
    assert set(commands) == {"gateway", "scheduler", "worker-cpu", "worker-cuda"}
    for name, command in commands.items():
        assert command[:5] == ["docker", "build", "-f", f"deploy/docker/{name}.Dockerfile", "-t"]
        assert command[5] == f"infermesh/{name}:9.8.7" and command[-1] == "."
        assert "org.opencontainers.image.revision=abc123" in command
    assert images.build_command("gateway", "1.0.0", "r", "ghcr.io/acme/")[5] == "ghcr.io/acme/infermesh/gateway:1.0.0"


def test_manifests_pin_the_tag_the_images_are_built_with():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for overlay in ("cpu", "gpu"):
        kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
        assert {i["name"]: i["newTag"] for i in kustomization["images"]} == dict.fromkeys(
            ("infermesh/gateway", "infermesh/scheduler", "infermesh/worker"), version), overlay
    for deployment in K8S.glob("base/*/deployment.yaml"):
        image = yaml.safe_load(deployment.read_text())["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image.rpartition(":")[2] == version, deployment
