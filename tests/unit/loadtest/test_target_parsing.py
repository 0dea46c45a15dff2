"""The pure parts of the targets: URLs, Server-Timing, server-sent events, KServe BYTES tensors, token counts."""

from __future__ import annotations

import pytest

from loadtest.records import StageSample
from loadtest.targets.address import TargetKind, parse_target
from loadtest.targets.kserve_tensors import pack_bytes, unpack_bytes
from loadtest.targets.server_timing import parse_server_timing, parse_timings_extension
from loadtest.targets.sse import DONE, SseDecoder
from loadtest.targets.token_count import token_counter


@pytest.mark.parametrize(("url", "kind", "host_port", "base_url"), [
    ("127.0.0.1:50051", TargetKind.INFERMESH_GRPC, "127.0.0.1:50051", None),
    ("grpc://gw:443", TargetKind.INFERMESH_GRPC, "gw:443", None),
    ("openai+http://127.0.0.1:8000/v1", TargetKind.OPENAI_HTTP, "127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("openai+https://h:8443", TargetKind.OPENAI_HTTP, "h:8443", "https://h:8443/v1"),
    ("openai+http://h:80/api/v1/", TargetKind.OPENAI_HTTP, "h:80", "http://h:80/api/v1"),
    ("kserve+grpc://h:8001", TargetKind.KSERVE_GRPC, "h:8001", None),
    ("kserve+https://h:8000", TargetKind.KSERVE_HTTP, "h:8000", "https://h:8000"),
    ("[::1]:50051", TargetKind.INFERMESH_GRPC, "[::1]:50051", None),
])
def test_parses_each_target_kind(url, kind, host_port, base_url):
    address = parse_target(url)
    assert (address.kind, address.host_port) == (kind, host_port)
    if base_url is not None:
        assert address.base_url == base_url


@pytest.mark.parametrize(("url", "complaint"), [
    ("", "empty"),
    ("http://h:80", "unknown scheme"),
    ("openai+http://h", "HOST:PORT"),
    ("grpc://h:99999", "HOST:PORT"),
    ("grpc://h:1/path", "takes no path"),
    ("openai+http://user:pw@h:1/v1", "credentials"),
    ("openai+http://h:1/v1?x=1", "query"),
])
def test_refuses_a_bad_target_naming_what_is_wrong(url, complaint):
    with pytest.raises(ValueError, match=complaint):
        parse_target(url)


def test_server_timing_reads_our_service_stage_names_and_a_peers_plain_ones():
    ours = parse_server_timing("gateway.admission;dur=0.020, scheduler.queue_wait;dur=1.5, total;dur=3.250")
    assert ours.stages == (StageSample("admission", "gateway", 20), StageSample("queue_wait", "scheduler", 1500))
    assert ours.total_us == 3250
    peer = parse_server_timing('db;dur=53;desc="Database", cache;desc="Cache Read"; dur=23.2, miss, cpu;dur=x')
    assert peer.stages == (StageSample("db", "", 53000), StageSample("cache", "", 23200))
    assert not parse_server_timing(None).reported and not parse_server_timing("miss").reported


def test_timings_extension_reads_infermesh_json_and_ignores_other_shapes():
    timings = parse_timings_extension({"total_us": 900, "stages": [
        {"service": "worker", "stage": "compute", "duration_us": 700}, {"stage": "bad", "duration_us": "7"}]})
    assert timings.stages == (StageSample("compute", "worker", 700),) and timings.total_us == 900
    assert not parse_timings_extension(None).reported and not parse_timings_extension([1]).reported


def test_sse_decoder_returns_each_events_data_at_its_blank_line():
    decoder = SseDecoder()
    lines = [b": keep-alive\n", b"data: {\"a\": 1}\n", b"\n", b"event: x\r\n", b"data: one\n", b"data:two\n", b"\r\n",
             b"data: [DONE]\n", b"\n"]
    events = [e for e in map(decoder.feed_line, lines) if e is not None]
    assert events == ['{"a": 1}', "one\ntwo", DONE]
    decoder.feed_line(b"data: tail\n")
    assert decoder.close() == "tail" and decoder.close() is None


def test_sse_decoder_reads_raw_chunks_cut_anywhere_even_inside_a_character():
    stream = ': keep-alive\ndata: {"t": "é"}\n\nevent: x\r\ndata: one\ndata:two\r\n\r\ndata: [DONE]\n\n'.encode()
    for cut in range(1, len(stream)):
        decoder = SseDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert events == ['{"t": "é"}', "one\ntwo", DONE], cut
    decoder = SseDecoder()
    assert decoder.feed(b"data: tail") == [] and decoder.close() == "tail"


def test_kserve_bytes_tensors_round_trip_and_refuse_a_truncated_one():
    raw = pack_bytes([b"", b"png-bytes", "é".encode()])
    assert unpack_bytes(raw) == [b"", b"png-bytes", "é".encode()]
    with pytest.raises(ValueError, match="runs past"):
        unpack_bytes(raw[:-1])
    with pytest.raises(ValueError, match="length prefix"):
        unpack_bytes(b"\x01\x00")


def test_token_counter_counts_bytes_by_default_and_refuses_an_unknown_spec(tmp_path):
    assert token_counter("bytes").count("héllo") == 6
    with pytest.raises(ValueError, match="tokenizer must be"):
        token_counter("words")
    with pytest.raises(ValueError, match="cannot load"):
        token_counter(f"hf:{tmp_path / 'missing.json'}")
