"""kserve_http_codec: KServe v2 REST bodies refused with messages that say what was sent."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.gateway.fronts import kserve_http_codec


def _infer(**output_parameters) -> bytes:
    return json.dumps({
        "inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 1, 1, 3], "data": [0, 1, 2]}],
        "outputs": [{"name": "PROBABILITIES", "parameters": output_parameters}],
    }).encode()


def test_an_integer_class_count_is_passed_on():
    inference = kserve_http_codec.parse_infer(_infer(classification=3), None, "digits", "")
    assert inference.request.outputs[0].parameters["classification"].int64_param == 3


@pytest.mark.parametrize(("count", "shown"), [("3", '"3"'), (2.5, "2.5"), (0, "0"), (True, "true")])
def test_a_class_count_that_is_not_an_integer_from_1_says_what_it_got(count, shown):
    with pytest.raises(InvalidArgument) as caught:
        kserve_http_codec.parse_infer(_infer(classification=count), None, "digits", "")
    assert caught.value.message == (f"outputs[0].parameters.classification must be an integer >= 1, got {shown}")
