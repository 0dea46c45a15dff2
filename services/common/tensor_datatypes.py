"""The KServe v2 datatypes a tensor model's inputs and outputs may declare, and their sizes.

One home for the names, shared by the worker's manifest, its runtimes and the gateway's codecs
(which hold raw bytes and never import numpy). BYTES (variable-length strings) and BF16 (no numpy
dtype without ml_dtypes) are not tensor-model datatypes: a manifest naming them is refused.
"""

from __future__ import annotations

# KServe datatype -> bytes per element (little-endian, as KServe's raw contents carry them).
ELEMENT_SIZE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8,
    "INT8": 1, "INT16": 2, "INT32": 4, "INT64": 8,
    "FP16": 2, "FP32": 4, "FP64": 8,
}

# KServe datatype -> numpy dtype string (explicitly little-endian).
NUMPY_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "|i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}

# KServe datatype -> struct format character of one element (pack with "<": little-endian).
STRUCT_CODES: dict[str, str] = {
    "BOOL": "?",
    "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q",
    "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q",
    "FP16": "e", "FP32": "f", "FP64": "d",
}

DATATYPES: tuple[str, ...] = tuple(ELEMENT_SIZE_BYTES)
