"""The pure parts of bench_hf_llm --peer: both readings of "at equal p99" and the table (no timing)."""

from __future__ import annotations

from bench.worker.peer_report import LevelRun, peer_section, requests_per_client, table


def run(concurrency: int, tokens_per_s: float, *e2e_s: float) -> LevelRun:
    return LevelRun(concurrency, tokens_per_s, e2e_s, load_average_1m=1.0)


# A peer serving one request at a time: flat tokens/s, p99 growing with the queue.
PEER = {1: run(1, 27.0, 1.2, 1.2), 2: run(2, 27.0, 1.2, 2.4), 4: run(4, 27.0, 2.4, 4.8), 8: run(8, 27.0, 4.8, 9.6)}
MESH = {1: run(1, 30.0, 1.1, 1.1), 2: run(2, 50.0, 1.3, 1.3), 4: run(4, 90.0, 1.5, 1.5), 8: run(8, 140.0, 1.9, 1.9)}


def test_same_load_compares_each_level_where_the_mesh_p99_is_no_worse() -> None:
    section = peer_section(PEER, MESH)
    same = section["same_load"]
    assert same["ratio_by_concurrency"] == {"1": 30 / 27, "2": 50 / 27, "4": 90 / 27, "8": 140 / 27}
    assert (same["best_concurrency"], same["met"]) == (8, True)
    assert section["levels"]["8"]["mesh"]["e2e_p99_s"] == 1.9
    assert section["levels"]["8"]["peer"]["e2e_p99_s"] == 9.6


def test_strict_reading_keeps_the_mesh_within_the_peers_single_client_p99() -> None:
    strict = peer_section(PEER, MESH)["strict_within_single_client_p99"]
    assert (strict["mesh_best_concurrency"], strict["ratio"], strict["met"]) == (1, 30 / 27, False)


def test_a_level_where_the_mesh_is_slower_is_left_out_of_the_same_load_reading() -> None:
    slow = {**MESH, 8: run(8, 140.0, 12.0)}
    section = peer_section(PEER, slow)
    assert "8" not in section["same_load"]["ratio_by_concurrency"]
    assert section["levels"]["8"]["mesh_p99_within_peer_p99"] is False
    assert section["same_load"]["best_concurrency"] == 4


def test_no_level_within_gives_none_and_the_table_says_so() -> None:
    section = peer_section({1: run(1, 27.0, 1.0)}, {1: run(1, 30.0, 2.0)})
    assert section["same_load"]["best_ratio"] is None and section["same_load"]["met"] is False
    assert section["strict_within_single_client_p99"]["ratio"] is None
    text = table(section)
    assert "same load, mesh p99 <= peer p99: none of the levels" in text
    assert "strict, mesh within the peer's 1-client p99: none of the levels" in text


def test_table_has_a_row_per_level() -> None:
    text = table(peer_section(PEER, MESH))
    assert text.count("\n| ") == 1 + 4  # the separator row starts with "|-"; a header and four levels
    assert "best 5.19x at 8 clients" in text


def test_requests_per_client_caps_the_peers_level() -> None:
    assert [requests_per_client(c, 3) for c in (1, 2, 4, 8)] == [3, 2, 1, 1]
