"""Per-tensor and per-rank totals of a timeline file, as text and as a PNG plot.

Per tensor: how many times it ran, time spent negotiating (from the first rank's request to the
last rank's), time in the operation and in each activity inside it (fusion copies, the transfer).
Per rank: how long it waited in negotiation for the slowest rank, how much waiting it caused
the others (when it was the last to submit), and how often it was the last.

Must not touch: the runtime; the timeline file (read only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from horovod.common.intervals import Coverage


@dataclass
class TensorTotals:
    name: str
    ops: int = 0
    negotiate_s: float = 0.0
    op_s: float = 0.0
    activities: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def total_s(self) -> float:
        return self.negotiate_s + self.op_s


@dataclass
class RankTotals:
    rank: int
    waited_s: float = 0.0
    caused_s: float = 0.0
    last: int = 0


@dataclass
class Summary:
    path: str
    duration_s: float
    tensors: list[TensorTotals]
    ranks: list[RankTotals]
    negotiations: int

    def text(self, top: int = 20) -> str:
        lines = [
            f"Timeline {self.path}: {self.duration_s:.3f} s, {len(self.tensors)} tensors, "
            f"{self.negotiations} negotiations, {len(self.ranks)} ranks",
            "",
            "Per tensor (by total time; times in seconds):",
        ]
        width = max([len("tensor")] + [len(t.name) for t in self.tensors[:top]])
        lines.append(
            f"  {'tensor':<{width}}  {'ops':>6}  {'negotiate':>10}  {'op':>10}  main activity"
        )
        for t in self.tensors[:top]:
            act = max(t.activities.items(), key=lambda kv: kv[1], default=None)
            act_text = f"{act[0]} {act[1]:.4f}" if act else "-"
            lines.append(
                f"  {t.name:<{width}}  {t.ops:>6}  {t.negotiate_s:>10.4f}  {t.op_s:>10.4f}  "
                f"{act_text}"
            )
        if len(self.tensors) > top:
            lines.append(f"  ... {len(self.tensors) - top} more tensors")
        lines += ["", "Per rank (negotiation; seconds):"]
        lines.append(
            f"  {'rank':>4}  {'waited for others':>17}  {'kept others waiting':>19}  last to submit"
        )
        for r in self.ranks:
            share = f"{r.last} of {self.negotiations}" if self.negotiations else "-"
            lines.append(f"  {r.rank:>4}  {r.waited_s:>17.4f}  {r.caused_s:>19.4f}  {share}")
        if self.ranks and self.negotiations:
            worst = max(self.ranks, key=lambda r: r.caused_s)
            if worst.caused_s > 0:
                lines += [
                    "",
                    f"Rank {worst.rank} was the slowest: it was the last to submit "
                    f"{worst.last} of {self.negotiations} collectives and kept the others "
                    f"waiting {worst.caused_s:.4f} s in total.",
                ]
        return "\n".join(lines)


def load(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        # raw_decode: a file still being written may have grown past its "]" while we read
        events, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a timeline (invalid JSON: {e})") from None
    if not isinstance(events, list):
        raise ValueError(f"{path} is not a timeline: expected a JSON array of trace events")
    return events


def summarize(events: list[dict[str, Any]], path: str = "") -> Summary:
    names: dict[int, str] = {}
    per_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    t_min, t_max = None, None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        pid = ev.get("pid", 0)
        if ev.get("ph") == "M":
            if ev.get("name") == "process_name" and "name" in ev.get("args", {}):
                names[pid] = ev["args"]["name"]
            continue
        ts = ev.get("ts")
        if isinstance(ts, (int, float)):
            t_min = ts if t_min is None else min(t_min, ts)
            t_max = ts if t_max is None else max(t_max, ts)
        if pid:
            per_pid[pid].append(ev)
    tensors: dict[str, TensorTotals] = {}
    ranks: dict[int, RankTotals] = {}
    negotiations: list[dict[int, float]] = []
    for pid, evs in per_pid.items():
        tot = tensors.setdefault(names.get(pid, f"pid {pid}"), TensorTotals(names.get(pid, "")))
        if not tot.name:
            tot.name = f"pid {pid}"
        stack: list[tuple[str, float]] = []
        ticks: dict[int, float] = {}
        for ev in sorted(evs, key=lambda e: e.get("ts", 0)):  # stable: same-ts order kept
            ph, ts = ev.get("ph"), float(ev.get("ts", 0))
            if ph == "B":
                stack.append((str(ev.get("name", "")), ts))
                if len(stack) == 1 and stack[0][0].startswith("NEGOTIATE_"):
                    ticks = {}
            elif ph == "X" and stack and stack[-1][0].startswith("NEGOTIATE_"):
                try:
                    ticks[int(ev.get("name", ""))] = ts
                except ValueError:
                    pass
            elif ph == "E" and stack:
                name, start = stack.pop()
                dur = (ts - start) / 1e6
                if stack:
                    tot.activities[name] += dur
                elif name.startswith("NEGOTIATE_"):
                    tot.negotiate_s += dur
                    if len(ticks) >= 2:
                        negotiations.append(ticks)
                else:
                    tot.op_s += dur
                    tot.ops += 1
    # Waiting is wall-clock time per rank (waits for several tensors at once count once),
    # each new second of it charged to the rank that was last; as the runtime's WaitStats.
    cover: dict[int, Coverage] = defaultdict(Coverage)
    for ticks in sorted(negotiations, key=lambda t: max(t.values())):
        last_rank = max(ticks, key=lambda r: ticks[r])
        t_last = ticks[last_rank] / 1e6
        ranks.setdefault(last_rank, RankTotals(last_rank)).last += 1
        for r, t in ticks.items():
            ranks.setdefault(r, RankTotals(r))
            if r != last_rank:
                ranks[last_rank].caused_s += cover[r].add(t / 1e6, t_last)
    for r, c in cover.items():
        ranks[r].waited_s = c.total
    ordered = sorted(tensors.values(), key=lambda t: -t.total_s)
    duration = ((t_max or 0) - (t_min or 0)) / 1e6
    return Summary(path, duration, ordered, [ranks[r] for r in sorted(ranks)], len(negotiations))


def plot(summary: Summary, out: str, top: int = 15) -> None:
    """Two panels: time per tensor split into negotiation and activities; per-rank waiting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensors = summary.tensors[:top][::-1]
    acts = sorted({a for t in tensors for a in t.activities})
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(10, 3 + 0.35 * len(tensors) + 2.5), gridspec_kw={"height_ratios": [3, 1]}
    )
    left = [0.0] * len(tensors)
    labels = [t.name if len(t.name) <= 40 else t.name[:37] + "..." for t in tensors]
    parts = [("negotiation (waiting for ranks)", [t.negotiate_s for t in tensors])]
    for a in acts:
        parts.append((a, [t.activities.get(a, 0.0) for t in tensors]))
    parts.append(
        ("op, outside activities", [max(0.0, t.op_s - sum(t.activities.values())) for t in tensors])
    )
    for label, vals in parts:
        if any(vals):
            ax1.barh(labels, vals, left=left, label=label)
            left = [x + v for x, v in zip(left, vals, strict=True)]
    ax1.set_xlabel("seconds")
    ax1.set_title(f"Where the time went per tensor (top {len(tensors)})")
    ax1.legend(fontsize=8, loc="lower right")
    ranks = [f"rank {r.rank}" for r in summary.ranks]
    x = range(len(ranks))
    ax2.bar([i - 0.2 for i in x], [r.waited_s for r in summary.ranks], 0.4, label="waited")
    ax2.bar(
        [i + 0.2 for i in x], [r.caused_s for r in summary.ranks], 0.4, label="kept others waiting"
    )
    ax2.set_xticks(list(x), ranks)
    ax2.set_ylabel("seconds")
    ax2.set_title("Negotiation: waiting for the slowest rank")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def for_speedscope(
    events: list[dict[str, Any]], tensor: str | None = None, first: int = 0, count: int = 0
) -> list[dict[str, Any]]:
    """The trace in the form speedscope (and other flame-graph viewers) import: every record
    gets a ``tid`` and every ``E`` the name of the span it ends; readiness ticks are left out.
    Optionally only one tensor's row, and only its operations ``first`` .. ``first+count-1``."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    keep = {p for p, n in names.items() if tensor is None or n == tensor}
    if tensor is not None and not keep:
        raise ValueError(f"no tensor named {tensor!r} in the timeline")
    out: list[dict[str, Any]] = []
    stacks: dict[int, list[str]] = defaultdict(list)
    seen: dict[int, int] = defaultdict(int)
    for e in events:
        pid = e.get("pid", 0)
        if e.get("ph") == "M":
            if pid == 0 or pid in keep:
                out.append(e)
            continue
        if pid not in keep or e.get("ph") not in ("B", "E"):
            continue
        stack = stacks[pid]
        if e["ph"] == "B":
            if not stack:
                seen[pid] += 1
            stack.append(str(e.get("name", "")))
            rec = dict(e)
        else:
            if not stack:
                continue
            rec = dict(e, name=stack.pop())
        n = seen[pid] - 1  # index of the top-level span this record belongs to
        if count and not first <= n < first + count:
            continue
        rec["tid"] = 0
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m horovod.timeline",
        description="Summarize a Horovod timeline: per-tensor and per-rank totals, and a plot.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="print totals and write a PNG plot")
    s.add_argument("file", help="timeline JSON written with HOROVOD_TIMELINE / --timeline-filename")
    s.add_argument("--plot", help="PNG to write (default: <file without .json>.summary.png)")
    s.add_argument("--no-plot", action="store_true", help="only print the totals")
    s.add_argument("--top", type=int, default=20, help="tensors to list (default 20)")
    v = sub.add_parser("speedscope", help="write a copy that speedscope can open")
    v.add_argument("file")
    v.add_argument("out")
    v.add_argument("--tensor", help="only this tensor's row (e.g. allreduce.fc1.weight)")
    v.add_argument("--first", type=int, default=0, help="first top-level span to keep")
    v.add_argument("--count", type=int, default=0, help="how many top-level spans (0: all)")
    a = p.parse_args(argv)
    if a.command == "speedscope":
        try:
            events = for_speedscope(load(a.file), a.tensor, a.first, a.count)
            with open(a.out, "w", encoding="utf-8") as f:
                json.dump(events, f)
        except (OSError, ValueError) as e:
            print(f"python -m horovod.timeline: {e}", file=sys.stderr)
            return 2
        print(f"{len(events)} records written to {a.out}; open it at https://www.speedscope.app")
        return 0
    try:
        summary = summarize(load(a.file), a.file)
    except (OSError, ValueError) as e:
        print(f"python -m horovod.timeline: {e}", file=sys.stderr)
        return 2
    print(summary.text(a.top))
    if a.no_plot:
        return 0
    out = a.plot or os.path.splitext(a.file)[0] + ".summary.png"
    try:
        plot(summary, out)
    except ImportError:
        print(
            "python -m horovod.timeline: the plot needs matplotlib "
            "(pip install 'pyhorovod[timeline]'); totals printed above",
            file=sys.stderr,
        )
        return 0 if a.plot is None else 2
    print(f"\nPlot written to {out}")
    return 0
