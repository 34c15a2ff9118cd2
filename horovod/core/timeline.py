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

Must not touch: the engine's state (it records what it is told); files other than the one asked
for.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from horovod.core.messages import Response

_STOP = object()


class TimelineWriter:
    """Appends records to the file from a background thread; the file stays valid JSON.
    Records arrive as preformatted JSON text (cheap to make on the engine thread), singly or in
    lists."""

    def __init__(self, path: str, start_wall_us: int, interval: float = 0.1) -> None:
        self.path = path
        self.interval = interval
        # Opened here, in the caller's thread, so a bad path fails loudly at once.
        self._f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed by the writer thread
        head = [
            _dump(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": 0,
                    "args": {"start_time_since_epoch_in_micros": start_wall_us},
                }
            ),
            _dump({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}),
        ]
        first = ("[\n" + ",\n".join(head)).encode()
        self._f.write(first + b"\n]\n")
        self._f.flush()
        self._end = len(first)  # offset of the closing "\n]\n"
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.records_written = 0
        self._thread = threading.Thread(target=self._run, name="horovod-timeline", daemon=True)
        self._thread.start()

    def put(self, record: str | list[str]) -> None:
        self._q.put(record)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then close the file (blocks until done)."""
        self._q.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            stop = False
            while not stop:
                items = [self._q.get()]
                if items[0] is not _STOP:
                    # Let records accumulate: one write per interval instead of a wake-up (and
                    # a GIL hand-off) per record, which costs training real time.
                    time.sleep(self.interval)
                while True:
                    try:
                        items.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                batch: list[str] = []
                for it in items:
                    if it is _STOP:
                        stop = True
                    elif isinstance(it, list):
                        batch.extend(it)
                    else:
                        batch.append(it)
                if batch:
                    body = (",\n" + ",\n".join(batch)).encode()
                    self._f.seek(self._end)
                    self._f.write(body + b"\n]\n")
                    self._f.flush()
                    self._end += len(body)
                    self.records_written += len(batch)
        finally:
            self._f.close()


def _dump(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"))


_ESC = json.encoder.encode_basestring  # type: ignore[attr-defined]


class Timeline:
    """The semantic events of upstream's timeline, turned into trace records. A step of a model
    with hundreds of small tensors makes thousands of records, so they are formatted with ``%``
    templates (names JSON-escaped once per tensor) and collected in a list that the engine hands
    to the writer once per batch of work (``flush``)."""

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
        self._pid_lock = threading.Lock()
        self._state: dict[str, str] = {}  # row -> "negotiating" | "op" | "activity"
        self._buf: list[str] = []
        # the response being executed: (op name, start ts, [(activity or None, ts), ...])
        self._op: tuple[str, int, list[tuple[str | None, int]]] | None = None
        self.closed = False

    # ----------------------------------------------------------------- plumbing
    def flush(self) -> None:
        """Hand the records made so far to the writer thread."""
        if self._buf:
            buf, self._buf = self._buf, []
            self.writer.put(buf)

    def _ts(self, t: float | None = None) -> int:
        return int(((self.clock() if t is None else t) - self.t0) * 1e6)

    def _pid(self, row: str) -> int:
        pid = self._pids.get(row)
        if pid is None:
            pid, meta = self._new_pid(row)
            self._buf.extend(meta)
        return pid

    def _new_pid(self, row: str) -> tuple[int, list[str]]:
        """(the row's pid, its metadata records if it is new). Rows are also made by ``span``
        from framework threads."""
        with self._pid_lock:
            pid = self._pids.get(row)
            if pid is not None:
                return pid, []
            pid = self._pids[row] = len(self._pids) + 1
        return pid, [
            '{"name":"process_name","ph":"M","pid":%d,"args":{"name":%s}}' % (pid, _ESC(row)),
            '{"name":"process_sort_index","ph":"M","pid":%d,"args":{"sort_index":%d}}' % (pid, pid),
        ]

    def span(self, row: str, name: str, t0: float, t1: float) -> None:
        """A finished span of work done outside the engine (a compressor's encoding, on a
        framework thread): ``t0``/``t1`` on this timeline's clock (``time.monotonic``). Its
        records go straight to the writer (the engine thread owns the batch being built)."""
        if self.closed:
            return
        pid, meta = self._new_pid(row)
        self.writer.put(
            meta
            + [
                '{"ph":"B","name":"%s","ts":%d,"pid":%d}' % (name, self._ts(t0), pid),
                '{"ph":"E","ts":%d,"pid":%d}' % (self._ts(t1), pid),
            ]
        )

    # ----------------------------------------------------------------- negotiation
    def negotiate_start(self, row: str, op_name: str, t: float | None = None) -> None:
        if row in self._state:
            return
        self._state[row] = "negotiating"
        self._buf.append(
            '{"ph":"B","name":"NEGOTIATE_%s","ts":%d,"pid":%d}'
            % (op_name.upper(), self._ts(t), self._pid(row))
        )

    def negotiate_rank_ready(self, row: str, rank: int, t: float | None = None) -> None:
        if self._state.get(row) == "negotiating":
            self._buf.append(
                '{"ph":"X","name":"%d","ts":%d,"pid":%d,"dur":0}'
                % (rank, self._ts(t), self._pid(row))
            )

    def negotiate_ready(self, row: str, op_name: str, rank: int, t: float) -> None:
        """``rank``'s request for ``row`` arrived at ``t`` (starts the span for the first)."""
        pid = self._pids.get(row) or self._pid(row)
        ts = int((t - self.t0) * 1e6)
        state = self._state.get(row)
        if state is None:
            self._state[row] = "negotiating"
            self._buf.append(
                '{"ph":"B","name":"NEGOTIATE_%s","ts":%d,"pid":%d}' % (op_name.upper(), ts, pid)
            )
        elif state != "negotiating":
            return
        self._buf.append('{"ph":"X","name":"%d","ts":%d,"pid":%d,"dur":0}' % (rank, ts, pid))

    def negotiate_end(
        self,
        row: str,
        t: float | None = None,
        last_rank: int | None = None,
        waited_ms: float | None = None,
    ) -> None:
        if self._state.get(row) != "negotiating":
            return
        del self._state[row]
        if last_rank is None:
            self._buf.append('{"ph":"E","ts":%d,"pid":%d}' % (self._ts(t), self._pid(row)))
        else:
            self._buf.append(
                '{"ph":"E","ts":%d,"pid":%d,"args":{"last_rank":%d,"waited_ms":%.3f}}'
                % (self._ts(t), self._pid(row), last_rank, waited_ms or 0.0)
            )

    # ----------------------------------------------------------------- execution
    # A response runs as a unit on the engine thread: its tensors share the op span and every
    # activity span, so the spans are collected once and written per tensor from one template.
    def op_start(self, row: str, op_name: str) -> None:
        self.ops_start([row], op_name)

    def ops_start(self, rows: list[str], op_name: str) -> None:
        ts = self._ts()
        for row in rows:
            if self._state.get(row) == "negotiating":  # e.g. the timeline started mid-way
                self.negotiate_end(row)
        self._op = (op_name.upper(), ts, [])

    def activity(self, rows: list[str], name: str | None) -> None:
        """End the current activity (if any) and start ``name`` (unless None)."""
        if self._op is not None:
            self._op[2].append((name, self._ts()))

    def op_end(self, row: str, dtype: str | None = None, shape: Any = None) -> None:
        self.ops_end([row], dtype, [shape])

    def ops_end(self, rows: list[str], dtype: str | None, shapes: Any) -> None:
        op, self._op = self._op, None
        if op is None:
            return
        name, ts0, acts = op
        end = self._ts()
        parts = ['{"ph":"B","name":"%s","ts":%d,"pid":%%(pid)d}' % (name, ts0)]
        for i, (act, ts) in enumerate(acts):
            if act is None:
                continue
            until = acts[i + 1][1] if i + 1 < len(acts) else end
            parts.append('{"ph":"B","name":"%s","ts":%d,"pid":%%(pid)d}' % (act, ts))
            parts.append('{"ph":"E","ts":%d,"pid":%%(pid)d}' % until)
        if dtype is None:
            parts.append('{"ph":"E","ts":%d,"pid":%%(pid)d}' % end)
        else:
            parts.append(
                '{"ph":"E","ts":%d,"pid":%%(pid)d,"args":{"dtype":"%s","shape":"%%(shape)s"}}'
                % (end, dtype)
            )
        template = ",\n".join(parts)
        pid = self._pid
        self._buf.extend(
            template % {"pid": pid(row), "shape": list(shape)}
            for row, shape in zip(rows, shapes, strict=False)
        )

    # ----------------------------------------------------------------- job-wide rows
    def cycle(self) -> None:
        if self.mark_cycles:
            self._buf.append('{"ph":"i","name":"CYCLE_START","ts":%d,"pid":0,"s":"g"}' % self._ts())

    def counter(self, name: str, values: dict[str, float]) -> None:
        self._buf.append(
            _dump({"ph": "C", "name": name, "ts": self._ts(), "pid": 0, "args": values})
        )

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.flush()
            self.writer.close()


def timeline_row(ps_id: int, name: str) -> str:
    """A tensor's row in the timeline (names are unique per process set)."""
    return name if ps_id == 0 else f"{name} [process set {ps_id}]"


def timeline_rows(resp: Response) -> list[str]:
    return [timeline_row(resp.ps_id, n) for n in resp.names]
