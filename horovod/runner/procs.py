"""Worker processes of a job: start, forward output with rank prefixes, stop them all on the
first failure, and report the root cause.

Each worker runs in its own session (process group) so that ``horovodrun`` can stop it and
everything it started; on Linux the kernel also sends it SIGTERM if ``horovodrun`` itself dies
(``PR_SET_PDEATHSIG``), so no worker outlives its launcher.

Must not touch: the training runtime; processes it did not start.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

TAIL_LINES = 20


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


SAME_MOMENT_S = 1.0  # exits noticed this close together may have happened in either order


@dataclass
class Command:
    """One worker to start: ``argv`` with ``env``; ``stdin`` (remote workers: the supervisor's
    payload) is written to the process's standard input, which then stays open: closing it is
    how the job stops a remote worker."""

    rank: int
    host: str
    argv: list[str]
    env: dict[str, str]
    stdin: bytes | None = None


@dataclass
class Worker:
    rank: int
    host: str
    proc: subprocess.Popen
    remote: bool = False
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    exit_code: int | None = None
    exit_time: float = 0.0
    stopped_by_us: bool = False
    stop_time: float = 0.0
    threads: list[threading.Thread] = field(default_factory=list)


class OutputSink:
    """Serialises prefixed output from all workers onto our stdout/stderr (and files)."""

    def __init__(self, timestamp: bool, output_dir: str | None) -> None:
        self.timestamp = timestamp
        self.output_dir = output_dir
        self.lock = threading.Lock()
        self.files: dict[tuple[int, str], BinaryIO] = {}

    def file_for(self, rank: int, stream: str, size: int) -> BinaryIO | None:
        if not self.output_dir:
            return None
        key = (rank, stream)
        if key not in self.files:
            d = os.path.join(self.output_dir, f"rank.{rank:0{len(str(size - 1))}d}")
            os.makedirs(d, exist_ok=True)
            self.files[key] = open(os.path.join(d, stream), "wb")  # noqa: SIM115
        return self.files[key]

    def write(self, rank: int, stream: str, piece: bytes, size: int) -> None:
        prefix = f"[{rank}]<{stream}>:".encode()
        if self.timestamp:
            prefix = time.asctime().encode() + prefix
        out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
        with self.lock:
            out.write(prefix + piece)
            out.flush()
            f = self.file_for(rank, stream, size)
            if f is not None:
                f.write(piece)
                f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def chunks(pipe: BinaryIO) -> Iterator[bytes]:
    """What arrives on ``pipe`` as it arrives, until its end (or an error reading it)."""
    fd = pipe.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        yield chunk


def _forward(w: Worker, pipe: BinaryIO, stream: str, sink: OutputSink, size: int) -> None:
    """Forward ``pipe`` line by line; a line ends at ``\\n`` or ``\\r`` (progress bars)."""
    pending = b""
    for chunk in chunks(pipe):
        pending += chunk
        start = 0
        i = 0
        n = len(pending)
        while i < n:
            c = pending[i]
            if c == 10 or c == 13:  # \n or \r
                if c == 13 and i + 1 < n and pending[i + 1] == 10:
                    i += 1  # \r\n is one line end
                piece = pending[start : i + 1]
                sink.write(w.rank, stream, piece, size)
                text = piece.rstrip(b"\r\n").decode("utf-8", "replace")
                if text:
                    w.tail.append(f"[{w.rank}]<{stream}>:{text}")
                start = i + 1
            i += 1
        pending = pending[start:]
    if pending:
        sink.write(w.rank, stream, pending + b"\n", size)
        w.tail.append(f"[{w.rank}]<{stream}>:{pending.decode('utf-8', 'replace')}")
    pipe.close()


def exit_description(code: int, remote: bool = False) -> str:
    if remote and code == 255:
        return "lost its ssh connection, or ssh could not reach the host (ssh exit code 255)"
    if remote and code == 127:
        return (
            "could not start on the host (exit code 127: the command or pyhorovod's Python "
            "interpreter is not at the same path there)"
        )
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"was killed by signal {signal.Signals(code - 128).name} (exit code {code})"
    return f"exited with code {code}"


class Job:
    """Runs the workers of one job on this host."""

    def __init__(
        self,
        commands: Sequence[Command],
        *,
        timestamp: bool = False,
        output_dir: str | None = None,
        grace_seconds: float = 5.0,
        failure_note: Callable[[int], tuple[str, str] | None] | None = None,
        diagnosis: Callable[[], tuple[int, str] | None] | None = None,
    ) -> None:
        self.commands = commands
        self.failure_note = failure_note or (lambda rank: None)
        self.diagnosis = diagnosis or (lambda: None)
        self.sink = OutputSink(timestamp, output_dir)
        self.grace = grace_seconds
        self.workers: list[Worker] = []
        self.exits: queue.SimpleQueue[Worker] = queue.SimpleQueue()
        self.first_failure: Worker | None = None
        self.interrupted: str | None = None

    def start(self) -> None:
        for c in self.commands:
            try:
                w = spawn(c, self.sink, len(self.commands), self.exits)
            except RuntimeError:
                self.stop_all()
                raise
            self.workers.append(w)

    def wait(self) -> int:
        """Block until every worker has exited; returns horovodrun's exit status."""
        left = len(self.workers)
        while left:
            try:
                w = self.exits.get(timeout=0.2)
            except queue.Empty:
                continue
            left -= 1
            for t in w.threads:
                t.join(2)
            if w.exit_code and self.first_failure is None and self.interrupted is None:
                self.first_failure = w
                self.stop_all(except_rank=w.rank)
        self._reap_groups()
        self.sink.close()
        if self.interrupted is not None:
            return 130 if self.interrupted == "SIGINT" else 143
        root = self.root_cause()
        if root is not None:
            code = root.exit_code or 1
            return code if 0 < code < 256 and not root.stopped_by_us else 1
        return 0

    def root_cause(self) -> Worker | None:
        """The first rank that failed on its own account. Workers record why they die (an
        uncaught exception of their own vs. a Horovod error caused by another rank). When the
        first to fail only reports another rank's loss, the cause is a rank that died without a
        word (a signal, a lost host), even if its exit reached us later (ssh's round trip).
        Exit order alone decides only when no such record exists."""
        if self.first_failure is None:
            return None
        notes = {w.rank: self.failure_note(w.rank) for w in self.workers}
        own = [w for w in self.workers if (notes[w.rank] or ("",))[0] == "root"]
        if own:
            return min(own, key=lambda w: w.exit_time)
        first = self.first_failure
        silent = [
            w
            for w in self.workers
            if w.exit_code and notes[w.rank] is None and not self._ended_by_our_stop(w)
        ]
        if (notes[first.rank] or ("",))[0] == "consequence":
            if silent:
                return min(silent, key=lambda w: w.exit_time)
        elif notes[first.rank] is None:
            # No record says why the first one ended, and exit order is only as good as
            # the moment each rank's wait thread got the CPU. A rank killed by a signal (not
            # ours, nor one we were stopping) within a moment of it died without a word, and the ranks that ended with
            # an exit code just then most likely lost it: it is the cause.
            killed = [
                w
                for w in silent
                if (w.exit_code or 0) > 128
                and not w.stopped_by_us
                and w.exit_time - first.exit_time < SAME_MOMENT_S
            ]
            if killed:
                return min(killed, key=lambda w: w.exit_time)
        return first

    def _ended_by_our_stop(self, w: Worker) -> bool:
        if not w.stopped_by_us:
            return False
        if w.exit_code == 128 + signal.SIGTERM:
            return True
        late = w.exit_time >= w.stop_time + self.grace - 0.5
        return w.exit_code == 128 + signal.SIGKILL and late

    def stop_all(self, except_rank: int | None = None) -> None:
        """SIGTERM every running worker's process group; SIGKILL what is left after the grace
        period (in a background thread, so forwarding continues meanwhile)."""
        stop_workers([w for w in self.workers if w.rank != except_rank], self.grace)

    def interrupt(self, signame: str) -> None:
        if self.interrupted is None:
            self.interrupted = signame
            self.stop_all()

    def _reap_groups(self) -> None:
        """Nothing a worker started may outlive the job."""
        for w in self.workers:
            _signal_group(w.proc.pid, signal.SIGKILL)

    def report(self) -> str:
        """The failure report: other ranks first, the root cause last."""
        if self.interrupted is not None:
            return (
                f"horovodrun: received {self.interrupted}; stopped all {len(self.workers)} workers."
            )
        f = self.root_cause()
        if f is None:
            return ""
        diagnosis = self.diagnosis()
        lines = ["", "horovodrun: the job failed."]
        for w in sorted(self.workers, key=lambda w: w.rank):
            if w is f:
                continue
            note = self.failure_note(w.rank)
            if w.stopped_by_us and not (w.exit_code and note):
                because = "the job was stopped" if diagnosis else f"rank {f.rank} failed"
                lines.append(f"  rank {w.rank} ({w.host}): stopped by horovodrun because {because}")
            elif w.exit_code:
                why = f" ({note[1]})" if note and note[0] == "root" else ""
                lines.append(
                    f"  rank {w.rank} ({w.host}): {exit_description(w.exit_code, w.remote)}{why} "
                    f"after rank {f.rank} failed"
                )
            else:
                lines.append(f"  rank {w.rank} ({w.host}): finished (exit code 0)")
        first = self.first_failure.rank if self.first_failure is not None else f.rank
        note = self.failure_note(f.rank)
        when = time.strftime("%H:%M:%S", time.localtime(f.exit_time))
        if diagnosis:  # the runtime found the cause itself (the hang doctor's report)
            by, text = diagnosis
            lines.append(f"Root cause, as diagnosed by rank {by} at {when}:")
            lines.extend(f"  {t}" for t in text.splitlines())
            return "\n".join(lines)
        if note and note[0] == "root":
            how = exit_description(f.exit_code or 1, f.remote)
            if f.stopped_by_us:
                how = "was stopped by horovodrun while shutting down"
            lines.append(
                f"Root cause: rank {f.rank} on host {f.host} failed with {note[1]} "
                f"(it {how}, {when})."
            )
        else:
            lines.append(
                f"Root cause: rank {f.rank} on host {f.host} "
                f"{exit_description(f.exit_code or 1, f.remote)} at {when}, "
                + (
                    "first of all ranks."
                    if f is self.first_failure
                    else f"without a word; rank {first} failed only because it lost this rank."
                )
            )
        if f.tail:
            lines.append(f"Last lines of rank {f.rank}'s output:")
            lines.extend(f"  {t}" for t in f.tail)
        else:
            lines.append(f"Rank {f.rank} printed nothing.")
        return "\n".join(lines)


def spawn(c: Command, sink: OutputSink, size: int, exits: queue.SimpleQueue) -> Worker:
    """Start one worker: its output is forwarded through ``sink`` with its rank as prefix
    (``Worker.rank`` may change while it runs) and it is put on ``exits`` when it ends."""
    try:
        proc = subprocess.Popen(
            c.argv,
            env=c.env,
            stdin=subprocess.DEVNULL if c.stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
        )
    except OSError as e:
        raise RuntimeError(
            f"horovodrun: cannot start rank {c.rank}: {c.argv[0]}: {e.strerror or e}"
        ) from None
    w = Worker(c.rank, c.host, proc, remote=c.stdin is not None)
    if c.stdin is not None and proc.stdin is not None:
        try:
            proc.stdin.write(c.stdin)
            proc.stdin.flush()
        except OSError:
            pass  # ssh already failed: its exit status and output say why
    for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        t = threading.Thread(
            target=_forward,
            args=(w, pipe, stream, sink, size),
            daemon=True,
            name=f"fwd-{c.rank}-{stream}",
        )
        t.start()
        w.threads.append(t)

    def wait() -> None:
        code = proc.wait()
        w.exit_time = time.time()
        w.exit_code = 128 - code if code < 0 else code
        exits.put(w)

    threading.Thread(target=wait, daemon=True, name=f"wait-{c.rank}").start()
    return w


def stop_workers(workers: Sequence[Worker], grace: float, sig: int = signal.SIGTERM) -> None:
    """Stop the running ones of ``workers``: ``sig`` to each one's process group (a remote one:
    end of its input, on which its supervisor stops it), SIGKILL what is left after ``grace``
    seconds (in a background thread, so forwarding continues meanwhile)."""
    targets = [w for w in workers if w.proc.poll() is None]
    for w in targets:
        w.stopped_by_us = True
        w.stop_time = time.time()
        if w.remote and w.proc.stdin is not None and sig != signal.SIGKILL:
            # End of input tells the remote supervisor to stop the worker (SIGTERM, then
            # SIGKILL); ssh keeps forwarding its last output meanwhile.
            try:
                w.proc.stdin.close()
            except OSError:
                _signal_group(w.proc.pid, sig)
        else:
            _signal_group(w.proc.pid, sig)
    if not targets:
        return

    def _kill_later() -> None:
        # A remote supervisor applies the grace period itself; its ssh gets a little longer
        # to bring the worker's last words home.
        start = time.monotonic()
        deadline = {id(w): start + grace + (3.0 if w.remote else 0.0) for w in targets}
        while any(w.proc.poll() is None for w in targets):
            now = time.monotonic()
            for w in targets:
                if now >= deadline[id(w)] and w.proc.poll() is None:
                    _signal_group(w.proc.pid, signal.SIGKILL)
            time.sleep(0.05)

    threading.Thread(target=_kill_later, daemon=True, name="killer").start()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
