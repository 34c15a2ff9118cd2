"""Wall-clock time covered by a set of intervals, counted once where they overlap.

Used for wait attribution: a rank waiting for eight tensors at once waited once, not eight
times. Intervals must arrive with non-decreasing ends (true for negotiations, which end when
their last request arrives), so merging only ever touches the newest intervals.

Must not touch: any layer above it.
"""

from __future__ import annotations


class Coverage:
    __slots__ = ("spans", "total")

    def __init__(self) -> None:
        self.spans: list[list[float]] = []  # disjoint, sorted
        self.total = 0.0

    def add(self, start: float, end: float) -> float:
        """Add [start, end]; returns how much the covered time grew."""
        if end <= start:
            return 0.0
        before = self.total
        spans = self.spans
        while spans and spans[-1][1] >= start:
            s, e = spans.pop()
            self.total -= e - s
            start = min(start, s)
            end = max(end, e)
        spans.append([start, end])
        self.total += end - start
        return self.total - before
