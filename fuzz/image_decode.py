"""atheris: a client's image as the worker decodes it (services/worker/image_decode.py: PNG/JPEG via
Pillow, or raw pixels), into the model's channel count under a pixel limit."""

from __future__ import annotations

import atheris

from fuzz.harness import fuzz

with atheris.instrument_imports(include=["services.worker.image_decode", "PIL"]):
    from services.common.errors import InvalidArgument
    from services.worker.image_decode import decode_image
    from services.worker.work import RawImage

MAX_IMAGE_PIXELS = 1 << 20  # the digits model's limit (model_repo/digits/1/manifest.json)


def check(data: bytes) -> None:
    """data[0]: bit 0 picks the model's channels (1 or 3), bit 1 raw pixels instead of a file, bit 2
    scales the raw height past the pixel limit; a raw image's height, width and channels are data[1:4]."""
    mode, payload = (data[0], data[1:]) if data else (0, b"")
    channels = 1 if mode & 1 else 3
    image: bytes | RawImage = payload
    if mode & 2:
        height, width, num_channels = (list(payload[:3]) + [0, 0, 0])[:3]
        image = RawImage(payload[3:], height * (4099 if mode & 4 else 1), width, num_channels % 6 - 1)
    try:
        decode_image(image, channels=channels, max_image_pixels=MAX_IMAGE_PIXELS)
    except InvalidArgument:
        pass


if __name__ == "__main__":
    fuzz(check)
