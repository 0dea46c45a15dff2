"""Where a kernel runs, and how its arrays get there.

Every public kernel function takes numpy arrays, PyTorch tensors (CPU or CUDA)
or Numba device arrays. This module answers two questions for them:

* which backend runs the op: the ``backend=`` argument, else the
  ``INFERMESH_KERNEL_BACKEND`` environment variable, else automatic — CUDA when
  the data already live on the GPU (or, for ops whose inputs always start on the
  host, when ``numba.cuda.is_available()``), the CPU twin otherwise;
* how to view an array for that backend without copying it: ``.numpy()`` for
  CPU tensors, ``numba.cuda.as_cuda_array`` for CUDA tensors, launched on
  PyTorch's current stream so the kernel orders correctly with the model's ops.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

BACKEND_ENV_VAR = "INFERMESH_KERNEL_BACKEND"

# Below this many bytes touched (about 150 µs of single-threaded memory
# traffic), a CPU twin runs on the calling thread. Fork-join costs a few µs on
# an idle machine, so threads could save at most ~75 µs here; on a busy one a
# join waits for a descheduled thread's time slice and costs milliseconds.
PARALLEL_MIN_BYTES = 2 * 1024 * 1024


class Backend(enum.Enum):
    CUDA = "cuda"
    CPU = "cpu"
    REFERENCE = "reference"


@functools.cache
def cuda_available() -> bool:
    from numba import cuda

    return bool(cuda.is_available())


def resolve_backend(requested: str | Backend | None, *, prefer_cuda: bool) -> Backend:
    """The backend for one call.

    ``prefer_cuda`` is what automatic choice leans to: True when the data are on
    the GPU already (or always start on the host, like images), False when they
    are host arrays that a GPU would first have to copy in and out.
    """
    if isinstance(requested, Backend):
        return requested
    choice = requested if requested is not None else os.environ.get(BACKEND_ENV_VAR, "auto")
    choice = choice.strip().lower()
    if choice == "auto" or choice == "":
        return Backend.CUDA if prefer_cuda and cuda_available() else Backend.CPU
    try:
        backend = Backend(choice)
    except ValueError:
        names = ", ".join(repr(b.value) for b in Backend)
        source = "backend" if requested is not None else BACKEND_ENV_VAR
        raise ValueError(f"{source} must be one of {names} or 'auto'; got {choice!r}") from None
    if backend is Backend.CUDA and not cuda_available():
        raise ValueError("backend 'cuda' requested but numba.cuda.is_available() is False")
    return backend


@contextlib.contextmanager
def cpu_threads_for(num_bytes: int) -> Iterator[None]:
    """Runs the enclosed CPU twin single-threaded when it touches fewer than PARALLEL_MIN_BYTES.

    numba.set_num_threads is thread-local, so this affects only the caller.
    """
    import numba

    # A pool of one thread (the worker's --num-threads 1) never forks: skip the get/set pair.
    pool_size = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # numba.config sets it at import
    if num_bytes >= PARALLEL_MIN_BYTES or pool_size == 1:
        yield
        return

    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def is_torch_tensor(x: Any) -> bool:
    # An isinstance check, without importing torch: every kernel call asks this of each argument,
    # and a module-name test plus hasattr cost several times as much.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_on_device(x: Any) -> bool:
    """True for CUDA tensors and Numba device arrays (anything exposing __cuda_array_interface__)."""
    if is_torch_tensor(x):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def all_on_device(names_and_arrays: dict[str, Any]) -> bool:
    """Whether every array is on the GPU; mixing host and device arrays is a caller error."""
    placements = {name: is_on_device(x) for name, x in names_and_arrays.items()}
    if all(placements.values()):
        return True
    if not any(placements.values()):
        return False
    on_device = sorted(n for n, d in placements.items() if d)
    on_host = sorted(n for n, d in placements.items() if not d)
    raise ValueError(
        f"arrays must all be on the GPU or all on the host; on the GPU: {', '.join(on_device)}; "
        f"on the host: {', '.join(on_host)}"
    )


def dtype_name(x: Any) -> str:
    """'float32', 'int64', … for numpy arrays, torch tensors and Numba device arrays alike."""
    dtype = x.dtype
    if is_torch_tensor(x):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def host_view(x: Any) -> np.ndarray:
    """A numpy view of a host array or CPU tensor (no copy)."""
    if is_torch_tensor(x):
        return x.detach().numpy()
    return np.asarray(x)


def as_torch(x: Any):
    """A torch view of a numpy array or tensor (no copy), for the PyTorch references."""
    import torch

    if is_torch_tensor(x):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return torch.as_tensor(x, device="cuda")
    return torch.from_numpy(np.asarray(x))


class DeviceLaunch:
    """Device views of a call's arrays, the stream to launch on, and the launch itself.

    Torch CUDA tensors and Numba device arrays are viewed in place; host arrays
    (numpy, CPU tensors) are copied in, and ``copy_back`` writes results into
    the host arrays the caller passed — which is how the simulator tests run.
    When every array is a PyTorch CUDA tensor, ``launch`` goes through
    ``kernels.fast_launch`` after the first call of each signature.
    """

    def __init__(self, torch_tensors: list[Any]) -> None:
        from numba import cuda

        self._cuda = cuda
        self._torch_device = None
        self._host_outputs: list[tuple[Any, np.ndarray]] = []
        self._copies: list[Any] = []  # device copies of host arrays, alive until copy_back
        self.stream: Any = 0  # Numba's default stream (0), or PyTorch's current stream as Numba sees it
        self.all_torch_cuda = bool(torch_tensors) and all(is_torch_tensor(t) and t.is_cuda for t in torch_tensors)
        if torch_tensors and any(is_torch_tensor(t) and t.is_cuda for t in torch_tensors):
            import torch

            device = next(t.device for t in torch_tensors if is_torch_tensor(t) and t.is_cuda)
            self._torch_device = device
            self.stream = _external_stream(torch.cuda.current_stream(device).cuda_stream)

    def launch(self, kernel: Any, griddim: Any, blockdim: Any, args: list[Any], outputs: tuple[int, ...] = ()) -> None:
        """Launches ``kernel[griddim, blockdim, stream](*args)``; ``outputs`` are the positions written.

        Arrays among ``args`` are viewed (or copied in, for host arrays, and
        back out for outputs); ints and floats pass as they are.
        """
        from kernels import fast_launch

        if self.all_torch_cuda and fast_launch.launch(kernel, griddim, blockdim, self.stream, args):
            return
        views = [a if isinstance(a, int | float) else self.view(a, is_output=i in outputs) for i, a in enumerate(args)]
        kernel[griddim, blockdim, self.stream](*views)
        if self.all_torch_cuda:
            fast_launch.remember(kernel, args, views)
        self.copy_back()

    def view(self, x: Any, *, is_output: bool = False):
        cuda = self._cuda
        if _is_numba_device_array(x):  # Numba's own (the simulator's have no array interface)
            return x
        if is_torch_tensor(x) and x.is_cuda:
            # No sync on the tensor's exported stream: the launch goes on
            # PyTorch's current stream, which already orders it after the
            # ops that produced x (syncing would stall the host every call).
            return cuda.as_cuda_array(x.detach(), sync=False)
        if hasattr(x, "__cuda_array_interface__") and not is_torch_tensor(x):  # CuPy and the like
            return cuda.as_cuda_array(x)
        host = np.ascontiguousarray(host_view(x))
        device = cuda.to_device(host, stream=self.stream)
        self._copies.append(device)
        if is_output:
            self._host_outputs.append((device, host_view(x)))
        return device

    def scratch(self, shape: tuple[int, ...]):
        """A float32 device work array for this launch: a PyTorch tensor from its caching allocator when
        the call's tensors are PyTorch's (stream-ordered, so it may be reused as soon as the launch is
        queued), else a Numba allocation kept alive until ``copy_back``."""
        if self._torch_device is not None:
            import torch

            return torch.empty(shape, dtype=torch.float32, device=self._torch_device)
        array = self._cuda.device_array(shape, dtype=np.float32, stream=self.stream)
        self._copies.append(array)
        return array

    def copy_back(self) -> None:
        for device, host in self._host_outputs:
            if host.flags.c_contiguous:
                device.copy_to_host(host, stream=self.stream)
            else:
                host[...] = device.copy_to_host(stream=self.stream)
        self._host_outputs.clear()
        if self._copies:
            if self.stream != 0:
                self.stream.synchronize()
            else:
                self._cuda.synchronize()
            self._copies.clear()


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int):
    """Numba's view of a PyTorch stream, made once per stream (making one costs driver calls)."""
    from numba import cuda

    return cuda.external_stream(handle)


def _is_numba_device_array(x: Any) -> bool:
    """A Numba device array (real or the simulator's), passed to a kernel as it is."""
    return hasattr(x, "copy_to_host") and not is_torch_tensor(x)
