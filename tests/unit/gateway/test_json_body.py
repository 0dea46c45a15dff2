import pytest

from services.gateway import json_body


def test_valid_json_and_paired_surrogates_parse():
    assert json_body.loads(b'{"prompt": "\\ud83d\\ude00 ok", "n": [1, 2.5, null]}') == {"prompt": "\U0001f600 ok",
                                                                                         "n": [1, 2.5, None]}


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "\\ud800"}', "unpaired UTF-16 surrogate"),
    (b'{"\\udfff": 1}', "unpaired UTF-16 surrogate"),  # keys too
    (b'[["\\ud83d x"]]', "unpaired UTF-16 surrogate"),
    (b"{not json", "the request body is not valid JSON: Expecting property name"),
    (b'\xff\xfe{}', "the request body is not valid JSON"),
])
def test_malformed_bodies_are_value_errors_naming_the_problem(raw, message):
    with pytest.raises(ValueError, match=message):
        json_body.loads(raw)
