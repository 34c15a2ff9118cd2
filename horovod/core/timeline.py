"""The Timeline: a Chrome-trace (``chrome://tracing``, Perfetto) record of every collective,
written by global rank 0 in upstream Horovod's format.

* The file is a JSON array that is valid after every write: records are appended in batches by
  a writer thread, each batch overwriting the closing ``]`` and ending with a new one, so the
  file can be opened (or ``json.load``-ed) while training is still running.
* Each tensor is drawn as its own row ("process" ``pid`` 1, 2, ... in order of first
  appearance). Per tensor: ``NEGOTIATE_<OP>`` from the first rank's request to the last, with
  one instant tick per rank (named by the rank) as its request arrives; then the op span
  (``ALLREDUCE``, ...), containing activity spans (``MEMCPY_IN_FUSION_BUFFER``,
  ``TCP_ALLREDUCE``, ...); the op span ends with the tensor's dtype and shape.
* Row 0 carries ``CYCLE_START`` markers (``mark_cycles``: one per coordinator round) and the
  wait-attribution counters (how long ranks waited for the slowest one, see ``WaitStats``).

Every method is called from the engine thread of rank 0 only; the caller thread never blocks on
disk.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from typing import IO, Any

_STOP = object()


class TimelineWriter:
    """Appends records to the file from a background thread; the file stays valid JSON."""

    def __init__(self, path: str, start_wall_us: int) -> None:
        self.path = path
        # Opened here, in the caller's thread, so a bad path fails loudly at once.
        self._f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed by the writer thread
        head = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": 0,
                "args": {"start_time_since_epoch_in_micros": start_wall_us},
            },
            {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
        ]
        first = b"[\n" + b",\n".join(_dump(r) for r in head)
        self._f.write(first + b"\n]\n")
        self._f.flush()
        self._end = len(first)  # offset of the closing "\n]\n"
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.records_written = 0
        self._thread = threading.Thread(target=self._run, name="horovod-timeline", daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        self._q.put(record)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then close the file (blocks until done)."""
        self._q.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            stop = False
            while not stop:
                batch = [self._q.get()]
                while True:
                    try:
                        batch.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                if batch[-1] is _STOP or any(r is _STOP for r in batch):
                    stop = True
                    batch = [r for r in batch if r is not _STOP]
                if batch:
                    body = b"".join(b",\n" + _dump(r) for r in batch)
                    self._f.seek(self._end)
                    self._f.write(body + b"\n]\n")
                    self._f.flush()
                    self._end += len(body)
                    self.records_written += len(batch)
        finally:
            self._f.close()


def _dump(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


class Timeline:
    """The semantic events of upstream's timeline, turned into trace records."""

    def __init__(
        self,
        path: str,
        mark_cycles: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.t0 = clock()
        self.mark_cycles = mark_cycles
        self.writer = TimelineWriter(path, int(wall() * 1e6))
        self.path = path
        self._pids: dict[str, int] = {}
        self._state: dict[str, str] = {}  # row -> "negotiating" | "op" | "activity"
        self.closed = False

    # ----------------------------------------------------------------- plumbing
    def _ts(self, t: float | None = None) -> int:
        return int(((self.clock() if t is None else t) - self.t0) * 1e6)

    def _pid(self, row: str) -> int:
        pid = self._pids.get(row)
        if pid is None:
            pid = self._pids[row] = len(self._pids) + 1
            self.writer.put({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": row}})
            self.writer.put(
                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
            )
        return pid

    def _put(self, ph: str, row: str, name: str | None, t: float | None, **extra: Any) -> None:
        rec: dict[str, Any] = {"ph": ph}
        if name is not None:
            rec["name"] = name
        rec["ts"] = self._ts(t)
        rec["pid"] = self._pid(row)
        rec.update(extra)
        self.writer.put(rec)

    # ----------------------------------------------------------------- negotiation
    def negotiate_start(self, row: str, op_name: str, t: float | None = None) -> None:
        if row in self._state:
            return
        self._state[row] = "negotiating"
        self._put("B", row, f"NEGOTIATE_{op_name.upper()}", t)

    def negotiate_rank_ready(self, row: str, rank: int, t: float | None = None) -> None:
        if self._state.get(row) == "negotiating":
            self._put("X", row, str(rank), t, dur=0)

    def negotiate_end(self, row: str, t: float | None = None, **args: Any) -> None:
        if self._state.get(row) != "negotiating":
            return
        del self._state[row]
        if args:
            self._put("E", row, None, t, args=args)
        else:
            self._put("E", row, None, t)

    # ----------------------------------------------------------------- execution
    def op_start(self, row: str, op_name: str) -> None:
        if self._state.get(row) == "negotiating":  # e.g. started while it negotiated
            self.negotiate_end(row)
        self._state[row] = "op"
        self._put("B", row, op_name.upper(), None)

    def activity(self, rows: list[str], name: str | None) -> None:
        """End the rows' current activity (if any) and start ``name`` (unless None)."""
        for row in rows:
            state = self._state.get(row)
            if state is None:
                continue
            if state == "activity":
                self._put("E", row, None, None)
                self._state[row] = "op"
            if name is not None:
                self._put("B", row, name, None)
                self._state[row] = "activity"

    def op_end(self, row: str, dtype: str | None = None, shape: Any = None) -> None:
        state = self._state.pop(row, None)
        if state is None:
            return
        if state == "activity":
            self._put("E", row, None, None)
        if dtype is None:
            self._put("E", row, None, None)
        else:
            self._put("E", row, None, None, args={"dtype": dtype, "shape": str(list(shape))})

    # ----------------------------------------------------------------- job-wide rows
    def cycle(self) -> None:
        if self.mark_cycles:
            self.writer.put(
                {"ph": "i", "name": "CYCLE_START", "ts": self._ts(), "pid": 0, "s": "g"}
            )

    def counter(self, name: str, values: dict[str, float]) -> None:
        self.writer.put({"ph": "C", "name": name, "ts": self._ts(), "pid": 0, "args": values})

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()
