"""Terminal summary and Markdown report, both from a report document."""

from __future__ import annotations

from loadtest.tables import report_tables, summary_lines


def terminal_summary(doc: dict) -> str:
    parts = ["\n".join(summary_lines(doc))]
    parts += [t.to_text() for t in report_tables(doc, with_windows=False)]
    return "\n\n".join(parts) + "\n"


def markdown_report(doc: dict) -> str:
    lines = summary_lines(doc)
    parts = [f"# Load test: {doc['meta']['name']}", "", *(f"- {line}" for line in lines[1:]),
             f"- report schema `{doc['schema']}`, started {doc['meta']['started_at']}"]
    parts += ["", *[t.to_markdown() + "\n" for t in report_tables(doc, with_windows=True)]]
    return "\n".join(parts)
