"""Ordering between the streams that produce, move and consume device tensors.

The device plane never synchronises a whole device. A tensor handed to a collective carries a
*ready* event recorded on the stream that produced it (the caller's current stream); the plane
makes its own stream wait for that event before it reads the tensor, runs the collective and
its copies on its stream, and records a *done* event that the consumer's stream waits for when
the handle is synchronised. The host waits on an event only where host code reads device
results (the staged path's CPU reduction).

``CudaStreams`` does this with CUDA streams and events. ``HostStreams`` is the stand-in for
tests without a GPU (``HOROVOD_DEVICE_PLANE_TEST``): its events are recorded and waited for
in program order, and it refuses what would be a race on a GPU (waiting for an event that was
never recorded, consuming a result before the plane recorded its done event), keeping the
order it saw in ``log`` for the tests to check.

Must not touch: collectives, the engine, process groups.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch


class HostEvent:
    """A stand-in event: ``recorded`` once the stream that owns it reached it."""

    __slots__ = ("id", "stream", "recorded")

    _ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(HostEvent._ids)
        self.stream = ""
        self.recorded = False

    def record(self, stream: str) -> None:
        self.stream = stream
        self.recorded = True

    def synchronize(self) -> None:
        if not self.recorded:
            raise RuntimeError(f"host waits for event {self.id}, which no stream recorded")


def ready_event(tensor: torch.Tensor) -> Any:
    """An event on the caller's current stream, marking that ``tensor`` is written (taken at
    submission: later work on that stream does not delay the collective)."""
    if tensor.device.type == "cuda":
        cuda_event = torch.cuda.Event()
        cuda_event.record(torch.cuda.current_stream(tensor.device))
        return cuda_event
    host_event = HostEvent()
    host_event.record("caller")
    return host_event


def consume(tensor: torch.Tensor, done: Any) -> None:
    """The caller's current stream waits for the plane's ``done`` event before it uses
    ``tensor`` (a collective's result), and the caching allocator keeps the tensor's memory
    for that stream's work."""
    if done is None:
        return
    if isinstance(done, HostEvent):
        if not done.recorded:
            raise RuntimeError(
                "the device plane's result was used before the plane recorded its done event"
            )
        return
    stream = torch.cuda.current_stream(tensor.device)
    stream.wait_event(done)
    tensor.record_stream(stream)


class CudaStreams:
    """The plane's own CUDA stream on ``device`` and the events around it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def plane(self) -> Iterator[None]:
        """Run on the plane's stream (and device) inside the block."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def wait_ready(self, tensor: torch.Tensor, ready: Any) -> None:
        """The plane's stream waits for ``ready``; the allocator keeps ``tensor``'s memory
        until the plane's work on it is done, even if the caller frees it at once."""
        if ready is not None:
            self.stream.wait_event(ready)
        tensor.record_stream(self.stream)

    def keep(self, tensor: torch.Tensor) -> None:
        """The allocator keeps ``tensor``'s memory until the plane's work on it is done (an
        output the caller might drop before synchronising)."""
        tensor.record_stream(self.stream)

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostStreams:
    """The stand-in for ``CudaStreams`` on CPU tensors (see the module docstring)."""

    def __init__(self, device: torch.device, log_length: int = 256) -> None:
        self.device = device
        self.log: collections.deque[tuple[str, int]] = collections.deque(maxlen=log_length)

    @contextlib.contextmanager
    def plane(self) -> Iterator[None]:
        yield

    def wait_ready(self, tensor: torch.Tensor, ready: Any) -> None:
        if ready is None:
            return
        if not ready.recorded:
            raise RuntimeError(
                f"the device plane would read a tensor whose ready event {ready.id} was never "
                "recorded"
            )
        self.log.append(("wait", ready.id))

    def keep(self, tensor: torch.Tensor) -> None:
        pass  # one stream of work on the host: nothing can be reused early

    def record(self) -> HostEvent:
        ev = HostEvent()
        ev.record("plane")
        self.log.append(("record", ev.id))
        return ev

    def host_wait(self, event: HostEvent) -> None:
        event.synchronize()
        self.log.append(("host_wait", event.id))

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)
