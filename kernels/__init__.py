"""Compute kernels for the worker: each op as a Numba CUDA kernel, a CPU twin and a reference.

Public functions validate shapes/dtypes and pick the backend (see
``kernels.backend``); the layouts are documented in each op's module. The
``*_host`` functions run the CPU twin on numpy arrays a caller has already
checked, for a model that calls a kernel in every layer.
"""

from kernels.backend import BACKEND_ENV_VAR, Backend
from kernels.image_preprocess import preprocess_images
from kernels.kv_cache import write_kv_cache, write_kv_cache_host
from kernels.paged_attention import paged_attention_decode, paged_attention_decode_host

__all__ = [
    "BACKEND_ENV_VAR",
    "Backend",
    "paged_attention_decode",
    "paged_attention_decode_host",
    "preprocess_images",
    "write_kv_cache",
    "write_kv_cache_host",
]
