"""Output of the `kvstore` command: aligned tables for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(nbytes: float) -> str:
    for unit in _UNITS:
        if abs(nbytes) < 1024 or unit == _UNITS[-1]:
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def emit(text: str) -> None:
    sys.stdout.write(text + "\n")


def emit_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
