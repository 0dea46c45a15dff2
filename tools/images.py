"""Build every service image tagged with the release the code reports (`--version`).

    python -m tools.images                       # docker build each deploy/docker/*.Dockerfile
    python -m tools.images --dry-run             # print the commands only
    python -m tools.images --registry REG --only gateway

The tag is the version `python -m services.gateway --version` prints (services/common/build_info.py,
kept equal to pyproject.toml's by a test), so an image never carries a tag its code disagrees
with; the Kubernetes overlays pin the same tag (tests/unit/test_image_tags.py). Each image also
gets the OCI version and revision labels; the revision is `git rev-parse HEAD` ("unknown" outside
a checkout), passed as the INFERMESH_BUILD_REVISION build argument where a Dockerfile declares it.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ROOT / "deploy" / "docker"
REPOSITORY = "infermesh"
REVISION_ARG = "INFERMESH_BUILD_REVISION"
_VERSION_LINE = re.compile(r"^infermesh gateway (\S+) ")


def release_version() -> str:
    """The version the gateway's `--version` prints (what a running service exports too)."""
    done = subprocess.run([sys.executable, "-m", "services.gateway", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    match = _VERSION_LINE.match(done.stdout.strip())
    if match is None:
        raise RuntimeError(f"cannot read a version from: {done.stdout.strip()!r}")
    return match.group(1)


def revision() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def image_names() -> list[str]:
    """gateway, scheduler, worker-cpu, worker-cuda: one image per Dockerfile."""
    return sorted(p.name.removesuffix(".Dockerfile") for p in DOCKERFILES.glob("*.Dockerfile"))


def build_command(name: str, version: str, rev: str, registry: str = "") -> list[str]:
    dockerfile = DOCKERFILES / f"{name}.Dockerfile"
    tag = f"{registry.rstrip('/') + '/' if registry else ''}{REPOSITORY}/{name}:{version}"
    command = ["docker", "build", "-f", str(dockerfile.relative_to(ROOT)), "-t", tag,
               "--label", f"org.opencontainers.image.version={version}",
               "--label", f"org.opencontainers.image.revision={rev}"]
    if re.search(rf"^\s*ARG\s+{REVISION_ARG}\b", dockerfile.read_text(), re.MULTILINE):
        command += ["--build-arg", f"{REVISION_ARG}={rev}"]
    return [*command, "."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.images", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--registry", default="", help="prefix for the image names, e.g. ghcr.io/acme")
    parser.add_argument("--only", action="append", choices=image_names(), help="build only these (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the docker commands, run nothing")
    args = parser.parse_args(argv)
    version, rev = release_version(), revision()
    for name in args.only or image_names():
        command = build_command(name, version, rev, args.registry)
        print(shlex.join(command), flush=True)
        if not args.dry_run and subprocess.run(command, cwd=ROOT).returncode != 0:
            print(f"error: building {name} failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
