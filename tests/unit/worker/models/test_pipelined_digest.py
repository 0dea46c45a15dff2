"""PipelinedSha256: the digest of what was handed over, whatever the sizes and however the reading ends."""

from __future__ import annotations

import hashlib

import pytest

from services.worker.models.pipelined_digest import PipelinedSha256


@pytest.mark.parametrize("sizes", [[], [0], [1], [5000, 3, 1 << 20, 2047, 2048], [4096] * 300])
def test_the_digest_is_sha256_of_every_piece_in_order(sizes):
    pieces = [bytes((i * 31 + n) % 256 for n in range(size)) for i, size in enumerate(sizes)]
    with PipelinedSha256(max_pending=4) as digest:
        for piece in pieces:
            digest.update(memoryview(piece))
        assert digest.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()
        assert digest.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()  # asked twice, same answer


def test_no_piece_is_taken_after_the_digest_is_read():
    with PipelinedSha256() as digest:
        digest.update(b"abc")
        digest.hexdigest()
        with pytest.raises(RuntimeError):
            digest.update(b"d")


def test_leaving_early_ends_the_hashing_thread():
    with pytest.raises(ValueError), PipelinedSha256(max_pending=1) as digest:
        digest.update(b"x" * 10_000)
        raise ValueError("the file ended inside a tensor")
    assert not digest._thread.is_alive()
