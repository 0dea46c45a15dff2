"""Compiles the CUDA kernels to PTX without a GPU, so the CUDA target's typing and lowering are checked.

The simulator runs the kernels as Python and never types them; this does.
Needs NVVM, e.g. from the ``nvidia-cuda-nvcc-cu12`` wheel installed anywhere:

    pip install --target /tmp/nvcc nvidia-cuda-nvcc-cu12==12.9.86
    CUDA_HOME=/tmp/nvcc/nvidia/cuda_nvcc PYTHONPATH=. python tests/unit/kernels/ptx_check.py

Prints one line per kernel and signature, exits non-zero on the first failure.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numba.cuda.compiler
import numba.cuda.dispatcher
from numba import cuda
from numba import types as t


class _OfflineDevice:
    """Stands in for the current device, which device-function typing asks for its compute capability."""

    compute_capability = (9, 0)


def main() -> None:
    numba.cuda.compiler.get_current_device = _OfflineDevice
    numba.cuda.dispatcher.get_current_device = _OfflineDevice

    from kernels.image_preprocess import _preprocess_cuda_per_pixel, preprocess_kernel
    from kernels.kv_cache import _scatter_kernel
    from kernels.paged_attention_cuda import attention_kernels
    from kernels.paged_attention_warp import layout_for, warp_attention_kernel

    f32_3, f32_4 = t.float32[:, :, ::1], t.float32[:, :, :, ::1]
    packed = (t.uint8[::1], t.int64[::1], t.int32[::1], t.int32[::1], t.float32[::1], t.float32[::1])
    f16_3, f16_4 = t.float16[:, :, ::1], t.float16[:, :, :, ::1]
    # write_kv_cache at 8 KV heads x 128: 16-byte chunks, and the element-width fallback for unaligned views.
    cases = {
        "write_kv_cache float32 16-byte": (_scatter_kernel(4096, 16, 4), (f32_3, f32_3, f32_4, f32_4, t.int64[::1])),
        "write_kv_cache float16 16-byte": (_scatter_kernel(2048, 16, 2), (f16_3, f16_3, f16_4, f16_4, t.int64[::1])),
        "write_kv_cache float32 4-byte": (_scatter_kernel(4096, 4, 4), (f32_3, f32_3, f32_4, f32_4, t.int64[::1])),
    }
    # (head_size, group): tinylm's 32/2, the benchmark's 64/4 and 128/4, a wide 256/1.
    for head_size, group in ((32, 2), (64, 4), (128, 4), (256, 1)):
        for name, dtype in (("float32", t.float32), ("float16", t.float16)):
            partition, merge = attention_kernels(head_size, group, name)
            x3, x4 = dtype[:, :, ::1], dtype[:, :, :, ::1]
            attention_args = (x3, t.float32[:, :, ::1], t.float32[:, :, ::1], t.float32[:, :, :, ::1], x3, x4, x4,
                              t.int32[:, ::1], t.int32[::1], t.int64, t.float64, t.int64, t.int64)
            cases[f"paged_attention tile partition {head_size}/{group} {name}"] = (partition, attention_args)
            layout = layout_for(head_size, group, 4 if name == "float32" else 2)
            for each in (layout, replace(layout, fastmath=not layout.fastmath)):
                cases[f"paged_attention warp {head_size}/{group} {name} {each}"] = (
                    warp_attention_kernel(head_size, group, name, each), attention_args)
            if (head_size, group) == (128, 4):  # Gemma 2's score cap, compiled in; in fast math too
                cases[f"paged_attention tile partition {head_size}/{group} {name} softcap 50"] = (
                    attention_kernels(head_size, group, name, softcap=50.0)[0], attention_args)
                cases[f"paged_attention warp {head_size}/{group} {name} {layout} softcap 50"] = (
                    warp_attention_kernel(head_size, group, name, layout, 50.0), attention_args)
            cases[f"paged_attention merge {head_size}/{group} {name}"] = (merge, (
                x3, t.float32[:, :, ::1], t.float32[:, :, ::1], t.float32[:, :, :, ::1], t.int32[::1], t.int64, t.int64))
    # bfloat16 (int16 bits) and packed 16-bit K/V words, at the benchmark's 128/4 and tinylm's 32/2.
    from kernels.paged_attention_cuda import merge_kernel

    bf3, bf4 = t.int16[:, :, ::1], t.int16[:, :, :, ::1]
    for head_size, group in ((32, 2), (128, 4)):
        for name, x3, x4 in (("float16", f16_3, f16_4), ("bfloat16", bf3, bf4)):
            attention_args = (x3, t.float32[:, :, ::1], t.float32[:, :, ::1], t.float32[:, :, :, ::1], x3, x4, x4,
                              t.int32[:, ::1], t.int32[::1], t.int64, t.float64, t.int64, t.int64)
            layouts = [layout_for(head_size, group, 2), layout_for(head_size, group, 2, packed=True)]
            if name == "bfloat16":
                layouts.append(layout_for(head_size, group, 2, packed=False))
            for layout in layouts:
                cases[f"paged_attention warp {head_size}/{group} {name} {layout}"] = (
                    warp_attention_kernel(head_size, group, name, layout), attention_args)
        cases[f"paged_attention merge {head_size}/{group} bfloat16"] = (merge_kernel(head_size, "bfloat16"), (
            bf3, t.float32[:, :, ::1], t.float32[:, :, ::1], t.float32[:, :, :, ::1], t.int32[::1], t.int64, t.int64))
    cases.update({
        "preprocess_images float32 C=3": (preprocess_kernel("float32", 3), (*packed, f32_4, t.int64)),
        "preprocess_images float16 C=3": (preprocess_kernel("float16", 3),
                                          (*packed, t.float16[:, :, :, ::1], t.int64)),
        "preprocess_images float32 C=1": (preprocess_kernel("float32", 1), (*packed, f32_4, t.int64)),
        "preprocess_images per-pixel float32": (_preprocess_cuda_per_pixel, (*packed, f32_4)),
        "preprocess_images per-pixel float16": (_preprocess_cuda_per_pixel, (*packed, t.float16[:, :, :, ::1])),
    })
    for name, (kernel, signature) in cases.items():
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=_OfflineDevice.compute_capability)
        except Exception as error:  # report which kernel, then fail
            sys.exit(f"FAIL {name}: {type(error).__name__}: {error}")
        if "tanh.approx" in ptx:  # 11 bits: the score cap must use libdevice's tanhf (capped_score)
            sys.exit(f"FAIL {name}: tanh.approx.f32 in the PTX")
        local_bytes = "uses local memory" if "__local_depot" in ptx else "no local memory"
        shuffles = ptx.count("shfl.sync")
        vectors = f"{ptx.count('ld.global.v4')} ld.global.v4, {ptx.count('st.global.v4')} st.global.v4"
        print(f"ok {name}: {len(ptx.splitlines())} PTX lines, {local_bytes}, {shuffles} shuffles, {vectors}")
    print("all CUDA kernels compile to PTX for sm_90")


if __name__ == "__main__":
    main()
