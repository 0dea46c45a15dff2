"""The CNNs the tensor benchmarks serve, each described by a frozen `CnnSpec` and built the same way.

Every conv block is a 3x3 conv (padding 1), ReLU and a 2x2 max-pool, so each halves the image; the
head is fully connected layers with ReLU, then 10 scores and a softmax. `cost(spec)` is the spec's
arithmetic (parameters, weight bytes, FLOPs per item), with no torch, so tests and docs read it
without building anything.

Two models, because what batching can win depends on where a request's time goes:

* SMALL_CNN ("bench-cnn", 3x32x32 in, conv 32 and 64 channels, Linear 4096->10): 0.06 M parameters
  (0.2 MiB), 11 MFLOP per item, ~0.06 ms per item on ONNX Runtime with one thread at any batch size.
  A request through the mesh costs ~2 ms of path (client, gateway, scheduler, gRPC) around that, so
  it is path-bound: batching removes the worker's share, a few percent of a request.
* VGG_CNN ("bench-vgg", 3x32x32 in, conv 32, 64 and 128 channels, FC 2048->4096->4096->10), a
  VGG-style net with VGG's 4096-unit head: 25.3 M parameters (96.5 MiB of FP32 weights, more than
  the 32 MiB L3 of the project's machine), 71 MFLOP per item. At batch 1 its FC layers read every
  weight from memory for one row, as a deployed model's are on a GPU; a batch reads them once for all
  its rows. Measured here (ONNX Runtime, one thread, one process, 2026-11-29, load average ~9):
  5.8 ms per item at batch 1, 1.4 at batch 8, 0.83 at batch 32. Compute dominates its request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_SHAPE = (3, 32, 32)  # C, H, W of every input row
NUM_CLASSES = 10


@dataclass(frozen=True)
class CnnSpec:
    model: str  # its name in the model repository
    conv_channels: tuple[int, ...]  # output channels of each conv block
    fc_units: tuple[int, ...]  # hidden fully connected layers, before the 10-score layer


@dataclass(frozen=True)
class CnnCost:
    num_params: int
    weight_bytes: int  # FP32
    flops_per_item: int  # multiply and add counted as 2; biases, ReLU, pooling and softmax left out


SMALL_CNN = CnnSpec("bench-cnn", (32, 64), ())
VGG_CNN = CnnSpec("bench-vgg", (32, 64, 128), (4096, 4096))


def layer_shapes(spec: CnnSpec) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Each conv's (in channels, out channels, output side) and each linear layer's (in, out)."""
    channels, side = IMAGE_SHAPE[0], IMAGE_SHAPE[1]
    convs = []
    for out in spec.conv_channels:
        if side % 2:
            raise ValueError(f"{spec.model}: a {side}x{side} map cannot be pooled by 2; use fewer conv blocks")
        convs.append((channels, out, side))
        channels, side = out, side // 2
    sizes = [channels * side * side, *spec.fc_units, NUM_CLASSES]
    return convs, list(zip(sizes, sizes[1:], strict=False))


def cost(spec: CnnSpec) -> CnnCost:
    convs, linears = layer_shapes(spec)
    num_params = sum(out * (cin * 9 + 1) for cin, out, _ in convs) + sum(o * (i + 1) for i, o in linears)
    flops = sum(2 * side * side * out * cin * 9 for cin, out, side in convs) + sum(2 * i * o for i, o in linears)
    return CnnCost(num_params, 4 * num_params, flops)


def build(spec: CnnSpec, seed: int = 0) -> Any:
    """The torch module, in eval mode, with weights drawn from `seed`."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    convs, linears = layer_shapes(spec)
    layers: list[nn.Module] = []
    for cin, out, _ in convs:
        layers += [nn.Conv2d(cin, out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    layers.append(nn.Flatten())
    for i, (fan_in, fan_out) in enumerate(linears):
        layers.append(nn.Linear(fan_in, fan_out))
        layers.append(nn.ReLU() if i < len(linears) - 1 else nn.Softmax(dim=-1))
    return nn.Sequential(*layers).eval()


def export_onnx(spec: CnnSpec, directory: Path) -> Path:
    """`spec` exported with torch.onnx.export as `<directory>/<model>.onnx`: input x, output probs,
    dim 0 dynamic."""
    import torch

    path = directory / f"{spec.model}.onnx"
    torch.onnx.export(build(spec), (torch.randn(2, *IMAGE_SHAPE),), str(path), dynamo=False, input_names=["x"],
                      output_names=["probs"], dynamic_axes={"x": {0: "batch"}, "probs": {0: "batch"}})
    return path
