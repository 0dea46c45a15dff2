"""The platform a model build records (tools/build_platform.py): what its bits depend on."""

from __future__ import annotations

from tools.build_platform import PLATFORM_KEYS, UNKNOWN, cpu_model, mkl_env, onednn_isa, platform_differences

ELSEWHERE = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "aten_cpu_capability": "AVX512",
             "onednn_isa": "Intel AVX-512 with Intel AMX", "cpu": "GenuineIntel family 6 model 167: Xeon",
             "mkl_env": "unset"}

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f amx_tile

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
"""


def test_the_cpu_is_named_by_vendor_family_model_and_name_of_the_first_processor():
    assert cpu_model(CPUINFO) == "GenuineIntel family 6 model 167: Intel(R) Xeon(R) Processor"


def test_a_cpu_without_cpuinfo_is_unknown():
    assert cpu_model("") == UNKNOWN
    assert cpu_model("processor : 0\nfeatures : fp asimd\n") == UNKNOWN


def test_the_same_platform_has_no_differences_and_any_changed_key_is_named():
    assert platform_differences(ELSEWHERE, dict(ELSEWHERE)) == []
    for key in PLATFORM_KEYS:
        changed = {**ELSEWHERE, key: "something else"}
        (reason,) = platform_differences(ELSEWHERE, changed)
        assert reason.startswith(key) and "something else" in reason


def test_a_platform_not_recorded_or_unknown_never_promises_equal_bits():
    assert len(platform_differences({}, ELSEWHERE)) == len(PLATFORM_KEYS)
    unknown_isa = {**ELSEWHERE, "onednn_isa": UNKNOWN}
    assert platform_differences(unknown_isa, unknown_isa) == [
        "onednn_isa not recorded (shipped 'unknown', rebuilt 'unknown')"]


def test_onednn_names_an_isa_here():
    isa = onednn_isa()
    assert isa and isa != UNKNOWN
    assert onednn_isa() == isa  # cached: oneDNN writes its header once a process


def test_mkl_dispatch_settings_are_part_of_the_platform():
    assert mkl_env({"PATH": "/bin"}) == "unset"
    assert mkl_env({"MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "COMPATIBLE"}) == (
        "MKL_CBWR=COMPATIBLE;MKL_ENABLE_INSTRUCTIONS=AVX2")
