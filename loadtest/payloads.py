"""Request payloads made in-process: digit-like images, byte-level prompts and numeric tensors.

Images start as an 8x8 digit glyph (the shape of the handwritten-digits data
the demo classifier learns from), jittered and noised, then upscaled with
Pillow's bilinear filter to the class's size. Nothing is read from disk.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from loadtest.scenario import TENSOR_DTYPES, ImageEncoding, ImageSpec, TensorInputSpec, TensorSpec, ValueDist

_GLYPHS = {
    0: ["..####..", ".##..##.", ".#....#.", "##....##", "##....##", ".#....#.", ".##..##.", "..####.."],
    1: ["...##...", "..###...", ".####...", "...##...", "...##...", "...##...", "...##...", ".######."],
    2: ["..####..", ".##..##.", "......##", ".....##.", "...###..", "..##....", ".##.....", ".#######"],
    3: [".#####..", "......##", "......##", "..####..", "......##", "......##", "##....##", ".######."],
    4: ["....##..", "...###..", "..#.##..", ".#..##..", "########", "....##..", "....##..", "....##.."],
    5: [".######.", ".##.....", ".##.....", ".#####..", "......##", "......##", ".##..##.", "..####.."],
    6: ["...###..", "..##....", ".##.....", ".#####..", ".##..##.", ".##..##.", ".##..##.", "..####.."],
    7: [".#######", "......##", ".....##.", "....##..", "...##...", "...##...", "..##....", "..##...."],
    8: ["..####..", ".##..##.", ".##..##.", "..####..", ".##..##.", ".##..##.", ".##..##.", "..####.."],
    9: ["..####..", ".##..##.", ".##..##.", "..#####.", ".....##.", "....##..", "...##...", "..##...."],
}
GLYPHS = {d: np.array([[c == "#" for c in row] for row in rows], dtype=np.float32) for d, rows in _GLYPHS.items()}

_WORDS = ("the quick brown fox jumps over lazy dog serve model token batch queue latency tail "
          "worker gateway scheduler stream mesh block cache kernel tensor request reply").split()


@dataclass(frozen=True)
class ImagePayload:
    digit: int  # the glyph drawn, 0..9
    height: int
    width: int
    channels: int
    encoding: ImageEncoding
    data: bytes  # PNG file bytes, or raw HWC uint8 pixels


@dataclass(frozen=True)
class TextPayload:
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class TensorData:
    """One input tensor, in Triton's raw layout (row-major, little-endian; BOOL one byte an element)."""

    name: str
    datatype: str  # KServe v2: FP32, INT64, ...
    shape: tuple[int, ...]
    raw: bytes


@dataclass(frozen=True)
class TensorPayload:
    inputs: tuple[TensorData, ...]  # in the scenario's order


def digit_glyph(digit: int, rng: np.random.Generator) -> np.ndarray:
    """One 8x8 float image in [0, 1]: the glyph shifted by up to a pixel, scaled and noised."""
    glyph = np.roll(GLYPHS[digit], shift=tuple(rng.integers(-1, 2, size=2)), axis=(0, 1))
    noisy = glyph * rng.uniform(0.7, 1.0) + rng.normal(0.0, 0.08, glyph.shape)
    return np.clip(noisy, 0.0, 1.0).astype(np.float32)


def render_image(digit: int, height: int, width: int, channels: int, rng: np.random.Generator) -> np.ndarray:
    """HWC uint8: white-ish strokes on a dark background, upscaled bilinearly, optionally tinted."""
    grey = Image.fromarray((digit_glyph(digit, rng) * 255).astype(np.uint8))
    big = np.asarray(grey.resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    if channels == 1:
        return (big * 255).astype(np.uint8)[:, :, None]
    tint = rng.uniform(0.8, 1.0, size=3)
    rgb = (big[:, :, None] * tint[None, None, :] * 255).astype(np.uint8)
    if channels == 4:
        rgb = np.concatenate([rgb, np.full((height, width, 1), 255, np.uint8)], axis=2)
    return rgb


def encode_image(pixels: np.ndarray, encoding: ImageEncoding) -> bytes:
    if encoding is ImageEncoding.RAW:
        return np.ascontiguousarray(pixels).tobytes()
    # Pillow infers L / RGB / RGBA from the array's shape.
    array = pixels[:, :, 0] if pixels.shape[2] == 1 else pixels
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PNG")
    return buf.getvalue()


def make_image_pool(spec: ImageSpec, rng: np.random.Generator) -> tuple[ImagePayload, ...]:
    """The class's pre-generated images; encoding happens once here, not on the send path."""
    pool = []
    for i in range(spec.num_variants):
        digit = i % 10
        height, width = spec.height_px.sample(rng), spec.width_px.sample(rng)
        pixels = render_image(digit, height, width, spec.channels, rng)
        pool.append(ImagePayload(digit, height, width, spec.channels, spec.encoding,
                                 encode_image(pixels, spec.encoding)))
    return tuple(pool)


def make_prompt(num_bytes: int, rng: np.random.Generator) -> str:
    """ASCII words cut to exactly `num_bytes` (one byte is one token for a byte-level model)."""
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
    words: list[str] = []
    length = -1  # of " ".join(words): one space fewer than words
    while length < num_bytes:
        word = _WORDS[int(rng.integers(len(_WORDS)))]
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:num_bytes]


def make_tensor_pool(spec: TensorSpec, rng: np.random.Generator) -> tuple[TensorPayload, ...]:
    """The class's pre-generated requests: every input drawn once per variant, from `rng` (seeded)."""
    return tuple(TensorPayload(tuple(make_tensor(t, rng) for t in spec.inputs)) for _ in range(spec.num_variants))


def make_tensor(spec: TensorInputSpec, rng: np.random.Generator) -> TensorData:
    shape = tuple(d.sample(rng) for d in spec.shape)
    dtype = np.dtype(TENSOR_DTYPES[spec.datatype])
    values = spec.values
    if values.dist is ValueDist.FIXED:
        array = np.full(shape, values.a, dtype=dtype)
    elif dtype.kind == "b":
        array = rng.random(shape) < 0.5
    elif dtype.kind == "f":
        drawn = rng.uniform(values.a, values.b, shape) if values.dist is ValueDist.UNIFORM \
            else rng.normal(values.a, values.b, shape)
        info = np.finfo(dtype)
        array = np.clip(drawn, info.min, info.max).astype(dtype)
    elif values.dist is ValueDist.UNIFORM:
        array = rng.integers(int(values.a), int(values.b), size=shape, dtype=dtype, endpoint=True)
    else:
        ints = np.iinfo(dtype)
        array = np.clip(np.rint(rng.normal(values.a, values.b, shape)), ints.min, ints.max).astype(dtype)
    return TensorData(spec.name, spec.datatype, shape, np.ascontiguousarray(array, dtype=dtype).tobytes())
