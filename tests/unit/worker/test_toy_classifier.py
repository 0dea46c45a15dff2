"""The toy classifier decodes images as every classifier does (image_decode), and a bad image is that
item's error, not the batch's."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from infermesh.v1 import common_pb2, scheduler_pb2
from services.worker.builtin_models import INVALID_ARGUMENT, MAX_IMAGE_PIXELS, ToyClassifierRuntime


def _raw(height: int, width: int, channels: int, value: int = 0, num_bytes: int | None = None) -> common_pb2.Image:
    size = height * width * channels if num_bytes is None else num_bytes
    return common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([value]) * size, height=height, width=width,
                                                    channels=channels))


def _png(pixels: np.ndarray) -> common_pb2.Image:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return common_pb2.Image(encoded=buf.getvalue())


def _png_declaring(width: int, height: int) -> common_pb2.Image:
    """A valid 1x1 PNG whose IHDR claims width x height (CRC fixed, so only the size is a lie)."""
    data = bytearray(_png(np.zeros((1, 1), np.uint8)).encoded)
    ihdr = bytearray(data[12:29])  # chunk type + 13 bytes of header data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return common_pb2.Image(encoded=bytes(data))


def _classify(*images: common_pb2.Image) -> list[scheduler_pb2.ItemResult]:
    batch = scheduler_pb2.ExecuteBatch(items=[scheduler_pb2.BatchItem(item_id=i, image=image, top_k=2)
                                              for i, image in enumerate(images)])
    return list(ToyClassifierRuntime("1").execute_batch(batch).items)


def _error(result: scheduler_pb2.ItemResult) -> str:
    assert result.HasField("error"), result
    assert result.error.code == INVALID_ARGUMENT
    return result.error.message


def test_a_bad_image_fails_its_item_and_the_rest_of_the_batch_is_classified():
    bright_png = _png(np.full((4, 4), 250, np.uint8))
    bad, dark, bright = _classify(_raw(2, 2, 3, num_bytes=5), _raw(2, 2, 1, value=10), bright_png)
    assert _error(bad) == "raw image has 5 bytes; 2x2x3 needs 12"
    assert dark.labels[0].label == "dark" and bright.labels[0].label == "bright"


def test_raw_and_encoded_pixels_of_one_colour_image_score_alike():
    # Both go to grey the way Pillow's convert("L") does (raw RGB used to be averaged byte by byte).
    pixels = np.zeros((3, 5, 3), np.uint8)
    pixels[..., 0] = 200
    raw = common_pb2.Image(raw=common_pb2.RawImage(pixels=pixels.tobytes(), height=3, width=5, channels=3))
    from_raw, from_png = _classify(raw, _png(pixels))
    assert from_raw.labels == from_png.labels


def test_each_unusable_image_gets_a_message_naming_its_problem():
    results = _classify(common_pb2.Image(), _raw(2, 2, 2), _raw(0, 2, 1), common_pb2.Image(encoded=b"not an image"))
    assert [_error(result) for result in results] == [
        "image has neither encoded nor raw data",
        "raw image channels must be 1, 3 or 4, got 2",
        "image must be at least 1x1 pixels, got 0x2",
        "image bytes are not a PNG or JPEG file (12 bytes)",
    ]


def test_an_image_over_the_pixel_limit_is_refused_by_its_header():
    (result,) = _classify(_png_declaring(width=MAX_IMAGE_PIXELS, height=2))
    assert _error(result) == (f"image is 2x{MAX_IMAGE_PIXELS} = {2 * MAX_IMAGE_PIXELS} pixels; "
                              f"this model accepts at most {MAX_IMAGE_PIXELS}")
