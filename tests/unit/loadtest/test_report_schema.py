"""The versioned JSON Schema of the report (loadtest/schema/report-v1.schema.json) describes what
build_report writes, and refuses what is not a v1 report."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from loadtest import REPORT_SCHEMA
from loadtest.report_json import SCHEMA_PATH
from tests.unit.loadtest.test_reports import _demo_report


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_schema_file_is_the_version_the_harness_writes(validator):
    assert validator.schema["properties"]["schema"]["const"] == REPORT_SCHEMA
    assert SCHEMA_PATH.name == f"report-{REPORT_SCHEMA.rsplit('/', 1)[1]}.schema.json"


def test_a_built_report_validates(validator):
    doc = json.loads(json.dumps(_demo_report()))  # as written to disk
    errors = sorted(validator.iter_errors(doc), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]


@pytest.mark.parametrize(("path", "value", "complaint"), [
    (("schema",), "infermesh.loadtest/v2", "was expected"),
    (("overall", "num_ok"), -1, "less than the minimum"),
    (("overall", "goodput_ratio"), 1.5, "greater than the maximum"),
    (("classes", "classify-small", "latency_ms"), {"count": 3}, "'mean' is a required property"),
    (("slowest", 0, "trace_id"), "not-hex", "does not match"),
    (("meta", "tenants", 0, "api_key"), "secret", "should not be valid"),
])
def test_the_schema_refuses_what_is_not_a_v1_report(validator, path, value, complaint):
    doc = copy.deepcopy(json.loads(json.dumps(_demo_report())))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    messages = [e.message for e in validator.iter_errors(doc)]
    assert any(complaint in m for m in messages), messages


def test_a_report_missing_a_group_key_is_refused(validator):
    doc = json.loads(json.dumps(_demo_report()))
    del doc["tenants"]["alpha"]["tail"]
    assert any("'tail' is a required property" in e.message for e in validator.iter_errors(doc))
