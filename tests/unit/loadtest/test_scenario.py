import io
import re

import numpy as np
import pytest
from PIL import Image

from loadtest.distributions import parse_int_dist
from loadtest.payloads import make_image_pool, make_prompt, render_image
from loadtest.scenario import ImageEncoding, LoadMode, RequestKind, load_scenario, parse_scenario
from loadtest.workload import open_loop_plan


def _doc(**over):
    doc = {"load": {"rate_rps": 10}, "tenants": [{"api_key": "k"}],
           "classes": [{"kind": "classify", "model": "digits"}]}
    doc.update(over)
    return doc


def test_demo_scenario_matches_the_demo_brief():
    s = load_scenario("loadtest/scenarios/demo.yaml")
    assert s.duration_s == 30 and s.load.mode is LoadMode.OPEN
    assert {t.api_key for t in s.tenants} == {"demo-key-alpha", "demo-key-beta"}
    rate = s.load.levels[0].from_value
    classify_rps = sum(c.share for c in s.classes if c.kind is RequestKind.CLASSIFY) * rate
    generate_rps = sum(c.share for c in s.classes if c.kind is RequestKind.GENERATE) * rate
    assert classify_rps == pytest.approx(20) and generate_rps == pytest.approx(2)
    assert s.models() == {"digits", "tinylm"}
    assert load_scenario("loadtest/scenarios/smoke.yaml").duration_s == 5


def test_plan_mixes_tenants_and_classes_by_share():
    s = parse_scenario(_doc(duration_s=100, seed=2,
                            tenants=[{"name": "a", "api_key": "ka", "share": 3}, {"name": "b", "api_key": "kb"}],
                            classes=[{"name": "c", "kind": "classify", "model": "digits", "share": 9},
                                     {"name": "g", "kind": "generate", "model": "tinylm", "output_len": 5}]))
    plan = list(open_loop_plan(s))
    assert len(plan) == pytest.approx(1000, rel=0.1)
    assert np.mean([p.tenant.name == "a" for p in plan]) == pytest.approx(0.75, abs=0.04)
    gens = [p for p in plan if p.request_class.name == "g"]
    assert len(gens) / len(plan) == pytest.approx(0.1, abs=0.03)
    assert all(p.payload.max_tokens == 5 and len(p.payload.prompt) == 16 for p in gens)  # default prompt_len 16
    assert [p.scheduled_s for p in plan] == [p.scheduled_s for p in open_loop_plan(s)]  # reproducible


def test_stages_and_warmup_build_the_schedule():
    s = parse_scenario(_doc(warmup_s=5, load={"stages": [{"duration_s": 10, "rate_rps": 5},
                                                         {"duration_s": 20, "from_rps": 5, "to_rps": 25}]}))
    assert s.duration_s == 30
    schedule = s.schedule()
    assert schedule.duration_s == 35
    assert schedule.value_at(2) == 5 and schedule.value_at(25) == pytest.approx(15)
    shorter = s.with_duration(15)
    assert [seg.duration_s for seg in shorter.load.levels] == [5, 10]


@pytest.mark.parametrize("over,message", [
    ({"load": {"rate_rps": 0}}, "load.rate_rps must be > 0"),
    ({"load": {"arrival": "bursty", "rate_rps": 1}}, "load.arrival must be one of constant, poisson, gamma"),
    ({"load": {"mode": "closed"}}, "needs 'concurrency'"),
    ({"load": {"rate_rps": 1, "rps": 2}}, "unknown key"),
    ({"tenants": [{"name": "a"}]}, r"tenants\[0\]: give exactly one of api_key, api_key_env, api_key_file"),
    ({"tenants": [{"name": "a", "api_key": "x"}, {"name": "a", "api_key": "y"}]}, "duplicate name"),
    ({"classes": [{"kind": "classify", "model": "m", "output_len": 4}]}, "generate classes only"),
    ({"classes": [{"kind": "generate", "model": "m", "slo": {"e2e_ms": -1}}]}, r"slo.e2e_ms must be > 0"),
    ({"classes": [{"kind": "classify", "model": "m", "image": {"channels": 2}}]}, "channels must be 1, 3 or 4"),
    ({"duration_s": 10, "load": {"stages": [{"duration_s": 5, "rate_rps": 1}]}}, "disagrees"),
])
def test_bad_scenarios_name_the_field(over, message):
    with pytest.raises(ValueError, match=message):
        parse_scenario(_doc(**over))


def test_length_distributions_stay_in_bounds():
    rng = np.random.default_rng(0)
    for raw in ({"dist": "uniform", "min": 3, "max": 9}, {"dist": "normal", "mean": 6, "std": 4, "min": 3, "max": 9},
                {"dist": "lognormal", "median": 6, "sigma": 1, "min": 3, "max": 9},
                {"dist": "choice", "values": [3, 9], "weights": [1, 3]}):
        draws = [parse_int_dist(raw, "x").sample(rng) for _ in range(500)]
        assert min(draws) >= 3 and max(draws) <= 9, raw
    with pytest.raises(ValueError, match="x.dist must be one of"):
        parse_int_dist({"dist": "zipf"}, "x")


def test_images_are_digit_like_and_encoded_as_asked():
    rng = np.random.default_rng(0)
    pixels = render_image(1, 32, 32, 3, rng)
    assert pixels.shape == (32, 32, 3) and pixels.dtype == np.uint8
    assert pixels[:, 12:20].mean() > pixels[:, :6].mean() + 40  # a "1" is bright in the middle, dark at the side
    spec = parse_scenario(_doc(classes=[{"kind": "classify", "model": "m", "image": {
        "height_px": {"dist": "uniform", "min": 20, "max": 40}, "width_px": 24, "encoding": "png",
        "num_variants": 5}}])).classes[0].image
    pool = make_image_pool(spec, rng)
    assert len(pool) == 5 and all(p.encoding is ImageEncoding.PNG for p in pool)
    decoded = Image.open(io.BytesIO(pool[0].data))
    assert decoded.size == (24, pool[0].height) and 20 <= pool[0].height <= 40
    assert len(make_prompt(37, rng)) == 37


# -- where a tenant's API key comes from -------------------------------------------------


def test_api_key_from_an_environment_variable():
    s = parse_scenario(_doc(tenants=[{"name": "a", "api_key_env": "LOADTEST_KEY_A"}]),
                       environ={"LOADTEST_KEY_A": "secret-a\n"})
    assert s.tenants[0].api_key == "secret-a"


def test_api_key_from_a_file_relative_to_the_scenario(tmp_path):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "alpha.key").write_text("secret-from-file\n")
    scenario = tmp_path / "s.yaml"
    scenario.write_text("load: {rate_rps: 1}\ntenants: [{name: a, api_key_file: keys/alpha.key}]\n"
                        "classes: [{kind: classify, model: digits}]\n")
    assert load_scenario(scenario).tenants[0].api_key == "secret-from-file"


@pytest.mark.parametrize(("tenant", "environ", "message"), [
    ({"name": "a"}, {}, "give exactly one of api_key, api_key_env, api_key_file (got none)"),
    ({"api_key": "k", "api_key_env": "X"}, {"X": "k"}, "give exactly one of"),
    ({"api_key_env": "MISSING"}, {}, "environment variable MISSING is not set or empty"),
    ({"api_key_env": "BLANK"}, {"BLANK": "  "}, "environment variable BLANK is not set or empty"),
    ({"api_key_file": "/nonexistent/key"}, {}, "api_key_file: cannot read /nonexistent/key"),
    ({"api_key": ""}, {}, "tenants[0].api_key must be a non-empty string"),
    ({"api_key": 12}, {}, "tenants[0].api_key must be a non-empty string"),
])
def test_bad_api_key_sources_name_the_field(tenant, environ, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_scenario(_doc(tenants=[tenant]), environ=environ)


def test_empty_key_file_is_refused(tmp_path):
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ValueError, match="empty.key is empty"):
        parse_scenario(_doc(tenants=[{"api_key_file": "empty.key"}]), base_dir=tmp_path)


def test_http_fields_of_a_generate_class_and_the_tokenizer_are_read_and_checked():
    from loadtest.scenario import TextApi

    gen = {"kind": "generate", "model": "m", "api": "chat", "stream": False}
    s = parse_scenario(_doc(classes=[gen], tokenizer="hf:/models/tok.json", target="openai+http://h:8000/v1"))
    assert s.classes[0].api is TextApi.CHAT and s.classes[0].stream is False and s.tokenizer == "hf:/models/tok.json"
    assert parse_scenario(_doc(classes=[{"kind": "generate", "model": "m"}])).classes[0].stream is True
    for bad, complaint in [({"classes": [{**gen, "api": "embeddings"}]}, "api must be one of"),
                           ({"classes": [{**gen, "stream": "yes"}]}, "stream must be true or false"),
                           ({"classes": [{"kind": "classify", "model": "m", "api": "chat"}]}, "generate classes only"),
                           ({"tokenizer": "words"}, "tokenizer must be"),
                           ({"target": "http://h:1"}, "unknown scheme")]:
        with pytest.raises(ValueError, match=complaint):
            parse_scenario(_doc(**bad))


def test_bursts_repeat_a_high_step_at_the_end_of_every_period():
    s = parse_scenario(_doc(duration_s=25, load={"rate_rps": 10,
                                                  "bursts": {"every_s": 10, "duration_s": 2, "rate_rps": 100}}))
    assert [(seg.duration_s, seg.from_value) for seg in s.load.levels] == [
        (8, 10), (2, 100), (8, 10), (2, 100), (5, 10)]
    assert s.duration_s == 25
    times = [p.scheduled_s for p in open_loop_plan(s)]
    in_burst = sum(8 <= t < 10 for t in times)
    assert in_burst > 5 * sum(6 <= t < 8 for t in times)  # 100/s against 10/s
    for bad, complaint in [({"every_s": 2, "duration_s": 2, "rate_rps": 5}, "shorter than every_s"),
                           ({"every_s": 2, "rate_rps": 5}, "bursts.duration_s must be a number")]:
        with pytest.raises(ValueError, match=complaint):
            parse_scenario(_doc(load={"rate_rps": 1, "bursts": bad}))
    with pytest.raises(ValueError, match="open-loop"):
        parse_scenario(_doc(load={"mode": "closed", "concurrency": 2, "bursts": {}}))
