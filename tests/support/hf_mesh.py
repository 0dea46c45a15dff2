"""A mesh serving Hugging Face checkpoint directories made in the tests (tests/support/hf_checkpoints.py):
each imported as `<name>:1`, a scheduler, a worker per model and a gateway with its OpenAI front, up
once every model answers a completion."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support.https_json import post_json
from tools.testbed.processes import free_port, running_mesh, wait_until


@dataclass
class HFMesh:
    mesh: Any  # tools.testbed.processes' running mesh
    base: str  # the OpenAI front's base URL, https://127.0.0.1:<port>/v1
    metrics_port: int  # the scheduler's
    block_size: int  # the first model's KV block size, tokens


@contextmanager
def serving_checkpoints(tmp: Path, names: Sequence[str], kv_cache_bytes: int = 1 << 20,
                        options: Mapping[str, Mapping[str, Any]] | None = None) -> Iterator[HFMesh]:
    """`tmp/<name>` for each name: checkpoint directories, served until the block ends. `options`:
    more ImportOptions fields for some of them, by name."""
    root = tmp / "model_repo"
    for name in names:
        more = (options or {}).get(name, {})
        import_checkpoint(tmp / name, root, ImportOptions(name, "1", kv_cache_bytes=kv_cache_bytes, **more))
    http_port, metrics_port = free_port(), free_port()
    with running_mesh(tmp, env={"HF_HUB_OFFLINE": "1"}) as mesh:
        mesh.start_scheduler("--metrics-port", str(metrics_port))
        for name in names:
            mesh.start_worker(name, "--model-repository", str(root), "--model-version", "1")
        mesh.start_gateway("--http-port", str(http_port))
        base = f"https://127.0.0.1:{http_port}/v1"
        wait_until(lambda: all(post_json(base, "/completions", {"model": name, "prompt": "hi", "max_tokens": 1})[0]
                               == 200 for name in names), timeout_s=30, message="models served")
        manifest = json.loads((root / names[0] / "1" / "manifest.json").read_text())
        yield HFMesh(mesh, base, metrics_port, manifest["envelope"]["block_size"])
