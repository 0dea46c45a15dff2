"""Image classifier: a small CNN behind the `preprocess_images` kernel.

`Classifier` splits serving into the stages the worker times separately:
`preprocess` (ragged uint8 HWC images → normalized CHW batch, one kernel call)
and `predict_proba` (the network, softmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kernels import preprocess_images


@dataclass(frozen=True)
class CnnConfig:
    """conv3x3+ReLU per entry of `conv_channels`, 2x2 max-pool after every conv but the first, then an MLP head."""

    num_classes: int
    in_channels: int
    input_height: int
    input_width: int
    conv_channels: tuple[int, ...]
    hidden_size: int

    def __post_init__(self) -> None:
        for name in ("num_classes", "in_channels", "input_height", "input_width", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.conv_channels or any(not isinstance(c, int) or c < 1 for c in self.conv_channels):
            raise ValueError(f"conv_channels must be a non-empty tuple of positive ints, got {self.conv_channels!r}")
        factor = 2 ** self.num_pools
        if self.input_height % factor or self.input_width % factor:
            raise ValueError(
                f"input {self.input_height}x{self.input_width} must be divisible by {factor} "
                f"({self.num_pools} max-pools)"
            )

    @property
    def num_pools(self) -> int:
        return len(self.conv_channels) - 1


class Cnn(nn.Module):
    def __init__(self, config: CnnConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        in_channels = config.in_channels
        for i, out_channels in enumerate(config.conv_channels):
            layers += [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU()]
            if i > 0:
                layers.append(nn.MaxPool2d(2))
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        factor = 2**config.num_pools
        flat = in_channels * (config.input_height // factor) * (config.input_width // factor)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, config.hidden_size), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(config.hidden_size, config.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x float32[N, C, H, W]` (normalized) → logits `float32[N, num_classes]`."""
        return self.head(self.features(x))


class Classifier:
    """Serving wrapper: images in, class probabilities out."""

    def __init__(
        self,
        net: Cnn,
        *,
        labels: Sequence[str],
        mean: Sequence[float],
        std: Sequence[float],
        max_image_pixels: int,
    ) -> None:
        if len(labels) != net.config.num_classes:
            raise ValueError(f"{len(labels)} labels for a network with {net.config.num_classes} classes")
        # oneDNN's convolutions run about twice as fast in NHWC on CPU once a batch has a few images
        # (measured on the digits CNN: 130 → 65 µs/image at batch 32, one thread).
        # Module.to takes memory_format at run time; torch's overloads for it leave the keyword out.
        self.net = net.eval().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.config = net.config
        self.labels = tuple(labels)
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.max_image_pixels = max_image_pixels

    @property
    def channels(self) -> int:
        return self.config.in_channels

    def preprocess(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """uint8 HWC images of any sizes (channels = `self.channels`) → `float32[N, C, H, W]`."""
        c = self.config
        batch = preprocess_images(list(images), c.input_height, c.input_width, self.mean, self.std)
        return torch.as_tensor(batch)

    def predict_proba(self, batch: torch.Tensor) -> np.ndarray:
        """Normalized `float32[N, C, H, W]` → softmax probabilities `float32[N, num_classes]`."""
        device = next(self.net.parameters()).device
        with torch.inference_mode():
            nhwc = batch.to(device).contiguous(memory_format=torch.channels_last)
            return torch.softmax(self.net(nhwc), dim=-1).cpu().numpy()

    def classify(self, images: Sequence[np.ndarray]) -> np.ndarray:
        return self.predict_proba(self.preprocess(images))
