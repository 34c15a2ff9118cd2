"""Each rank's output of a job that ``mpirun`` started (``horovodrun --mpi``), line by line.

Open MPI tags every line with its rank itself (``--tag-output``: ``[1,<rank>]<stdout>:``, as
upstream's horovodrun shows it). Hydra (MPICH, Intel MPI) labels each *piece* of output it
forwards, not each line (its ``-l``), so ranks that print at once (they run unbuffered: a
``print`` is a write per word) had their words interleaved within lines. Under Hydra,
horovodrun asks for labels that no program prints (``HYDRA_LABEL``), puts each rank's lines
back together (``HydraOutput``) and prefixes them as its own launcher does
(``[<rank>]<stdout>:``). As on horovodrun's own launcher, whichever the MPI:
``--prefix-output-with-timestamp`` puts the time before each rank's line, and with
``--output-filename DIR`` each rank's lines also go to ``DIR/rank.<N>/stdout`` and ``stderr``
(Open MPI 5's own ``--output-filename`` names its files otherwise; Hydra's file patterns need
their directories made first).

Must not touch: the ranks' output beyond the labels and tags it reads.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from horovod.runner.procs import OutputSink, chunks

# Hydra's label of a piece of a rank's output (``-prepend-pattern``; %r: the rank): control
# characters no program prints, so that horovodrun can tell the ranks' pieces apart.
HYDRA_LABEL = "\x1e%r\x1f"
_LABEL = re.compile(rb"\x1e(\d+)\x1f")
# Open MPI's tag of a line (``--tag-output``): [job,rank]<stream>: and the line.
_TAG = re.compile(rb"\[\d+,(\d+)\]<(?:stdout|stderr)>: ?")


class HydraOutput:
    """One of Hydra's output streams (``stream``: "stdout" or "stderr") labelled with
    ``HYDRA_LABEL``, put back together rank by rank: each rank's complete lines go to ``sink``
    (``[rank]<stdout>:``), a partial one waits for its rest; a line that starts without a
    label is Hydra's own (its report of a failed rank) and passes as it is."""

    def __init__(self, stream: str, sink: OutputSink, own: BinaryIO, size: int = 1) -> None:
        self.stream, self.sink, self.own, self.size = stream, sink, own, size
        self.partial: dict[int, bytes] = {}  # each rank's line so far
        self.rank: int | None = None  # whose text this is (None: Hydra's own line)
        self.held = b""  # the start of a label the last read cut off

    def feed(self, data: bytes) -> None:
        data = self.held + data
        self.held = b""
        cut = data.rfind(b"\x1e")
        if cut >= 0 and _LABEL.match(data, cut) is None and len(data) - cut < 16:
            data, self.held = data[:cut], data[cut:]
        at = 0
        for m in _LABEL.finditer(data):
            self._text(data[at : m.start()])
            self.rank = int(m.group(1))
            at = m.end()
        self._text(data[at:])

    def _text(self, text: bytes) -> None:
        while text:
            ends = [i for i in (text.find(b"\n"), text.find(b"\r")) if i >= 0]
            end = min(ends) + 1 if ends else len(text)
            piece, text = text[:end], text[end:]
            if self.rank is None:
                with self.sink.lock:
                    self.own.write(piece)
                    self.own.flush()
            else:
                line = self.partial.pop(self.rank, b"") + piece
                if ends:
                    self.sink.write(self.rank, self.stream, line, self.size)
                else:
                    self.partial[self.rank] = line
            if ends:
                self.rank = None  # (a label marks every line of a rank's)

    def close(self) -> None:
        self.feed(b"")
        rest, self.held = self.held, b""
        self._text(rest)
        for rank, line in sorted(self.partial.items()):
            self.sink.write(rank, self.stream, line + b"\n", self.size)
        self.partial.clear()


class TaggedOutput:
    """One of Open MPI's output streams (``--tag-output``), passed on as it is (after the time,
    with ``sink.timestamp``), each tagged line's text also written to its rank's file in
    ``sink``'s directory."""

    def __init__(self, stream: str, sink: OutputSink, own: BinaryIO, size: int = 1) -> None:
        self.stream, self.sink, self.own, self.size = stream, sink, own, size
        self.rest = b""  # a line still without its end

    def feed(self, data: bytes) -> None:
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            self._line(line + b"\n")

    def _line(self, line: bytes) -> None:
        tag = _TAG.match(line)
        sink = self.sink
        with sink.lock:
            if tag is not None and sink.timestamp:
                self.own.write(time.asctime().encode())
            self.own.write(line)
            self.own.flush()
            f = sink.file_for(int(tag.group(1)), self.stream, self.size) if tag else None
            if f is not None and tag is not None:
                f.write(line[tag.end() :])
                f.flush()

    def close(self) -> None:
        if self.rest:
            self._line(self.rest + b"\n")
            self.rest = b""


def _pump(pipe: BinaryIO, out: HydraOutput | TaggedOutput) -> None:
    for chunk in chunks(pipe):
        out.feed(chunk)
    out.close()
    pipe.close()


def forward(
    proc: subprocess.Popen, labelled: bool, output_dir: str | None, size: int, timestamp: bool
) -> list[threading.Thread]:
    """Start forwarding ``proc``'s piped stdout and stderr (Hydra's, ``labelled``; else Open
    MPI's tagged lines) to ours (each rank's lines after the time, with ``timestamp``), and
    each rank's lines to ``output_dir``; the threads end with the streams (join them after the
    process)."""
    sink = OutputSink(timestamp=timestamp, output_dir=output_dir)
    reader = HydraOutput if labelled else TaggedOutput
    threads = []
    for stream, src, own in (
        ("stdout", proc.stdout, sys.stdout.buffer),
        ("stderr", proc.stderr, sys.stderr.buffer),
    ):
        assert src is not None
        t = threading.Thread(target=_pump, args=(src, reader(stream, sink, own, size)), daemon=True)
        t.start()
        threads.append(t)
    return threads
