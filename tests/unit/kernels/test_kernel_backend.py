import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels.backend import Backend, all_on_device, cuda_available, is_torch_tensor, resolve_backend
from tests.support.sweeps import full_sweep

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("INFERMESH_KERNEL_BACKEND", "reference")
    assert resolve_backend("cpu", prefer_cuda=False) is Backend.CPU
    assert resolve_backend(None, prefer_cuda=False) is Backend.REFERENCE
    assert resolve_backend(Backend.CPU, prefer_cuda=True) is Backend.CPU


@pytest.mark.skipif(cuda_available(), reason="automatic choice picks CUDA on a machine with a GPU")
def test_automatic_choice_is_the_cpu_twin_without_a_gpu(monkeypatch):
    monkeypatch.delenv("INFERMESH_KERNEL_BACKEND", raising=False)
    assert resolve_backend(None, prefer_cuda=True) is Backend.CPU
    monkeypatch.setenv("INFERMESH_KERNEL_BACKEND", "auto")
    assert resolve_backend(None, prefer_cuda=True) is Backend.CPU


@pytest.mark.skipif(cuda_available(), reason="needs a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match=r"backend 'cuda' requested but numba.cuda.is_available\(\) is False"):
        resolve_backend("cuda", prefer_cuda=False)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="backend must be one of 'cuda', 'cpu', 'reference' or 'auto'; got 'gpu'"):
        resolve_backend("gpu", prefer_cuda=False)


def test_torch_tensors_and_parameters_are_told_from_arrays_and_look_alikes():
    import torch

    class LooksLikeATensor:
        is_cuda = False
        __module__ = "torch.fake"

    assert is_torch_tensor(torch.zeros(2)) and is_torch_tensor(torch.nn.Parameter(torch.zeros(2)))
    assert not is_torch_tensor(np.zeros(2)) and not is_torch_tensor(LooksLikeATensor())


def test_host_arrays_are_not_on_device():
    assert all_on_device({"a": np.zeros(2), "b": np.zeros(3)}) is False


def test_cuda_kernels_match_references_on_the_simulator():
    """The CUDA kernels run under NUMBA_ENABLE_CUDASIM, which must be set before numba is imported.

    One process per kernel family, side by side: the simulator runs every thread in Python, and the
    attention kernel's warp shuffles are block barriers there (~20 s of CPU whole, cudasim_blocks.py).
    Under CI one case per kernel variant (--quick); `make test-all` runs the whole sweep.
    """
    script = str(Path(__file__).with_name("cudasim_check.py"))
    quick = [] if full_sweep() else ["--quick"]
    env = {"NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.Popen([sys.executable, script, *quick, part], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for part in ("attention", "kv_cache", "images")]
    try:
        outputs = [run.communicate(timeout=600)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    for run, output in zip(runs, outputs, strict=True):
        assert run.returncode == 0, output
        assert "all CUDA kernels match the references" in output


def test_small_cpu_work_runs_on_the_calling_thread_and_restores_the_pool():
    import numba

    from kernels.backend import PARALLEL_MIN_BYTES, cpu_threads_for

    before = numba.get_num_threads()
    with cpu_threads_for(PARALLEL_MIN_BYTES - 1):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
    with cpu_threads_for(PARALLEL_MIN_BYTES):
        assert numba.get_num_threads() == before
