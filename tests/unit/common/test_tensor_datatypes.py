from __future__ import annotations

import struct

import numpy as np

from services.common.tensor_datatypes import DATATYPES, ELEMENT_SIZE_BYTES, NUMPY_DTYPES, STRUCT_CODES


def test_every_table_names_the_same_datatypes():
    assert set(STRUCT_CODES) == set(NUMPY_DTYPES) == set(ELEMENT_SIZE_BYTES) == set(DATATYPES)


def test_struct_codes_and_numpy_dtypes_agree_with_the_element_sizes():
    for datatype in DATATYPES:
        assert struct.calcsize("<" + STRUCT_CODES[datatype]) == ELEMENT_SIZE_BYTES[datatype], datatype
        assert np.dtype(NUMPY_DTYPES[datatype]).itemsize == ELEMENT_SIZE_BYTES[datatype], datatype


def test_struct_codes_and_numpy_dtypes_read_bytes_alike():
    raw = bytes(range(1, 17))  # no NaN pattern in any float width, nothing but 0/1 for BOOL below
    for datatype in DATATYPES:
        data = bytes([1, 0] * 8) if datatype == "BOOL" else raw
        count = len(data) // ELEMENT_SIZE_BYTES[datatype]
        assert list(struct.unpack(f"<{count}{STRUCT_CODES[datatype]}", data)) == \
            np.frombuffer(data, NUMPY_DTYPES[datatype]).tolist(), datatype
