"""A mesh serving Hugging Face checkpoint directories made in the tests (tests/support/hf_checkpoints.py):
each imported as `<name>:1`, a scheduler, a worker per model and a gateway with its OpenAI front, up
once every model answers a completion; and a stock client's script run against its OpenAI front."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support import tool_templates
from tests.support.hf_checkpoints import save_model_directory
from tests.support.https_json import post_json
from tests.support.side_venv import side_venv_python
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_all_serving, wait_until


@dataclass
class HFMesh:
    mesh: Any  # tools.testbed.processes' running mesh
    base: str  # the OpenAI front's base URL, https://127.0.0.1:<port>/v1
    metrics_port: int  # the scheduler's
    block_size: int  # the first model's KV block size, tokens


@contextmanager
def serving_checkpoints(tmp: Path, names: Sequence[str], kv_cache_bytes: int = 1 << 20,
                        options: Mapping[str, Mapping[str, Any]] | None = None,
                        gateway_args: Sequence[str] = ()) -> Iterator[HFMesh]:
    """`tmp/<name>` for each name: checkpoint directories, served until the block ends. `options`:
    more ImportOptions fields for some of them, by name; `gateway_args`: more gateway flags."""
    root = tmp / "model_repo"
    for name in names:
        more = (options or {}).get(name, {})
        import_checkpoint(tmp / name, root, ImportOptions(name, "1", kv_cache_bytes=kv_cache_bytes, **more))
    http_port, metrics_port = free_port(), free_port()
    with running_mesh(tmp, env={"HF_HUB_OFFLINE": "1"}) as mesh:
        mesh.start_scheduler("--metrics-port", str(metrics_port))
        wait_all_serving([mesh.start_worker(name, "--model-repository", str(root), "--model-version", "1", wait=False)
                          for name in names])
        mesh.start_gateway("--http-port", str(http_port), *gateway_args)
        base = f"https://127.0.0.1:{http_port}/v1"
        manifests = {name: json.loads((root / name / "1" / "manifest.json").read_text()) for name in names}

        def answers(name: str) -> bool:  # an embedding model serves /embeddings only
            if "embedding" in manifests[name]["generator"]:
                return post_json(base, "/embeddings", {"model": name, "input": "hi"})[0] == 200
            return post_json(base, "/completions", {"model": name, "prompt": "hi", "max_tokens": 1})[0] == 200

        wait_until(lambda: all(answers(name) for name in names), timeout_s=30, message="models served")
        manifest = manifests[names[0]]
        yield HFMesh(mesh, base, metrics_port, manifest["envelope"]["block_size"])


@contextmanager
def serving_hermes_qwen2(tmp: Path, name: str, gateway_args: Sequence[str] = ()) -> Iterator[HFMesh]:
    """`tmp/<name>`: a tiny Qwen2 checkpoint whose chat template offers tools in the Hermes format,
    served until the block ends. The tools' signatures make prompts of a few hundred byte-level
    tokens: a longer context (2048) and KV cache (4 MiB) than the defaults."""
    save_model_directory(tmp / name, "qwen2", seed=11, chat_template=tool_templates.HERMES,
                         max_position_embeddings=2048)
    with serving_checkpoints(tmp, [name], kv_cache_bytes=1 << 22, gateway_args=gateway_args) as served:
        yield served


def run_stock_client(served: HFMesh, side_venv: Sequence[Any], script: Path, model: str,
                     cases: Mapping[str, Any]) -> Any:
    """Runs `script` with the side venv's python (argv: base URL, CA file, model, cases as JSON) and
    returns what it printed, parsed; its stderr and the mesh's logs if it fails."""
    python = side_venv_python(*side_venv)
    done = subprocess.run([str(python), str(script), served.base, str(session_tls.session_pki().ca_path), model,
                           json.dumps(cases)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + served.mesh.logs()
    return json.loads(done.stdout)
