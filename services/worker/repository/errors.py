"""What can be wrong with a model version on disk, as domain errors (the worker exits 2 on any of them)."""

from __future__ import annotations

from services.common.errors import InfermeshError


class ModelRepositoryError(InfermeshError):
    """A model version exists but cannot be served as it is on disk."""


class InvalidManifest(ModelRepositoryError):
    """The manifest is not valid JSON or breaks the schema; the message names the file and the field."""


class ChecksumMismatch(ModelRepositoryError):
    """A file of the version directory differs from the sha256 its manifest pins: the version was modified."""


class IncompatibleWeights(ModelRepositoryError):
    pass


class GoldenCheckFailed(ModelRepositoryError):
    pass


class ImportRefused(ModelRepositoryError):
    """A source (a Hugging Face checkpoint directory, a TorchScript or ONNX file) cannot become a servable
    version as asked; the message names the file and the field, or the flag that gives what is missing."""
