"""The benchmark CNNs: the spec's arithmetic against the built module (shapes, parameter count)."""

from __future__ import annotations

import pytest
import torch

from bench.worker.tensor_cnns import (
    IMAGE_SHAPE,
    NUM_CLASSES,
    SMALL_CNN,
    VGG_CNN,
    CnnSpec,
    build,
    cost,
    layer_shapes,
)


@pytest.mark.parametrize("spec", [SMALL_CNN, VGG_CNN], ids=lambda s: s.model)
def test_built_module_has_the_parameters_the_spec_counts_and_scores_each_row(spec: CnnSpec) -> None:
    net = build(spec)
    assert sum(p.numel() for p in net.parameters()) == cost(spec).num_params
    with torch.no_grad():
        probs = net(torch.randn(3, *IMAGE_SHAPE))
    assert probs.shape == (3, NUM_CLASSES)
    assert torch.allclose(probs.sum(dim=1), torch.ones(3))


def test_small_cnn_is_the_one_the_knee_bench_always_served() -> None:
    assert layer_shapes(SMALL_CNN) == ([(3, 32, 32), (32, 64, 16)], [(64 * 8 * 8, 10)])
    assert cost(SMALL_CNN).flops_per_item == 2 * (32 * 32 * 32 * 27 + 16 * 16 * 64 * 32 * 9 + 4096 * 10)


def test_vgg_head_holds_nearly_all_the_weights() -> None:
    convs, linears = layer_shapes(VGG_CNN)
    assert [side for _, _, side in convs] == [32, 16, 8]
    assert linears == [(2048, 4096), (4096, 4096), (4096, 10)]
    vgg = cost(VGG_CNN)
    assert vgg.num_params == 25_308_234
    assert vgg.weight_bytes == 4 * vgg.num_params
    assert sum(o * (i + 1) for i, o in linears) / vgg.num_params > 0.99


def test_a_map_too_small_to_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be pooled"):
        layer_shapes(CnnSpec("deep", (8, 8, 8, 8, 8, 8), ()))
