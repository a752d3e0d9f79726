"""Shared benchmark plumbing: timing with medians, result tables, JSON output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


def median_time(fn: Callable[[], object], repeats: int = 5, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (``setup`` runs untimed before each)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Row:
    name: str
    value: float
    unit: str
    baseline: str = ""
    ratio: float | None = None
    note: str = ""


@dataclass
class Report:
    title: str
    rows: list[Row] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def add(self, name: str, value: float, unit: str, baseline: Row | None = None,
            higher_is_better: bool = True, note: str = "") -> Row:
        ratio = None
        if baseline is not None and baseline.value:
            ratio = value / baseline.value if higher_is_better else baseline.value / value
        row = Row(name, value, unit, baseline.name if baseline else "", ratio, note)
        self.rows.append(row)
        return row

    def table(self) -> str:
        head = ("measurement", "value", "unit", "ratio", "vs", "note")
        body = [(r.name, f"{r.value:.3g}", r.unit, "" if r.ratio is None else f"{r.ratio:.2f}x", r.baseline, r.note)
                for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [self.title, fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in body]
        return "\n".join(lines)

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"title": self.title, "meta": self.meta, "rows": [asdict(r) for r in self.rows]}, f, indent=2)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
