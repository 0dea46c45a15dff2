"""The worker's thread count follows its CPU allocation: sample cgroup v1/v2 files in tmp_path."""

from __future__ import annotations

import logging

import pytest

from services.worker.cpu_allocation import (
    CgroupFiles,
    ThreadSource,
    cgroup_cpu_quota,
    cgroup_levels,
    decide_num_threads,
)
from services.worker.thread_settings import THREAD_ENV_VARS, export_thread_env


@pytest.fixture
def files(tmp_path) -> CgroupFiles:
    (tmp_path / "cpu").mkdir()
    return CgroupFiles(cpu_max=tmp_path / "cpu.max", cfs_quota_us=tmp_path / "cpu" / "cpu.cfs_quota_us",
                       cfs_period_us=tmp_path / "cpu" / "cpu.cfs_period_us")


def write_v1(files: CgroupFiles, quota: str, period: str = "100000\n") -> None:
    files.cfs_quota_us.write_text(quota)
    files.cfs_period_us.write_text(period)


def decide(files: CgroupFiles, requested: int = 0, cpus: int = 16, environ: dict | None = None):
    return decide_num_threads(requested, cpus, environ or {}, (files,))


def test_cgroup_v2_quota_rounds_up_to_whole_threads(files):
    files.cpu_max.write_text("150000 100000\n")  # 1.5 CPUs, e.g. a Kubernetes limit of 1500m
    decision = decide(files)
    assert (decision.num_threads, decision.source) == (2, ThreadSource.CGROUP)
    assert "1.5 CPUs" in decision.detail and str(files.cpu_max) in decision.detail


def test_cgroup_v2_quota_below_one_cpu_still_gets_one_thread(files):
    files.cpu_max.write_text("20000 100000\n")
    assert decide(files).num_threads == 1


def test_cgroup_quota_never_exceeds_the_cpus_in_affinity(files):
    files.cpu_max.write_text("800000 100000\n")  # 8 CPUs of quota, but only 2 CPUs to run on
    assert decide(files, cpus=2).num_threads == 2


def test_cgroup_v2_max_means_no_quota_and_falls_back_to_affinity(files):
    files.cpu_max.write_text("max 100000\n")
    write_v1(files, "50000\n")  # v2 said "no quota": a stale v1 file is not consulted
    decision = decide(files, cpus=6)
    assert (decision.num_threads, decision.source) == (6, ThreadSource.AFFINITY)


def test_cgroup_v1_quota_when_there_is_no_v2_file(files):
    write_v1(files, "300000\n", "100000\n")
    decision = decide(files)
    assert (decision.num_threads, decision.source) == (3, ThreadSource.CGROUP)
    assert "cpu.cfs_quota_us" in decision.detail


def test_cgroup_v1_quota_of_minus_one_is_unlimited(files):
    write_v1(files, "-1\n")
    assert decide(files, cpus=4).source == ThreadSource.AFFINITY


def test_missing_files_fall_back_to_affinity_without_a_warning(files, caplog):
    with caplog.at_level(logging.WARNING):
        decision = decide(files, cpus=5)
    assert (decision.num_threads, decision.source) == (5, ThreadSource.AFFINITY)
    assert caplog.records == []


@pytest.mark.parametrize("content", ["", "garbage", "100000", "max", "max lots", "0 100000", "-5 100000",
                                     "150000 0", "1.5 100000", "1 2 3"])
def test_garbage_cpu_max_is_logged_and_skipped(files, caplog, content):
    files.cpu_max.write_text(content)
    with caplog.at_level(logging.WARNING):
        decision = decide(files, cpus=3)
    assert (decision.num_threads, decision.source) == (3, ThreadSource.AFFINITY)
    assert f"ignoring {files.cpu_max}" in caplog.text and repr(content) in caplog.text


def test_garbage_v2_file_falls_back_to_a_valid_v1_quota(files, caplog):
    files.cpu_max.write_text("nonsense\n")
    write_v1(files, "200000\n")
    with caplog.at_level(logging.WARNING):
        assert decide(files).num_threads == 2
    assert "ignoring" in caplog.text


@pytest.mark.parametrize(("quota", "period"), [("abc", "100000"), ("0", "100000"), ("100000", "0"),
                                               ("100000", "x")])
def test_garbage_v1_files_are_logged_and_skipped(files, caplog, quota, period):
    write_v1(files, quota, period)
    with caplog.at_level(logging.WARNING):
        assert decide(files, cpus=7).source == ThreadSource.AFFINITY
    assert "ignoring" in caplog.text and "cpu.cfs_quota_us" in caplog.text


def test_v1_with_only_a_quota_file_is_no_quota(files):
    files.cfs_quota_us.write_text("200000\n")
    assert cgroup_cpu_quota(files) is None


def test_an_explicit_count_wins_over_quota_and_environment(files):
    files.cpu_max.write_text("100000 100000\n")
    decision = decide(files, requested=4, cpus=2, environ={"OMP_NUM_THREADS": "1"})
    assert (decision.num_threads, decision.source) == (4, ThreadSource.FLAG)


def test_an_operators_omp_num_threads_wins_over_the_quota(files):
    files.cpu_max.write_text("400000 100000\n")
    decision = decide(files, environ={"OMP_NUM_THREADS": "1"})
    assert (decision.num_threads, decision.source) == (1, ThreadSource.OMP_ENV)
    assert decide(files, environ={"OMP_NUM_THREADS": "3,1"}).num_threads == 3  # nested: the outer level


def test_malformed_omp_num_threads_is_logged_and_ignored(files, caplog):
    files.cpu_max.write_text("200000 100000\n")
    with caplog.at_level(logging.WARNING):
        decision = decide(files, environ={"OMP_NUM_THREADS": "many"})
    assert decision.source == ThreadSource.CGROUP
    assert "ignoring OMP_NUM_THREADS='many'" in caplog.text


def test_unreadable_file_counts_as_missing(files):
    def read(path):
        return None if path == files.cpu_max else path.read_text()

    write_v1(files, "100000\n")
    assert decide_num_threads(0, 8, {}, (files,), read).num_threads == 1


@pytest.mark.parametrize(("requested", "cpus", "message"), [(-1, 4, "requested threads must be >= 0"),
                                                            (0, 0, "num_affinity_cpus must be >= 1")])
def test_rejects_impossible_inputs(files, requested, cpus, message):
    with pytest.raises(ValueError, match=message):
        decide(files, requested=requested, cpus=cpus)


def test_export_sets_every_pool_variable_for_later_imports_and_children():
    environ = {"OMP_NUM_THREADS": "16"}
    export_thread_env(2, environ)
    assert environ == {name: "2" for name in THREAD_ENV_VARS}


def test_levels_in_a_container_namespace_are_the_mount_root(tmp_path):
    (level,) = cgroup_levels("0::/\n", tmp_path)
    assert level == CgroupFiles(tmp_path / "cpu.max", tmp_path / "cpu" / "cpu.cfs_quota_us",
                                tmp_path / "cpu" / "cpu.cfs_period_us")
    assert cgroup_levels(None, tmp_path) == cgroup_levels("garbage", tmp_path) == (level,)


def test_levels_walk_from_a_nested_v2_cgroup_up_to_the_root(tmp_path):
    levels = cgroup_levels("0::/system.slice/worker.service\n", tmp_path)
    assert [lv.cpu_max for lv in levels] == [tmp_path / "system.slice/worker.service/cpu.max",
                                             tmp_path / "system.slice/cpu.max", tmp_path / "cpu.max"]


def test_levels_follow_the_v1_cpu_controllers_path(tmp_path):
    text = "12:memory:/pod/x\n4:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n"
    levels = cgroup_levels(text, tmp_path)
    assert [lv.cfs_quota_us for lv in levels] == [
        tmp_path / "cpu/kubepods/pod1/c1/cpu.cfs_quota_us", tmp_path / "cpu/kubepods/pod1/cpu.cfs_quota_us",
        tmp_path / "cpu/kubepods/cpu.cfs_quota_us", tmp_path / "cpu/cpu.cfs_quota_us"]


def test_a_path_outside_the_namespace_root_falls_back_to_the_root(tmp_path):
    assert len(cgroup_levels("0::/../../other\n", tmp_path)) == 1


def test_the_smallest_quota_on_any_level_counts(tmp_path):
    leaf = tmp_path / "slice" / "svc"
    leaf.mkdir(parents=True)
    (leaf / "cpu.max").write_text("max 100000\n")  # the service itself is unlimited...
    (tmp_path / "slice" / "cpu.max").write_text("150000 100000\n")  # ...but its slice has 1.5 CPUs
    (tmp_path / "cpu.max").write_text("400000 100000\n")
    decision = decide_num_threads(0, 8, {}, cgroup_levels("0::/slice/svc", tmp_path))
    assert (decision.num_threads, decision.source) == (2, ThreadSource.CGROUP)
    assert str(tmp_path / "slice" / "cpu.max") in decision.detail
