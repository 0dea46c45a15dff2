"""What is running: the release, the source revision, and the runtimes it was built on.

Exported as `infermesh_<service>_build_info{version, revision, python_version, grpc_version} 1`
(the Prometheus convention for build metadata: join on it, count by version during a rollout)
and printed by `--version`. The revision comes from `INFERMESH_BUILD_REVISION`, which the images
set from their build argument; a source checkout reports "unknown".
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from prometheus_client import Gauge

REVISION_ENV = "INFERMESH_BUILD_REVISION"
_LABELS = ("version", "revision", "python_version", "grpc_version")


@dataclass(frozen=True)
class BuildInfo:
    version: str
    revision: str
    python_version: str
    grpc_version: str

    def line(self, service: str) -> str:
        return (f"infermesh {service} {self.version} (revision {self.revision}; "
                f"python {self.python_version}, grpcio {self.grpc_version})")


# The release. The images run the source tree without installing the package, so the version
# lives here; a unit test keeps it equal to pyproject.toml's.
VERSION = "0.1.0"


def current(environ: Mapping[str, str] | None = None) -> BuildInfo:
    environ = os.environ if environ is None else environ
    return BuildInfo(VERSION, environ.get(REVISION_ENV, "").strip() or "unknown",
                     platform.python_version(), grpc.__version__)


_gauges: dict[str, Gauge] = {}


def export(service: str, info: BuildInfo | None = None) -> None:
    info = info or current()
    name = f"infermesh_{service}_build_info"
    if name not in _gauges:
        _gauges[name] = Gauge(name, "Always 1; the labels say which build of the service is running", _LABELS)
    _gauges[name].labels(info.version, info.revision, info.python_version, info.grpc_version).set(1)
