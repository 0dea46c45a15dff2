import gzip
import json
import zlib

import pytest
from aiohttp import web

from services.gateway.fronts import json_body


def test_valid_json_and_paired_surrogates_parse():
    assert json_body.loads(b'{"prompt": "\\ud83d\\ude00 ok", "n": [1, 2.5, null]}') == {"prompt": "\U0001f600 ok",
                                                                                         "n": [1, 2.5, None]}


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "\\ud800"}', "unpaired UTF-16 surrogate"),
    (b'{"\\udfff": 1}', "unpaired UTF-16 surrogate"),  # keys too
    (b'[["\\ud83d x"]]', "unpaired UTF-16 surrogate"),
    (b"{not json", "the request body is not valid JSON: Expecting property name"),
    (b'\xff\xfe{}', "the request body is not valid JSON"),
    # Python's own limit on reading an int (its message told the client to call sys.set_int_max_str_digits()).
    (b'{"dimensions": 1' + b"0" * 5000 + b"}", r"^the request body holds a number of more than 4300 digits$"),
])
def test_malformed_bodies_are_value_errors_naming_the_problem(raw, message):
    with pytest.raises(ValueError, match=message):
        json_body.loads(raw)


def test_nesting_is_refused_past_max_depth_however_deep():
    at_limit = b"[" * json_body.MAX_DEPTH + b"]" * json_body.MAX_DEPTH
    assert json_body.loads(at_limit) == json.loads(at_limit)
    for depth in (json_body.MAX_DEPTH + 1, 1000, 100_000):  # 1000: a RecursionError inside json.loads
        with pytest.raises(ValueError, match="nested too deeply"):
            json_body.loads(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")


def test_many_brackets_side_by_side_are_not_deep():
    wide = json.dumps({"data": [[[1, 2, 3]] * 16] * 16}).encode()
    assert json_body.loads(wide)["data"][15][0] == [1, 2, 3]


@pytest.mark.parametrize(("charset", "raw", "expected"), [
    ("utf-8", '{"p": "é"}'.encode(), {"p": "é"}),
    ("ISO-8859-1", '{"p": "é"}'.encode("latin-1"), {"p": "é"}),
])
def test_the_content_types_charset_decodes_the_body(charset, raw, expected):
    assert json_body.loads(raw, charset) == expected


@pytest.mark.parametrize(("charset", "raw", "message"), [
    ("bogus-xyz", b"{}", "the Content-Type's charset 'bogus-xyz' is not a known text encoding"),
    ("rot13", b"{}", "the Content-Type's charset 'rot13' is not a known text encoding"),
    ("utf-8", b'{"p": "\xff"}', "the request body is not valid utf-8 text"),
])
def test_a_charset_that_cannot_decode_the_body_is_a_value_error(charset, raw, message):
    with pytest.raises(ValueError, match=message):
        json_body.loads(raw, charset)


@pytest.mark.parametrize(("encoding", "data"), [
    ("", b"{}"), ("identity", b"{}"), ("gzip", gzip.compress(b"{}", mtime=0)), ("x-gzip", gzip.compress(b"{}", mtime=0)),
    ("deflate", zlib.compress(b"{}")),
    ("gzip", gzip.compress(b"{", mtime=0) + gzip.compress(b"}", mtime=0)),  # two members
])
def test_content_encodings_are_undone(encoding, data):
    assert json_body.decoded(data, encoding, max_bytes=100) == b"{}"


@pytest.mark.parametrize(("encoding", "data", "message"), [
    ("gzip", b"{}", "the body is not valid gzip$"),
    ("gzip", gzip.compress(b"{}", mtime=0)[:-4], "the body is not valid gzip: it ends before its compressed stream does"),
    ("deflate", zlib.compress(b"{}") + b"x", "the body is not valid deflate: bytes follow its compressed stream"),
    ("br", b"{}", "Content-Encoding 'br' is not supported: send the body as identity, gzip or deflate"),
    ("gzip, gzip", b"{}", "Content-Encoding 'gzip, gzip' is not supported"),
])
def test_a_body_that_is_not_what_its_encoding_says_is_a_value_error(encoding, data, message):
    with pytest.raises(ValueError, match=message):
        json_body.decoded(data, encoding, max_bytes=100)


def test_decompression_stops_past_max_bytes():
    with pytest.raises(web.HTTPRequestEntityTooLarge):
        json_body.decoded(gzip.compress(b"0" * 10_000_000), "gzip", max_bytes=100)
