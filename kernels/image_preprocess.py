"""preprocess_images: ragged uint8 HWC images → resized, normalized CHW batch, in one pass.

Layouts:

    images:  N arrays uint8[height_i, width_i, C], sizes differ, C is 1 or 3 for all
    packed (what the kernels see):
      pixels:  uint8[sum(height_i * width_i * C)]  the images' bytes back to back
      offsets: int64[N]                             where image i starts in pixels
      heights: int32[N], widths: int32[N]
    out:     float32 (or float16)[N, C, out_height, out_width]

Each output pixel is computed straight from its four source pixels:
bilinear resize with ``torch.nn.functional.interpolate(mode="bilinear",
align_corners=False, antialias=False)`` semantics (so no anti-aliasing when
shrinking), then ``(x / 255 - mean[c]) / std[c]``, folded into one multiply-add.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import cuda, float32

from kernels.backend import (
    Backend,
    DeviceLaunch,
    cpu_threads_for,
    dtype_name,
    host_view,
    is_on_device,
    resolve_backend,
)
from kernels.vector_access import start_alignment, vector_storer

_OUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))

# CUDA launch shape. Each thread computes PIXELS_PER_THREAD consecutive pixels
# of one output row, all channels, and stores them VECTOR_PIXELS at a time
# (16 bytes of float32); a block is up to MAX_THREADS_X threads along a row
# (a whole 224-pixel row: 56 threads) times enough rows for ~BLOCK_THREADS.
# On an H200, 256 images of 64-512 px -> 224x224 float32 took 86-104 us across
# three runs (2.1-2.5 TB/s, source and output bytes counted once) against 250 us
# for the per-pixel kernel; 8 pixels a thread, other block shapes (8x32 to
# 56x8) and plain stores all landed within that spread, so nothing here is tuned
# finer than it. float16 output took the same time: stores are not the limit.
VECTOR_PIXELS = 4
PIXELS_PER_THREAD = 4
MAX_THREADS_X = 64
BLOCK_THREADS = 256
# The per-pixel kernel's shape (kept to time old against new): 32 threads along x,
# so each warp writes 128 contiguous bytes per channel.
PER_PIXEL_THREADS_X = 32
PER_PIXEL_THREADS_Y = 4


@dataclass(frozen=True)
class PackedImages:
    pixels: np.ndarray  # uint8[total_bytes]
    offsets: np.ndarray  # int64[N]
    heights: np.ndarray  # int32[N]
    widths: np.ndarray  # int32[N]
    num_channels: int


@cuda.jit(device=True, inline=True)
def _source_coord_cuda(dst, in_size, out_size):
    # Mirrors PyTorch's area_pixel_compute_source_index + guard_index_and_lambda, in float32.
    real = (float32(dst) + float32(0.5)) * (float32(in_size) / float32(out_size)) - float32(0.5)
    if real < float32(0.0):
        real = float32(0.0)
    # Conditionals, not min/max: those builtins failed to compile for the CUDA target (numba 0.68, compile_ptx).
    i0 = int(real)
    if i0 > in_size - 1:
        i0 = in_size - 1
    lam = real - float32(i0)
    if lam < float32(0.0):
        lam = float32(0.0)
    if lam > float32(1.0):
        lam = float32(1.0)
    i1 = i0 + 1 if i0 < in_size - 1 else i0
    return i0, i1, lam


@cuda.jit
def _preprocess_cuda_per_pixel(pixels, offsets, heights, widths, channel_scale, channel_bias, out):
    """The first kernel, one thread per output pixel; kept so a benchmark can time it against ``preprocess_kernel``."""
    x, y, image = cuda.grid(3)
    num_channels, out_height, out_width = out.shape[1], out.shape[2], out.shape[3]
    if image >= out.shape[0] or y >= out_height or x >= out_width:
        return
    height = heights[image]
    width = widths[image]
    base = offsets[image]
    y0, y1, ly = _source_coord_cuda(y, height, out_height)
    x0, x1, lx = _source_coord_cuda(x, width, out_width)
    row0 = base + y0 * width * num_channels
    row1 = base + y1 * width * num_channels
    for c in range(num_channels):
        top = (float32(1.0) - lx) * float32(pixels[row0 + x0 * num_channels + c]) + lx * float32(
            pixels[row0 + x1 * num_channels + c]
        )
        bottom = (float32(1.0) - lx) * float32(pixels[row1 + x0 * num_channels + c]) + lx * float32(
            pixels[row1 + x1 * num_channels + c]
        )
        value = (float32(1.0) - ly) * top + ly * bottom
        out[image, c, y, x] = value * channel_scale[c] + channel_bias[c]


@cuda.jit(device=True, inline=True)
def _bilinear_cuda(pixels, row0, row1, left, right, lx, ly):
    # Same operation order as the per-pixel kernel, so both give the same bits.
    # Unsigned indices: the offsets are never negative, and a signed index costs
    # Numba's wraparound select on every load (registers and instructions).
    top = (float32(1.0) - lx) * float32(pixels[np.uint64(row0 + left)]) + lx * float32(
        pixels[np.uint64(row0 + right)])
    bottom = (float32(1.0) - lx) * float32(pixels[np.uint64(row1 + left)]) + lx * float32(
        pixels[np.uint64(row1 + right)])
    return (float32(1.0) - ly) * top + ly * bottom


@functools.cache
def preprocess_kernel(out_dtype: str, num_channels: int, pixels_per_thread: int = PIXELS_PER_THREAD):
    """The CUDA kernel writing ``out_dtype`` (float32/float16) from ``num_channels`` (1/3) images.

    Each thread computes ``pixels_per_thread`` (a multiple of VECTOR_PIXELS)
    consecutive pixels of one output row, every channel. Launch it with
    ``cuda_launch_shape`` and the arguments ``(pixels, offsets, heights,
    widths, channel_scale, channel_bias, out, vector_stores)``;
    ``vector_stores`` (0/1, from ``uses_vector_stores``) says VECTOR_PIXELS
    pixels of a channel may be written with one store.
    """
    if pixels_per_thread % VECTOR_PIXELS:
        raise ValueError(f"pixels_per_thread must be a multiple of {VECTOR_PIXELS}; got {pixels_per_thread}")
    store = vector_storer(out_dtype, VECTOR_PIXELS)

    # Channels and pixels are constants so the loops unroll and `values` lives in
    # registers; with a runtime channel count the compiler hoisted 16 source
    # addresses out of the channel loop and needed 150 registers instead of 54.
    @cuda.jit
    def preprocess(pixels, offsets, heights, widths, channel_scale, channel_bias, out, vector_stores):
        group, y, image = cuda.grid(3)
        out_height, out_width = out.shape[2], out.shape[3]
        x = group * pixels_per_thread
        if image >= out.shape[0] or y >= out_height or x >= out_width:
            return
        width = widths[image]
        y0, y1, ly = _source_coord_cuda(y, heights[image], out_height)
        row0 = offsets[image] + y0 * width * num_channels
        row1 = offsets[image] + y1 * width * num_channels
        values = cuda.local.array((pixels_per_thread, num_channels), float32)
        for k in range(pixels_per_thread):
            # Columns past out_width (a row's last group) clamp to the image's
            # last pixel, so their loads stay in bounds; only their stores are skipped.
            x0, x1, lx = _source_coord_cuda(x + k, width, out_width)
            for c in range(num_channels):
                value = _bilinear_cuda(pixels, row0 + c, row1 + c, x0 * num_channels, x1 * num_channels, lx, ly)
                values[k, c] = value * channel_scale[c] + channel_bias[c]
        for c in range(num_channels):
            row_start = ((image * num_channels + c) * out_height + y) * out_width
            for k in range(0, pixels_per_thread, VECTOR_PIXELS):
                if vector_stores:
                    # out_width is then a multiple of VECTOR_PIXELS (4, as the tuple spells out), so a
                    # vector is all inside the row or all past it.
                    if x + k < out_width:
                        store(out, row_start + x + k, (values[k, c], values[k + 1, c], values[k + 2, c],
                                                       values[k + 3, c]))
                else:
                    for j in range(k, k + VECTOR_PIXELS):
                        if x + j < out_width:
                            out[image, c, y, x + j] = values[j, c]

    return preprocess


def cuda_launch_shape(out_shape: tuple[int, ...], pixels_per_thread: int = PIXELS_PER_THREAD
                      ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of ``preprocess_kernel`` for ``out[N, C, out_height, out_width]``."""
    num_groups = (out_shape[3] + pixels_per_thread - 1) // pixels_per_thread
    threads_x = min(num_groups, MAX_THREADS_X)
    threads_y = min(max(1, BLOCK_THREADS // threads_x), out_shape[2])
    grid = ((num_groups + threads_x - 1) // threads_x, (out_shape[2] + threads_y - 1) // threads_y, out_shape[0])
    return grid, (threads_x, threads_y, 1)


def uses_vector_stores(out, dtype: np.dtype) -> bool:
    """Whether ``preprocess_kernel`` may store VECTOR_PIXELS pixels of ``out`` with one access."""
    return out.shape[3] % VECTOR_PIXELS == 0 and start_alignment(out) >= VECTOR_PIXELS * dtype.itemsize


@numba.njit(inline="always")
def _source_coord_cpu(dst, in_size, out_size):
    real = (np.float32(dst) + np.float32(0.5)) * (np.float32(in_size) / np.float32(out_size)) - np.float32(0.5)
    if real < np.float32(0.0):
        real = np.float32(0.0)
    i0 = min(int(real), in_size - 1)
    lam = min(max(real - np.float32(i0), np.float32(0.0)), np.float32(1.0))
    i1 = i0 + 1 if i0 < in_size - 1 else i0
    return i0, i1, lam


@numba.njit(inline="always")
def _half_bits(value):
    """IEEE binary16 bits of a float32, rounded to nearest even (numba has no CPU float16).

    The general path; ``_half_bits_from_float_bits`` is the fast one for normal halves.
    """
    v = np.float64(value)
    sign = 0
    if v < 0.0 or (v == 0.0 and math.copysign(1.0, v) < 0.0):
        sign = 0x8000
        v = -v
    if v != v:
        return np.uint16(0x7E00)
    if v >= 65520.0:  # rounds past the largest half, 65504
        return np.uint16(sign | 0x7C00)
    if v < 6.103515625e-05:  # below 2**-14: subnormal, in units of 2**-24
        return np.uint16(sign | int(np.rint(v * 16777216.0)))
    mantissa, exponent = math.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    # A mantissa that rounds up to 1024 carries into the exponent, as it should.
    return np.uint16(sign | (((exponent + 14) << 10) + int(np.rint((mantissa * 2.0 - 1.0) * 1024.0))))


@numba.njit(inline="always")
def _half_bits_from_float_bits(bits, value):
    """Half bits from a float32's bits by integer rounding (numpy's algorithm) when the result is a
    normal half or rounds up to inf; anything else goes to ``_half_bits``."""
    f = np.int64(bits)
    exponent_bits = f & 0x7F800000
    if exponent_bits <= 0x38000000 or exponent_bits >= 0x47800000:  # |v| < 2**-14 or >= 2**16, inf, nan
        return _half_bits(value)
    significand = f & 0x007FFFFF
    if (significand & 0x3FFF) != 0x1000:  # round half to even: add half an ulp unless that tie would go odd
        significand += 0x1000
    # A significand that overflows carries into the exponent (and 65520.. into inf), as it should.
    return np.uint16(((f >> 16) & 0x8000) + ((exponent_bits - 0x38000000) >> 13) + (significand >> 13))


@numba.njit(parallel=True, cache=True)
def _preprocess_cpu(pixels, offsets, heights, widths, channel_scale, channel_bias, out_height, out_width, out32,
                    out16_bits, to_half, num_chunks):
    """CPU twin: output rows in chunks, one chunk per task; every channel of a pixel from one coordinate pair.

    Each chunk keeps the current image's x coordinates and weights in a table
    (rebuilt only when the chunk moves on to the next image), so the inner
    loop is loads and multiply-adds. ``num_chunks`` is at most the number of output rows. ``out16_bits`` (uint16, the bits of a
    float16 output) is written when ``to_half``, via a float32 row buffer;
    else ``out32``. The other output is an unused placeholder.
    """
    num_images = offsets.shape[0]
    num_channels = channel_scale.shape[0]
    num_rows = num_images * out_height
    one = np.float32(1.0)
    for chunk in numba.prange(num_chunks):
        x_lo = np.empty(out_width, np.int64)
        x_hi = np.empty(out_width, np.int64)
        x_weight = np.empty(out_width, np.float32)
        row_values = np.empty((num_channels, out_width), np.float32)
        row_bits = row_values.view(np.uint32)
        table_image = -1
        for row in range((chunk * num_rows) // num_chunks, ((chunk + 1) * num_rows) // num_chunks):
            image = row // out_height
            y = row - image * out_height
            width = widths[image]
            if image != table_image:
                for x in range(out_width):
                    x0, x1, lx = _source_coord_cpu(x, width, out_width)
                    x_lo[x] = x0 * num_channels
                    x_hi[x] = x1 * num_channels
                    x_weight[x] = lx
                table_image = image
            y0, y1, ly = _source_coord_cpu(y, heights[image], out_height)
            row0 = offsets[image] + y0 * width * num_channels
            row1 = offsets[image] + y1 * width * num_channels
            for x in range(out_width):
                lx = x_weight[x]
                a, b = row0 + x_lo[x], row0 + x_hi[x]
                d, e = row1 + x_lo[x], row1 + x_hi[x]
                for c in range(num_channels):
                    top = (one - lx) * np.float32(pixels[a + c]) + lx * np.float32(pixels[b + c])
                    bottom = (one - lx) * np.float32(pixels[d + c]) + lx * np.float32(pixels[e + c])
                    value = ((one - ly) * top + ly * bottom) * channel_scale[c] + channel_bias[c]
                    if to_half:
                        row_values[c, x] = value
                    else:
                        out32[image, c, y, x] = value
            if to_half:
                for c in range(num_channels):
                    for x in range(out_width):
                        out16_bits[image, c, y, x] = _half_bits_from_float_bits(row_bits[c, x], row_values[c, x])


def preprocess_images_reference(images, out_height, out_width, mean, std, out_dtype=np.float32) -> np.ndarray:
    """PyTorch reference: per image, F.interpolate in float32, then normalize."""
    import torch
    import torch.nn.functional as F

    num_channels = len(mean)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(num_channels, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(num_channels, 1, 1)
    out = torch.empty((len(images), num_channels, out_height, out_width), dtype=torch.float32)
    for i, image in enumerate(images):
        chw = torch.from_numpy(host_view(image)).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
        resized = F.interpolate(chw, size=(out_height, out_width), mode="bilinear", align_corners=False,
                                antialias=False)
        out[i] = (resized[0] / 255.0 - mean_t) / std_t
    return out.numpy().astype(out_dtype, copy=False)


def pack_images(images: Sequence[Any]) -> PackedImages:
    """Validates the images and packs them into one flat buffer plus offsets and sizes."""
    if isinstance(images, np.ndarray) or not isinstance(images, Sequence):
        raise ValueError(f"images must be a list of uint8[height, width, channels] arrays; got {type(images).__name__}")
    views: list[np.ndarray] = []
    for i, image in enumerate(images):
        if is_on_device(image):
            raise ValueError(f"images[{i}] is on the GPU; images must be host arrays (numpy or CPU tensors)")
        if not hasattr(image, "shape") or not hasattr(image, "dtype"):
            raise ValueError(f"images[{i}] must be uint8[height, width, channels]; got {type(image).__name__}")
        shape = tuple(int(s) for s in image.shape)
        if dtype_name(image) != "uint8" or len(shape) != 3:
            raise ValueError(
                f"images[{i}] must be uint8[height, width, channels]; got {dtype_name(image)} with shape {shape}"
            )
        if shape[2] not in (1, 3):
            raise ValueError(f"images[{i}] has {shape[2]} channels; expected 1 or 3")
        if shape[0] < 1 or shape[1] < 1:
            raise ValueError(f"images[{i}] is empty (shape {shape})")
        if views and shape[2] != views[0].shape[2]:
            raise ValueError(f"images[{i}] has {shape[2]} channels but images[0] has {views[0].shape[2]}")
        views.append(host_view(image))
    sizes = np.array([v.size for v in views], dtype=np.int64)
    offsets = np.zeros(len(views), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    pixels = np.concatenate([v.reshape(-1) for v in views]) if views else np.zeros(0, np.uint8)
    return PackedImages(
        pixels=pixels,
        offsets=offsets,
        heights=np.array([v.shape[0] for v in views], dtype=np.int32),
        widths=np.array([v.shape[1] for v in views], dtype=np.int32),
        num_channels=int(views[0].shape[2]) if views else 0,
    )


def preprocess_images(
    images: Sequence[Any],
    out_height: int,
    out_width: int,
    mean: Sequence[float],
    std: Sequence[float],
    out_dtype: Any = np.float32,
    backend: str | Backend | None = None,
):
    """Resizes, normalizes and stacks ragged images into ``out_dtype[N, C, out_height, out_width]``.

    ``images`` are host arrays (numpy or CPU tensors), uint8 HWC, one channel
    count for all; ``mean``/``std`` have one entry per channel, in 0..1 pixel
    units. Returns a numpy array on the CPU and reference backends; on CUDA the
    output stays on the GPU: a torch CUDA tensor when torch has CUDA, else a
    Numba device array (the simulator).
    """
    packed = pack_images(images)
    for name, size in (("out_height", out_height), ("out_width", out_width)):
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"{name} must be a positive int; got {size!r}")
    out_height, out_width = int(out_height), int(out_width)
    mean_arr = _channel_params("mean", mean)
    std_arr = _channel_params("std", std)
    if mean_arr.size != std_arr.size:
        raise ValueError(f"mean has {mean_arr.size} entries but std has {std_arr.size}")
    if np.any(std_arr <= 0):
        raise ValueError(f"std entries must be positive; got {std_arr.tolist()}")
    num_channels = packed.num_channels or mean_arr.size
    if mean_arr.size != num_channels:
        raise ValueError(f"mean and std have {mean_arr.size} entries but the images have {num_channels} channels")
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        dtype = None
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be float32 or float16; got {out_dtype!r}")

    chosen = resolve_backend(backend, prefer_cuda=True)
    out_shape = (len(packed.offsets), num_channels, out_height, out_width)
    if chosen is Backend.REFERENCE:
        return preprocess_images_reference(images, out_height, out_width, mean_arr.tolist(), std_arr.tolist(), dtype)
    # (x / 255 - mean) / std == x * scale + bias
    channel_scale = (1.0 / (255.0 * std_arr)).astype(np.float32)
    channel_bias = (-mean_arr / std_arr).astype(np.float32)
    if chosen is Backend.CPU:
        return _run_cpu(packed, channel_scale, channel_bias, out_shape, dtype)
    return _run_cuda(packed, channel_scale, channel_bias, out_shape, dtype)


def _channel_params(name: str, values: Sequence[float]) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers; got {values!r}") from None
    if arr.ndim != 1 or arr.size not in (1, 3) or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be 1 or 3 finite numbers (one per channel); got {values!r}")
    return arr


def _run_cpu(packed: PackedImages, channel_scale, channel_bias, out_shape, dtype) -> np.ndarray:
    if out_shape[0] == 0:
        return np.zeros(out_shape, dtype)
    to_half = dtype == np.float16
    out = np.empty(out_shape, np.uint16 if to_half else np.float32)
    placeholder32 = np.empty((0, 0, 0, 0), np.float32)
    placeholder16 = np.empty((0, 0, 0, 0), np.uint16)
    # Each output element reads four source bytes and writes itself; shrinking never reads all the pixels.
    with cpu_threads_for(out.size * (4 + out.itemsize)):
        _preprocess_cpu(
            packed.pixels, packed.offsets, packed.heights, packed.widths, channel_scale, channel_bias,
            out_shape[2], out_shape[3], placeholder32 if to_half else out, out if to_half else placeholder16, to_half,
            # A few chunks per thread balance images of different sizes.
            min(out_shape[0] * out_shape[2], numba.get_num_threads() * 8),
        )
    return out.view(np.float16) if to_half else out


def _run_cuda(packed: PackedImages, channel_scale, channel_bias, out_shape, dtype):
    inputs = (packed.pixels, packed.offsets, packed.heights, packed.widths, channel_scale, channel_bias)
    if _torch_has_cuda():
        import torch

        # Inputs and output are PyTorch allocations on its current stream, so
        # the caching allocator keeps them alive in stream order after we return.
        torch_dtype = torch.float16 if dtype == np.float16 else torch.float32
        out = torch.empty(out_shape, dtype=torch_dtype, device="cuda")
        if out_shape[0] == 0:
            return out
        device_inputs = [torch.from_numpy(a).to("cuda", non_blocking=True) for a in inputs]
    else:  # the simulator, or torch without CUDA: Numba allocations on the default stream
        out = cuda.device_array(out_shape, dtype=dtype)
        if out_shape[0] == 0:
            return out
        device_inputs = [cuda.to_device(a) for a in inputs]
    grid, block = cuda_launch_shape(out_shape)
    DeviceLaunch([*device_inputs, out]).launch(preprocess_kernel(dtype.name, out_shape[1]), grid, block,
                                               [*device_inputs, out, int(uses_vector_stores(out, dtype))])
    return out


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
