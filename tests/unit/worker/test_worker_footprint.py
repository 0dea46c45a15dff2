"""What a worker process holds besides its model: a generator worker serving a Hugging Face checkpoint
never loads transformers (a test and dev dependency), onnxruntime (tensor models' runtime) or Pillow
(classifiers' image decoding), and loading ends by handing the C heap's free pages back.

Each of those libraries costs a worker resident memory it never uses (Pillow ~5 MiB; transformers and
onnxruntime far more), against issue 33's budget of weights + KV cache + 300 MB. The import check runs
in a fresh interpreter: this test process has imported all three."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from services.worker.native_heap import trim_native_heap
from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support.hf_checkpoints import save_model_directory
from tools.testbed.processes import ROOT

UNUSED_BY_A_GENERATOR_WORKER = ("transformers", "onnxruntime", "PIL")

# The worker's own path: the service's imports, the runtime it makes from its flags, the load (weights,
# warm-up step, golden check). Prints the unwanted libraries that got loaded.
WORKER_LOAD = f"""
import sys
from services.common.config import load_config
from services.worker.config import WorkerConfig
from services.worker.server import make_runtime

runtime = make_runtime(load_config(WorkerConfig, "worker", sys.argv[1:]), 1)
runtime.load()
print(" ".join(m for m in {UNUSED_BY_A_GENERATOR_WORKER!r} if m in sys.modules), end="")
"""


def test_a_generator_worker_loads_a_checkpoint_without_transformers_onnxruntime_or_pillow(tmp_path):
    save_model_directory(tmp_path / "checkpoint", "llama")
    import_checkpoint(tmp_path / "checkpoint", tmp_path / "repo", ImportOptions("tiny", "1", kv_cache_bytes=1 << 20))
    flags = ["--model-repository", str(tmp_path / "repo"), "--model-name", "tiny", "--model-version", "1",
             "--num-threads", "1"]
    run = subprocess.run([sys.executable, "-c", WORKER_LOAD, *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "", f"a generator worker loaded {run.stdout}"


def test_trimming_the_native_heap_runs_wherever_the_c_library_is_glibc():
    assert trim_native_heap() is (platform.libc_ver()[0] == "glibc")
