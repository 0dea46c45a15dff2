"""The manifest's `classifier` block (kind "classifier"): inputs, labels, CNN architecture, golden images."""

from __future__ import annotations

import base64
import binascii
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from services.worker.models.classifier import CnnConfig
from services.worker.repository.envelope import Envelope
from services.worker.repository.json_fields import JsonFields


@dataclass(frozen=True)
class ClassifierInputs:
    input_height: int
    input_width: int
    channels: int  # 1 or 3; images are converted to this before preprocessing
    max_image_pixels: int  # height * width limit checked before decoding
    mean: tuple[float, ...]  # per channel, 0..1 pixel units
    std: tuple[float, ...]

    @classmethod
    def from_json(cls, i: JsonFields) -> ClassifierInputs:
        i.allow_only(*(f.name for f in fields(cls)))
        channels = i.integer("channels", 1)
        if channels not in (1, 3):
            raise i.fail("channels", f"must be 1 or 3, got {channels}")
        inputs = cls(
            input_height=i.integer("input_height", 1), input_width=i.integer("input_width", 1), channels=channels,
            max_image_pixels=i.integer("max_image_pixels", 1), mean=i.numbers("mean", channels),
            std=i.numbers("std", channels),
        )
        if any(s <= 0 for s in inputs.std):
            raise i.fail("std", f"entries must be > 0, got {list(inputs.std)}")
        return inputs

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}


@dataclass(frozen=True)
class GoldenImage:
    height: int
    width: int
    channels: int
    pixels: bytes  # raw uint8 HWC
    expected_top1: int

    def array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, self.channels)

    @classmethod
    def from_json(cls, g: JsonFields, num_classes: int) -> GoldenImage:
        g.allow_only("height", "width", "channels", "pixels_b64", "expected_top1")
        height, width, channels = g.integer("height", 1), g.integer("width", 1), g.integer("channels", 1)
        try:
            pixels = base64.b64decode(g.text("pixels_b64"), validate=True)
        except binascii.Error as exc:
            raise g.fail("pixels_b64", f"is not valid base64: {exc}") from None
        if len(pixels) != height * width * channels:
            raise g.fail("pixels_b64", f"decodes to {len(pixels)} bytes, expected {height}*{width}*{channels}")
        expected = g.integer("expected_top1")
        if expected >= num_classes:
            raise g.fail("expected_top1", f"must be < num_classes {num_classes}, got {expected}")
        return cls(height, width, channels, pixels, expected)

    def to_json(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "channels": self.channels,
                "pixels_b64": base64.b64encode(self.pixels).decode("ascii"), "expected_top1": self.expected_top1}


@dataclass(frozen=True)
class ClassifierSpec:
    inputs: ClassifierInputs
    labels: tuple[str, ...]  # output order
    architecture: CnnConfig
    golden: tuple[GoldenImage, ...]

    ENVELOPE_NEEDS: ClassVar[frozenset[str]] = frozenset({"max_batch_size"})

    @classmethod
    def from_json(cls, c: JsonFields, envelope: Envelope) -> ClassifierSpec:
        c.allow_only("inputs", "labels", "architecture", "golden")
        inputs = ClassifierInputs.from_json(c.obj("inputs"))
        a = c.obj("architecture")
        architecture = _cnn_config(a)
        if (architecture.in_channels, architecture.input_height, architecture.input_width) != (
            inputs.channels, inputs.input_height, inputs.input_width
        ):
            raise a.fail("in_channels", "and input_height/input_width must equal classifier.inputs")
        labels = c.array("labels", 1)
        if not all(isinstance(x, str) and x for x in labels) or len(set(labels)) != len(labels):
            raise c.fail("labels", f"must be distinct non-empty strings, got {labels!r}")
        if len(labels) != architecture.num_classes:
            raise c.fail("labels",
                         f"has {len(labels)} entries but architecture.num_classes is {architecture.num_classes}")
        golden = tuple(GoldenImage.from_json(g, architecture.num_classes) for g in c.items("golden", 1))
        return cls(inputs, tuple(labels), architecture, golden)

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs.to_json(),
            "labels": list(self.labels),
            "architecture": {**asdict(self.architecture), "conv_channels": list(self.architecture.conv_channels)},
            "golden": [g.to_json() for g in self.golden],
        }


def _cnn_config(a: JsonFields) -> CnnConfig:
    """CnnConfig's own checks raise ValueError, which parse_manifest reports with the file's name."""
    a.allow_only(*(f.name for f in fields(CnnConfig)))
    return CnnConfig(
        num_classes=a.integer("num_classes", 1), in_channels=a.integer("in_channels", 1),
        input_height=a.integer("input_height", 1), input_width=a.integer("input_width", 1),
        conv_channels=a.ints("conv_channels", 1, 1 << 16), hidden_size=a.integer("hidden_size", 1),
    )
