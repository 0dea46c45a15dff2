"""Client images → uint8 HWC arrays with the model's channel count, under a pixel limit.

The pixel count is checked from the header (PNG IHDR, JPEG SOF) before any
pixel is decoded, so a small file declaring a huge image costs nothing.
Every problem is an InvalidArgument naming what was wrong.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

from services.common.errors import InvalidArgument
from services.worker.work import RawImage

ACCEPTED_FORMATS = ("PNG", "JPEG")


def decode_image(image: bytes | RawImage, *, channels: int, max_image_pixels: int) -> np.ndarray:
    """`uint8[height, width, channels]` for an encoded PNG/JPEG or raw pixels; InvalidArgument if unusable."""
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if isinstance(image, RawImage):
        return _from_raw(image, channels, max_image_pixels)
    return _from_encoded(image, channels, max_image_pixels)


def _check_pixels(height: int, width: int, max_image_pixels: int) -> None:
    if height < 1 or width < 1:
        raise InvalidArgument(f"image must be at least 1x1 pixels, got {height}x{width}")
    if height * width > max_image_pixels:
        raise InvalidArgument(
            f"image is {height}x{width} = {height * width} pixels; this model accepts at most {max_image_pixels}"
        )


def _from_encoded(data: bytes, channels: int, max_image_pixels: int) -> np.ndarray:
    if not data:
        raise InvalidArgument("encoded image is empty")
    # Imported here: Pillow costs a worker ~5 MiB resident, and only a classifier given encoded images needs it.
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow's own bomb guard is global and looser than ours; make its warning an error too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as img:
                width, height = img.size
                _check_pixels(height, width, max_image_pixels)
                img.load()
                converted = img.convert("L" if channels == 1 else "RGB")
    except InvalidArgument:
        raise
    except UnidentifiedImageError:
        raise InvalidArgument(f"image bytes are not a PNG or JPEG file ({len(data)} bytes)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidArgument(f"image rejected as a decompression bomb: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        # Truncated or corrupt data surfaces from Pillow's decoders as any of these.
        raise InvalidArgument(f"image could not be decoded: {exc}") from None
    pixels = np.asarray(converted, dtype=np.uint8)
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def _from_raw(raw: RawImage, channels: int, max_image_pixels: int) -> np.ndarray:
    if raw.channels not in (1, 3, 4):
        raise InvalidArgument(f"raw image channels must be 1, 3 or 4, got {raw.channels}")
    _check_pixels(raw.height, raw.width, max_image_pixels)
    expected = raw.height * raw.width * raw.channels
    if len(raw.pixels) != expected:
        raise InvalidArgument(
            f"raw image has {len(raw.pixels)} bytes; {raw.height}x{raw.width}x{raw.channels} needs {expected}"
        )
    pixels = np.frombuffer(raw.pixels, dtype=np.uint8).reshape(raw.height, raw.width, raw.channels)
    return convert_channels(pixels, channels)


def convert_channels(pixels: np.ndarray, channels: int) -> np.ndarray:
    """Grey/RGB/RGBA `uint8[H, W, c]` → `uint8[H, W, channels]` the way Pillow's convert() does it."""
    have = pixels.shape[2]
    if have == 4:
        pixels, have = pixels[:, :, :3], 3  # alpha dropped, as documented in common.proto
    if have == channels:
        return np.ascontiguousarray(pixels)
    if channels == 3:
        return np.repeat(pixels, 3, axis=2)
    # ITU-R 601-2 luma in Pillow's fixed point: L = (19595 R + 38470 G + 7471 B + 2^15) >> 16.
    rgb = pixels.astype(np.uint32)
    luma = (19595 * rgb[:, :, 0] + 38470 * rgb[:, :, 1] + 7471 * rgb[:, :, 2] + 0x8000) >> 16
    return luma.astype(np.uint8)[:, :, None]
