from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from services.common import errors
from services.common.status import (
    ERROR_BY_STATUS,
    STATUS_BY_ERROR,
    from_rpc_error,
    pushback_ms_of,
    retry_after_s_of,
    status_code_of,
    trailing_metadata_of,
    wire_message,
)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_every_domain_error_has_exactly_one_status():
    assert len(set(STATUS_BY_ERROR.values())) == len(STATUS_BY_ERROR)
    assert status_code_of(errors.NotFound("x")) == grpc.StatusCode.NOT_FOUND


def test_retry_hint_travels_as_pushback_and_retry_info():
    metadata = dict(trailing_metadata_of(errors.ResourceExhausted("over quota", retry_after_s=1.25)))
    assert metadata["grpc-retry-pushback-ms"] == "1250"
    rich = status_pb2.Status.FromString(metadata["grpc-status-details-bin"])
    assert rich.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    info = error_details_pb2.RetryInfo()
    assert rich.details[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() == 1250


def test_a_retry_at_once_hint_goes_on_the_wire_as_one_millisecond():
    # grpcio's own retry policy waits for the deadline on a pushback of "0" (test_pushback_with_grpc_retries.py).
    metadata = dict(trailing_metadata_of(errors.Unavailable("draining", retry_after_s=0.0)))
    assert metadata["grpc-retry-pushback-ms"] == "1"


def test_a_long_message_is_cut_and_says_how_much_was_cut():
    assert wire_message("x" * 1024) == "x" * 1024
    cut = wire_message("m" * 17_000)
    assert cut == "m" * 1024 + "... (15976 more characters)"
    rich = status_pb2.Status.FromString(dict(trailing_metadata_of(
        errors.ResourceExhausted("n" * 5000, retry_after_s=1)))["grpc-status-details-bin"])
    assert len(rich.message) < 1100


def test_errors_without_hint_carry_no_trailing_metadata():
    assert trailing_metadata_of(errors.InvalidArgument("bad")) == ()


def test_upstream_status_maps_back_to_the_same_domain_error_with_its_hint():
    rpc_error = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "no worker", (("grpc-retry-pushback-ms", "500"),))
    err = from_rpc_error(rpc_error)
    assert isinstance(err, errors.Unavailable)
    assert (err.message, err.retry_after_s) == ("no worker", 0.5)
    for code, cls in ERROR_BY_STATUS.items():
        assert type(from_rpc_error(FakeRpcError(code, "m"))) is cls


def test_unknown_upstream_status_becomes_internal():
    assert isinstance(from_rpc_error(FakeRpcError(grpc.StatusCode.UNKNOWN, "boom")), errors.Internal)


def test_the_pushback_is_read_as_sent_and_the_hint_never_negative():
    def failed(*trailing):
        return FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", trailing)

    assert pushback_ms_of(failed(("other", "x"), ("grpc-retry-pushback-ms", "250"))) == 250
    assert pushback_ms_of(failed(("grpc-retry-pushback-ms", "-1"))) == -1  # the server's "do not retry"
    assert retry_after_s_of(failed(("grpc-retry-pushback-ms", "-1"))) == 0.0
    assert retry_after_s_of(failed(("grpc-retry-pushback-ms", "1500"))) == 1.5
    for unreadable in (failed(("grpc-retry-pushback-ms", "soon")), failed()):
        assert pushback_ms_of(unreadable) is None and retry_after_s_of(unreadable) is None
