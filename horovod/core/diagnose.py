"""What the engine needs to explain a slow or stuck job: Python stacks of a rank (gathered over
the control channel by the hang doctor), the innermost frame of user code in them, and wait
attribution (how long ranks waited in negotiation for the slowest rank, and which rank that was).

Must not touch: the engine's state (it reads stacks and timings it is given).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections.abc import Iterable, Sequence
from types import FrameType

from horovod.common.intervals import Coverage

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBS = tuple(
    {os.path.abspath(p) for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))}
)

# (file, line, function, source text), outermost first
Frame = tuple[str, int, str, str]
# (thread name, is the thread that called hvd.init(), frames)
ThreadStack = tuple[str, bool, list[Frame]]

MAX_FRAMES = 40
MAX_THREADS = 8


def capture_stacks(main_ident: int | None, other_threads: bool = True) -> list[ThreadStack]:
    """The Python stacks of this process: the thread that called ``hvd.init()`` first, then
    (``other_threads``) the application's other threads. Horovod's own threads and the calling
    thread are left out. Plain tuples, so they can travel in a control message."""
    import linecache

    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out: list[ThreadStack] = []
    for ident, top in frames.items():
        is_main = ident == main_ident
        name = names.get(ident, f"thread {ident}")
        if not is_main and (
            not other_threads or ident == me or name.startswith(("horovod-", "fwd-", "wait-"))
        ):
            continue
        stack: list[Frame] = []
        f: FrameType | None = top
        while f is not None and len(stack) < MAX_FRAMES:
            code = f.f_code
            line = linecache.getline(code.co_filename, f.f_lineno).strip()
            stack.append((code.co_filename, f.f_lineno, code.co_name, line))
            f = f.f_back
        stack.reverse()
        out.append((name, is_main, stack))
    out.sort(key=lambda s: not s[1])
    return out[:MAX_THREADS]


def is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if filename.startswith("<") or path.startswith(_PKG + os.sep):
        return False
    if any(path.startswith(lib + os.sep) for lib in _LIBS):
        return False
    parts = path.split(os.sep)
    return "site-packages" not in parts and "dist-packages" not in parts


def where(frames: Sequence[Frame]) -> str:
    """``train.py:88 in load_batch``: the innermost frame of the application's own code (not
    Horovod, not the standard library, not an installed package), else the innermost frame."""
    if not frames:
        return "an unknown place (no Python frames)"
    pick = next((f for f in reversed(frames) if is_user_file(f[0])), frames[-1])
    return f"{os.path.basename(pick[0])}:{pick[1]} in {pick[2]}"


def main_stack(stacks: Sequence[ThreadStack]) -> list[Frame]:
    for _name, is_main, frames in stacks:
        if is_main:
            return frames
    return stacks[0][2] if stacks else []


def format_stacks(stacks: Sequence[ThreadStack], indent: str = "      ", depth: int = 10) -> str:
    """Traceback-style text, innermost ``depth`` frames of each thread."""
    lines: list[str] = []
    for name, is_main, frames in stacks:
        label = "thread that called hvd.init()" if is_main else f"thread {name!r}"
        lines.append(f"{indent}{label}, most recent call last:")
        shown = frames[-depth:]
        if len(frames) > len(shown):
            lines.append(f"{indent}  ... {len(frames) - len(shown)} outer frames ...")
        for file, line, func, text in shown:
            lines.append(f'{indent}  File "{file}", line {line}, in {func}')
            if text:
                lines.append(f"{indent}    {text}")
    return "\n".join(lines)


class WaitStats:
    """Wait attribution over a window: for every negotiated collective, each rank waited from
    its own request to the last rank's request; the last rank is the one everybody waited for.
    A rank's waiting is wall-clock time (overlapping waits for several tensors count once), and
    each new second of it is charged to the rank that was last."""

    def __init__(self, size: int, start: float) -> None:
        self.size = size
        self.reset(start)

    def reset(self, start: float) -> None:
        self.start = start
        self.count = 0
        self.cover = [Coverage() for _ in range(self.size)]
        self.caused = [0.0] * self.size  # seconds of others' waiting each rank caused
        self.last = [0] * self.size  # how often each rank was the last to submit

    @property
    def waited(self) -> list[float]:
        """Seconds each rank spent waiting for slower ranks."""
        return [c.total for c in self.cover]

    def record(self, arrivals: Iterable[tuple[int, float]]) -> tuple[int, float] | None:
        """Add one collective; returns (slowest rank, longest wait) or None for a lone rank."""
        items = list(arrivals)
        if len(items) < 2:
            return None
        last_rank, t_last = items[0]
        for r, t in items:
            if t > t_last:
                last_rank, t_last = r, t
        longest = 0.0
        cover = self.cover
        for r, t in items:
            if r != last_rank and t < t_last:
                self.caused[last_rank] += cover[r].add(t, t_last)
                if t_last - t > longest:
                    longest = t_last - t
        self.last[last_rank] += 1
        self.count += 1
        return last_rank, longest

    def summary(self, now: float) -> str | None:
        if self.count == 0:
            return None
        span = now - self.start
        worst = max(range(self.size), key=lambda r: self.caused[r])
        share = 100.0 * self.last[worst] / self.count
        per_rank = ", ".join(f"rank {r} {w:.3f} s" for r, w in enumerate(self.waited))
        return (
            f"Wait attribution over the last {span:.1f} s ({self.count} collectives): rank "
            f"{worst} was the last to submit {self.last[worst]} of them ({share:.0f}%) and kept "
            f"the other ranks waiting {self.caused[worst]:.3f} s in total. Time each rank "
            f"waited for slower ranks: {per_rank}."
        )
