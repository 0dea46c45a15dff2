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
    provider = atheris.FuzzedDataProvider(data)
    channels = provider.PickValueInList([1, 3])
    if provider.ConsumeBool():
        image = RawImage(pixels=b"", height=provider.ConsumeIntInRange(-2, 4096),
                         width=provider.ConsumeIntInRange(-2, 4096), channels=provider.ConsumeIntInRange(-1, 5))
        image = RawImage(provider.ConsumeBytes(provider.ConsumeIntInRange(0, 1 << 16)), image.height, image.width,
                         image.channels)
    else:
        image = provider.ConsumeBytes(atheris.ALL_REMAINING)
    try:
        decode_image(image, channels=channels, max_image_pixels=MAX_IMAGE_PIXELS)
    except InvalidArgument:
        pass


if __name__ == "__main__":
    fuzz(check)
