from __future__ import annotations

import io
import itertools
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from services.common.errors import InvalidArgument
from services.worker.batch_executor import BatchExecutor
from services.worker.image_decode import convert_channels, decode_image
from services.worker.repository.loader import LoadedModel
from services.worker.work import BatchItem, ErrorCode, RawImage
from tools.build_models import DigitsData, digits_dataset


def _png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels.squeeze(), mode).save(out, format="PNG")
    return out.getvalue()


def _jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR claims width x height (CRC fixed, so only the size is a lie)."""
    data = bytearray(_png(np.zeros((1, 1, 3), np.uint8)))
    ihdr = bytearray(data[12:29])  # chunk type + 13 bytes of header data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


@pytest.fixture(scope="module")
def heldout() -> DigitsData:
    return digits_dataset()


def _executor(digits: LoadedModel, **kwargs) -> BatchExecutor:
    return BatchExecutor(digits.classifier, **kwargs)


def test_heldout_accuracy_through_png_equals_offline_and_is_at_least_95_percent(digits: LoadedModel, heldout: DigitsData) -> None:
    data = heldout
    offline = digits.classifier.classify(list(data.test_images)).argmax(axis=1)
    offline_accuracy = float((offline == data.test_labels).mean())
    items = [BatchItem(i, _png(img), top_k=1) for i, img in enumerate(data.test_images)]
    results, _ = _executor(digits, max_batch_size=64).execute(items)
    served = np.array([int(r.labels[0].label) for r in results])
    assert [r.item_id for r in results] == list(range(len(items)))
    np.testing.assert_array_equal(served, offline)
    served_accuracy = float((served == data.test_labels).mean())
    assert served_accuracy == offline_accuracy == pytest.approx(digits.manifest.quality["heldout_accuracy"])
    assert served_accuracy >= 0.95


def test_bad_items_fail_alone_with_invalid_argument(digits: LoadedModel, heldout: DigitsData) -> None:
    image = heldout.test_images[0]
    good = BatchItem(1, _png(image), top_k=3)
    bad = [
        (BatchItem(2, b"\x89PNG garbage bytes"), "not a PNG or JPEG file"),
        (BatchItem(3, _png_declaring(5000, 5000)), "5000x5000 = 25000000 pixels; this model accepts at most"),
        (BatchItem(4, _png_declaring(50000, 50000)), "decompression bomb"),
        (BatchItem(5, _png(image)[:200]), "could not be decoded"),
        (BatchItem(6, RawImage(b"\x00" * 10, 2, 2, 3)), "raw image has 10 bytes; 2x2x3 needs 12"),
        (BatchItem(7, RawImage(b"\x00" * 8, 2, 2, 2)), "raw image channels must be 1, 3 or 4"),
        (BatchItem(8, RawImage(b"", 0, 5, 3)), "at least 1x1 pixels"),
        (BatchItem(9, b""), "encoded image is empty"),
        (BatchItem(10, _png(image), top_k=0), "top_k must be >= 1"),
        (BatchItem(11, b"GIF89a" + b"\x00" * 30), "not a PNG or JPEG file"),
    ]
    results, _ = _executor(digits).execute([good, *(item for item, _ in bad)])
    assert results[0].error is None and len(results[0].labels) == 3
    assert results[0].labels[0].label == str(heldout.test_labels[0])
    for result, (item, fragment) in zip(results[1:], bad, strict=True):
        assert result.item_id == item.item_id and result.labels == ()
        assert result.error is not None and result.error.code == ErrorCode.INVALID_ARGUMENT
        assert fragment in result.error.message, result.error.message


def test_accepts_jpeg_grey_png_and_raw_rgba_or_grey(digits: LoadedModel, heldout: DigitsData) -> None:
    image = heldout.test_images[3]
    label = str(heldout.test_labels[3])
    grey = image[:, :, :1]
    rgba = np.concatenate([image, np.full(image.shape[:2] + (1,), 255, np.uint8)], axis=2)
    items = [
        BatchItem(1, _jpeg(image)),
        BatchItem(2, _png(grey, "L")),
        BatchItem(3, RawImage(rgba.tobytes(), 32, 32, 4)),
        BatchItem(4, RawImage(grey.tobytes(), 32, 32, 1)),
        BatchItem(5, RawImage(np.kron(grey, np.ones((3, 2, 1), np.uint8)).tobytes(), 96, 64, 1)),  # other size
    ]
    results, _ = _executor(digits).execute(items)
    assert [r.error for r in results] == [None] * 5
    assert [r.labels[0].label for r in results] == [label] * 5


def test_top_k_is_sorted_and_capped_at_the_number_of_classes(digits: LoadedModel, heldout: DigitsData) -> None:
    item = BatchItem(1, _png(heldout.test_images[0]), top_k=50)
    (result,), _ = _executor(digits).execute([item])
    scores = [label.score for label in result.labels]
    assert len(result.labels) == 10 and scores == sorted(scores, reverse=True)
    assert sum(scores) == pytest.approx(1.0, abs=1e-5)
    assert sorted(label.index for label in result.labels) == list(range(10))


def test_batches_larger_than_max_batch_size_run_in_chunks_with_stage_times(digits: LoadedModel, heldout: DigitsData) -> None:
    ticks = itertools.count()
    executor = _executor(digits, clock=lambda: float(next(ticks)), max_batch_size=4)
    images = heldout.test_images[:10]
    results, durations = executor.execute([BatchItem(i, _png(img)) for i, img in enumerate(images)])
    whole = digits.classifier.classify(list(images)).argmax(axis=1)
    assert [r.labels[0].index for r in results] == whole.tolist()
    assert (durations.decode_s, durations.preprocess_s, durations.compute_s, durations.postprocess_s) == (1, 1, 1, 1)


def test_empty_batch_returns_nothing(digits: LoadedModel) -> None:
    results, _ = _executor(digits).execute([])
    assert results == []


def test_decode_converts_channels_like_pillow() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    expected = np.asarray(Image.fromarray(rgb).convert("L"))
    np.testing.assert_array_equal(convert_channels(rgb, 1)[:, :, 0], expected)
    decoded = decode_image(RawImage(rgb.tobytes(), 5, 7, 3), channels=1, max_image_pixels=35)
    np.testing.assert_array_equal(decoded[:, :, 0], expected)
    with pytest.raises(InvalidArgument, match="5x7 = 35 pixels; this model accepts at most 34"):
        decode_image(RawImage(rgb.tobytes(), 5, 7, 3), channels=3, max_image_pixels=34)
