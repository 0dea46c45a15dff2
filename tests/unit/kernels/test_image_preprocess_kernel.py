import numpy as np
import pytest
import torch

from kernels import preprocess_images
from kernels.image_preprocess import (
    PIXELS_PER_THREAD,
    _half_bits,
    _half_bits_from_float_bits,
    cuda_launch_shape,
    pack_images,
)

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def random_images(rng, sizes, channels=3):
    return [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in sizes]


def test_cpu_twin_matches_reference_on_a_ragged_batch(rng, assert_close):
    sizes = [tuple(s) for s in rng.integers(16, 300, size=(12, 2))]
    images = random_images(rng, sizes)
    for out_height, out_width in [(224, 224), (32, 32)]:  # mostly upscaling, then downscaling
        got = preprocess_images(images, out_height, out_width, MEAN, STD, backend="cpu")
        want = preprocess_images(images, out_height, out_width, MEAN, STD, backend="reference")
        assert got.shape == (12, 3, out_height, out_width) and got.dtype == np.float32
        assert_close(got, want)


@pytest.mark.parametrize(
    ("size", "out_size"),
    [((1, 1), (7, 5)), ((1, 200), (32, 32)), ((300, 2), (32, 32)), ((5, 8), (40, 61)), ((97, 131), (13, 9)),
     ((24, 24), (24, 24)), ((3, 300), (1, 1))],
    ids=["1x1", "1x200", "300x2", "upscale", "downscale", "same-size", "to-1x1"],
)
def test_edge_sizes_match_reference(rng, assert_close, size, out_size):
    images = random_images(rng, [size, (10, 10)])
    got = preprocess_images(images, *out_size, MEAN, STD, backend="cpu")
    assert_close(got, preprocess_images(images, *out_size, MEAN, STD, backend="reference"))


def test_same_size_resize_only_normalizes(rng, assert_close):
    image = random_images(rng, [(9, 11)])[0]
    got = preprocess_images([image], 9, 11, MEAN, STD, backend="cpu")
    want = (image.transpose(2, 0, 1) / 255.0 - np.array(MEAN)[:, None, None]) / np.array(STD)[:, None, None]
    assert_close(got[0], want)


def test_cpu_twin_follows_align_corners_false_on_a_known_image(assert_close):
    # 2x2 -> 4x4 with align_corners=False: edges clamp, interior interpolates at quarter offsets.
    image = np.array([[0, 100], [200, 40]], np.uint8)[:, :, None]
    got = preprocess_images([image], 4, 4, [0.0], [1 / 255], backend="cpu")[0, 0]
    want = np.array(
        [[0, 25, 75, 100], [50, 58.75, 76.25, 85], [150, 126.25, 78.75, 55], [200, 160, 80, 40]], np.float64
    )
    assert_close(got, want)


def test_grayscale_and_torch_uint8_tensors(rng, assert_close):
    images = random_images(rng, [(30, 20), (8, 50)], channels=1)
    want = preprocess_images(images, 16, 16, [0.5], [0.25], backend="reference")
    got = preprocess_images([torch.from_numpy(i) for i in images], 16, 16, [0.5], [0.25], backend="cpu")
    assert got.shape == (2, 1, 16, 16)
    assert_close(got, want)


def test_non_contiguous_images_are_read_correctly(rng, assert_close):
    big = random_images(rng, [(60, 80)])[0]
    images = [big[::2, 1::3], big[5:40, 10:70]]
    want = preprocess_images([np.ascontiguousarray(i) for i in images], 20, 20, MEAN, STD, backend="reference")
    assert_close(preprocess_images(images, 20, 20, MEAN, STD, backend="cpu"), want)


def test_float16_output_is_the_rounded_float32_output(rng, assert_close):
    images = random_images(rng, [(40, 30), (7, 90)])
    full = preprocess_images(images, 24, 24, MEAN, STD, backend="cpu")
    half = preprocess_images(images, 24, 24, MEAN, STD, out_dtype=np.float16, backend="cpu")
    assert half.dtype == np.float16
    assert_close(half, full.astype(np.float16), 0.0)
    assert_close(half, full, 1e-3)


def test_half_conversions_round_like_numpy():
    rng = np.random.default_rng(7)
    values = np.concatenate([
        (rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000)).astype(np.float32),
        np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                  2.0**-14, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, np.nan, np.inf, -np.inf], np.float32),
    ])
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    general = np.array([_half_bits(v) for v in values], np.uint16)
    fast = np.array([_half_bits_from_float_bits(b, v) for b, v in zip(values.view(np.uint32), values, strict=True)], np.uint16)
    for got in (general, fast):
        mismatched = values[got != want]
        assert mismatched.size == 0, f"float16 bits differ for {mismatched[:5]}"


@pytest.mark.parametrize("out_shape", [(256, 3, 224, 224), (2, 1, 6, 5), (3, 3, 1000, 1000), (1, 3, 1, 1),
                                       (1, 3, 7, 262)])
def test_cuda_launch_shape_covers_the_output_without_idle_blocks(out_shape):
    (grid_x, grid_y, grid_z), (threads_x, threads_y, threads_z) = cuda_launch_shape(out_shape)
    columns_per_block = threads_x * PIXELS_PER_THREAD
    assert threads_z == 1 and grid_z == out_shape[0]
    assert (grid_x - 1) * columns_per_block < out_shape[3] <= grid_x * columns_per_block
    assert (grid_y - 1) * threads_y < out_shape[2] <= grid_y * threads_y
    assert threads_x * threads_y <= 1024


def test_cuda_launch_shape_gives_a_224_row_to_one_block_of_56_threads():
    assert cuda_launch_shape((256, 3, 224, 224)) == ((1, 56, 256), (56, 4, 1))


def test_empty_batch_has_the_channel_count_of_mean(rng):
    out = preprocess_images([], 8, 8, MEAN, STD, backend="cpu")
    assert out.shape == (0, 3, 8, 8)


def test_packing_is_back_to_back_with_offsets():
    images = [np.full((2, 3, 3), 1, np.uint8), np.full((1, 1, 3), 2, np.uint8), np.full((4, 2, 3), 3, np.uint8)]
    packed = pack_images(images)
    assert packed.offsets.tolist() == [0, 18, 21]
    assert packed.heights.tolist() == [2, 1, 4] and packed.widths.tolist() == [3, 1, 2]
    assert packed.pixels.size == 45 and packed.pixels[18:21].tolist() == [2, 2, 2]


@pytest.mark.parametrize(
    ("images", "kwargs", "message"),
    [
        ([np.zeros((4, 4, 3), np.float32)], {}, r"images\[0\] must be uint8\[height, width, channels\]; got float32"),
        ([np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4), np.uint8)], {}, r"images\[1\] must be uint8\[height, width, channels\]; got uint8 with shape \(4, 4\)"),
        ([np.zeros((4, 4, 4), np.uint8)], {}, r"images\[0\] has 4 channels; expected 1 or 3"),
        ([np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4, 1), np.uint8)], {}, r"images\[1\] has 1 channels but images\[0\] has 3"),
        ([np.zeros((0, 4, 3), np.uint8)], {}, r"images\[0\] is empty"),
        (np.zeros((2, 4, 4, 3), np.uint8), {}, "images must be a list"),
        ([np.zeros((4, 4, 3), np.uint8)], {"out_height": 0}, "out_height must be a positive int; got 0"),
        ([np.zeros((4, 4, 3), np.uint8)], {"out_width": 2.5}, "out_width must be a positive int"),
        ([np.zeros((4, 4, 3), np.uint8)], {"mean": [0.5]}, "mean has 1 entries but std has 3"),
        ([np.zeros((4, 4, 1), np.uint8)], {}, "mean and std have 3 entries but the images have 1 channels"),
        ([np.zeros((4, 4, 3), np.uint8)], {"std": [0.2, 0.0, 0.2]}, "std entries must be positive"),
        ([np.zeros((4, 4, 3), np.uint8)], {"out_dtype": np.float64}, "out_dtype must be float32 or float16"),
    ],
)
def test_rejects_bad_arguments_with_precise_messages(images, kwargs, message):
    args = {"out_height": 8, "out_width": 8, "mean": MEAN, "std": STD, "backend": "cpu"} | kwargs
    with pytest.raises(ValueError, match=message):
        preprocess_images(images, **args)
