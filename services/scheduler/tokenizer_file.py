"""tokenizer.json as it arrives after a TOKENIZER_KIND_HF hello: pieces in order, checked whole.

Pure: the Attach session feeds it the pieces it reads and asks for the file once `complete`.
"""

from __future__ import annotations

import hashlib
import re

from services.common import errors
from services.common.protocol import MAX_TOKENIZER_FILE_BYTES, TOKENIZER_FILE_CHUNK_BYTES

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_declared(size_bytes: int, sha256: str) -> None:
    """The hello's tokenizer_json_size_bytes and tokenizer_json_sha256, else InvalidArgument."""
    if not 1 <= size_bytes <= MAX_TOKENIZER_FILE_BYTES:
        raise errors.InvalidArgument(f"hello.tokenizer.tokenizer_json_size_bytes must be in [1, "
                                     f"{MAX_TOKENIZER_FILE_BYTES}], got {size_bytes}")
    if not _SHA256_HEX.fullmatch(sha256):
        raise errors.InvalidArgument("hello.tokenizer.tokenizer_json_sha256 must be 64 lowercase hex digits, "
                                     f"got {sha256[:80]!r}")


class TokenizerFileAssembly:
    def __init__(self, size_bytes: int, sha256: str) -> None:
        check_declared(size_bytes, sha256)
        self._size_bytes = size_bytes
        self._sha256 = sha256
        self._digest = hashlib.sha256()
        self._pieces: list[bytes] = []
        self._num_bytes = 0

    @property
    def complete(self) -> bool:
        return self._num_bytes == self._size_bytes

    def add(self, piece: bytes) -> None:
        if not 1 <= len(piece) <= TOKENIZER_FILE_CHUNK_BYTES:
            raise errors.InvalidArgument(f"a tokenizer_file piece must hold 1 to {TOKENIZER_FILE_CHUNK_BYTES} "
                                         f"bytes, got {len(piece)}")
        if self._num_bytes + len(piece) > self._size_bytes:
            raise errors.InvalidArgument(f"tokenizer_file pieces exceed the declared tokenizer_json_size_bytes "
                                         f"{self._size_bytes}")
        self._digest.update(piece)
        self._pieces.append(piece)
        self._num_bytes += len(piece)

    def file(self) -> bytes:
        """The whole file once `complete`, checked against the declared sha256."""
        if not self.complete:
            raise errors.InvalidArgument(f"tokenizer.json ended after {self._num_bytes} of "
                                         f"{self._size_bytes} declared bytes")
        if self._digest.hexdigest() != self._sha256:
            raise errors.InvalidArgument(f"tokenizer.json's sha256 is {self._digest.hexdigest()}, the hello "
                                         f"declared {self._sha256}")
        return b"".join(self._pieces)
