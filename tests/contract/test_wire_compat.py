"""Operators roll services one at a time, so old and new peers must still talk."""

from __future__ import annotations

import copy
import json

from tests.contract.wire_snapshot import SNAPSHOT_PATH, incompatibilities, snapshot


def test_current_contracts_are_compatible_with_the_checked_in_snapshot():
    old = json.loads(SNAPSHOT_PATH.read_text())
    assert incompatibilities(old, snapshot()) == []


def test_snapshot_is_up_to_date_so_new_fields_get_guarded_too():
    assert json.loads(SNAPSHOT_PATH.read_text()) == snapshot(), (
        "contracts changed additively; run: .venv/bin/python -m tests.contract.wire_snapshot --write"
    )


def _mutated(edit):
    new = copy.deepcopy(snapshot())
    edit(new)
    return new


def test_renumbered_field_is_flagged():
    def edit(s):
        s["messages"]["infermesh.v1.ClassifyRequest"]["fields"]["top_k"]["number"] = 30

    assert incompatibilities(snapshot(), _mutated(edit)) == [
        "infermesh.v1.ClassifyRequest.top_k: number changed from 3 to 30"
    ]


def test_removed_field_without_reservation_is_flagged():
    def edit(s):
        del s["messages"]["infermesh.v1.SequenceStep"]["fields"]["sample"]

    assert incompatibilities(snapshot(), _mutated(edit)) == [
        "infermesh.v1.SequenceStep.sample (= 6) was removed without reserving its number"
    ]


def test_removed_field_with_reserved_number_is_allowed():
    def edit(s):
        del s["messages"]["infermesh.v1.SequenceStep"]["fields"]["sample"]
        s["messages"]["infermesh.v1.SequenceStep"]["reserved_numbers"] = [6]

    assert incompatibilities(snapshot(), _mutated(edit)) == []


def test_changed_type_is_flagged():
    def edit(s):
        s["messages"]["infermesh.v1.StageTiming"]["fields"]["duration_us"]["type"] = 2  # double

    assert incompatibilities(snapshot(), _mutated(edit)) == [
        "infermesh.v1.StageTiming.duration_us: type changed from 3 to 2"
    ]


def test_changed_streaming_shape_is_flagged():
    def edit(s):
        s["services"]["infermesh.v1.Inference"]["Generate"]["server_streaming"] = False

    problems = incompatibilities(snapshot(), _mutated(edit))
    assert len(problems) == 1 and problems[0].startswith("rpc infermesh.v1.Inference.Generate changed")


def test_added_field_is_compatible():
    def edit(s):
        s["messages"]["infermesh.v1.ClassifyRequest"]["fields"]["new_thing"] = {
            "number": 99, "type": 9, "type_name": None, "repeated": False, "oneof": None}

    assert incompatibilities(snapshot(), _mutated(edit)) == []
