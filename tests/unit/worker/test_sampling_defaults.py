"""A model's recommended sampling: read from generation_config.json at import, kept in the manifest,
sent in the worker's hello, and applied by the scheduler to the fields a request leaves to the model."""

from __future__ import annotations

import json
import re

import pytest

from infermesh.v1 import common_pb2, scheduler_pb2
from services.scheduler.attach_codec import decode_hello
from services.scheduler.call_codec import with_model_defaults
from services.worker.repository.errors import InvalidManifest
from services.worker.repository.json_fields import JsonFields
from services.worker.repository.sampling_defaults import SamplingDefaults

# Qwen3's generation_config.json, as its model card ships it.
QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def test_generation_config_recommendations_are_read_as_vllm_reads_them():
    defaults = SamplingDefaults.from_generation_config(QWEN3, "generation_config.json")
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert defaults.to_json() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert SamplingDefaults.from_generation_config({"temperature": None, "bos_token_id": 1}, "g").empty
    proto = defaults.to_proto()
    assert proto.HasField("temperature") and not proto.HasField("min_p") and proto.top_k == 20


@pytest.mark.parametrize(("field", "value", "says"), [
    ("temperature", -0.5, "must be >= 0"), ("top_p", 0, "must be in (0, 1]"), ("top_k", 2.5, "an integer"),
    ("min_p", 1.5, "[0, 1]"), ("repetition_penalty", 3.0, "(0, 2]"), ("temperature", "hot", "finite number"),
])
def test_a_recommendation_the_mesh_cannot_sample_with_is_refused_naming_file_and_field(field, value, says):
    with pytest.raises(ValueError, match=rf"gen.json: {field} .*{re.escape(says)}.*--generation-config none") as caught:
        SamplingDefaults.from_generation_config({field: value}, "gen.json")
    assert says in str(caught.value)
    with pytest.raises(InvalidManifest, match=rf"generator.sampling_defaults.{field}"):
        SamplingDefaults.from_json(JsonFields({field: value}, "manifest.json", "generator.sampling_defaults"))


def test_the_manifest_block_round_trips_and_refuses_unknown_fields():
    defaults = SamplingDefaults(temperature=0.7, repetition_penalty=1.05, min_p=0.05)
    block = JsonFields(json.loads(json.dumps(defaults.to_json())), "m.json", "generator.sampling_defaults")
    assert SamplingDefaults.from_json(block) == defaults
    with pytest.raises(InvalidManifest, match="unknown field"):
        SamplingDefaults.from_json(JsonFields({"do_sample": True}, "m.json", "generator.sampling_defaults"))


def test_the_scheduler_replaces_only_the_fields_left_to_the_model_that_it_recommends():
    hello = common_pb2.SamplingDefaults(temperature=0.6, top_k=20)
    defaults = decode_hello(scheduler_pb2.WorkerHello(sampling_defaults=hello)).sampling_defaults
    assert dict(defaults) == {"temperature": 0.6000000238418579, "top_k": 20}  # float32 on the wire
    sent = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=5, max_tokens=8)
    left = [common_pb2.SAMPLING_FIELD_TEMPERATURE, common_pb2.SAMPLING_FIELD_TOP_P, 99]  # 99: a newer gateway's
    applied = with_model_defaults(sent, left, defaults)
    # temperature recommended and left: replaced; top_p left but not recommended: kept; top_k recommended
    # but set by the request: kept; the unknown field value passed over.
    assert (applied.temperature, applied.top_p, applied.top_k, applied.max_tokens) == (
        pytest.approx(0.6), 1.0, 5, 8)
    assert sent.temperature == 1.0  # the request is not changed in place
    assert with_model_defaults(sent, [], defaults) is sent
