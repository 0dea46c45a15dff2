"""Status replies as aligned text tables or as JSON: pure functions of StatusReports (no grpc)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.admin import Cell, Section, StatusReport


@dataclass(frozen=True)
class Answer:
    """One target's reply: a report, or the error that came instead."""

    target: str  # the address asked
    report: StatusReport | None = None
    error_code: str = ""  # gRPC status name, e.g. PERMISSION_DENIED
    error_message: str = ""


def format_cell(cell: Cell) -> str:
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if isinstance(cell, float):
        return f"{cell:g}"
    return str(cell) if cell != "" else "-"


def format_uptime(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def table(columns: Sequence[str], rows: Sequence[Sequence[Cell]], indent: str = "  ") -> list[str]:
    """Aligned columns, numbers right-aligned, a header underlined by dashes."""
    texts = [[format_cell(c) for c in row] for row in rows]
    widths = [max([len(col)] + [len(row[i]) for row in texts]) for i, col in enumerate(columns)]
    numeric = [bool(rows) and all(isinstance(row[i], int | float) and not isinstance(row[i], bool) for row in rows)
               for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    return [line(columns), line(["-" * w for w in widths]), *(line(row) for row in texts)]


def _section(section: Section) -> list[str]:
    title = section.name.replace("_", " ")
    if not section.rows:
        return [f"  {title}: none"]
    return [f"  {title}:", *table(section.columns, section.rows, indent="    ")]


def render_text(answers: Sequence[Answer]) -> str:
    blocks = []
    for answer in answers:
        report = answer.report
        if report is None:
            blocks.append(f"{answer.target}  ERROR {answer.error_code}: {answer.error_message}")
            continue
        lines = [f"{report.service} {answer.target}  version {report.version}  up {format_uptime(report.uptime_s)}"]
        width = max((len(key) for key, _ in report.facts), default=0)
        lines += [f"  {key.ljust(width)}  {format_cell(value)}" for key, value in report.facts]
        for section in report.sections:
            lines += _section(section)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def to_json_obj(answers: Sequence[Answer]) -> dict:
    services = []
    for answer in answers:
        if answer.report is None:
            services.append({"target": answer.target, "error": {"code": answer.error_code,
                                                                "message": answer.error_message}})
        else:
            services.append({"target": answer.target, **answer.report.to_dict()})
    return {"services": services}


def render_json(answers: Sequence[Answer]) -> str:
    return json.dumps(to_json_obj(answers), indent=2, sort_keys=False)
