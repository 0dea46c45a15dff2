"""bench/harness/tables.py: the Markdown tables every benchmark prints."""

from __future__ import annotations

import math

from bench.harness.tables import aligned_table, markdown_table


def test_markdown_table_formats_numbers_and_missing_values():
    table = markdown_table(["figure", "value"], [["a", 1234.4], ["b", 1.234], ["c", math.nan]])
    assert table.splitlines() == ["| figure | value |", "| --- | --- |", "| a | 1234 |", "| b | 1.23 |", "| c | - |"]


def test_aligned_table_pads_every_column_to_its_widest_cell():
    table = aligned_table(("figure", "x"), [("a", "1234"), ("long name", "1")])
    assert table.splitlines() == ["| figure    | x    |", "|-----------|------|",
                                  "| a         | 1234 |", "| long name | 1    |"]
