"""Model definitions the worker serves: an image classifier and a paged decoder-only LM."""

from services.worker.models.classifier import Classifier, Cnn, CnnConfig
from services.worker.models.generator import Generator
from services.worker.models.paged import KVCache, PagedSequence, paged_forward
from services.worker.models.transformer import DecoderLM, TransformerConfig

__all__ = [
    "Classifier",
    "Cnn",
    "CnnConfig",
    "DecoderLM",
    "Generator",
    "KVCache",
    "PagedSequence",
    "TransformerConfig",
    "paged_forward",
]
