"""Compute kernels for the worker: each op as a Numba CUDA kernel, a CPU twin and a reference.

Public functions validate shapes/dtypes and pick the backend (see
``kernels.backend``); the layouts are documented in each op's module.
"""

from kernels.backend import BACKEND_ENV_VAR, Backend
from kernels.image_preprocess import preprocess_images
from kernels.kv_cache import write_kv_cache
from kernels.paged_attention import paged_attention_decode

__all__ = [
    "BACKEND_ENV_VAR",
    "Backend",
    "paged_attention_decode",
    "preprocess_images",
    "write_kv_cache",
]
