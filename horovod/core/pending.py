"""What the coordinator knows of one name in negotiation (``Pending``) and of a response it
decided on (``Built``). Shared by the coordinator, its validation and its stall inspector.

Must not touch: anything: plain records.
"""

from __future__ import annotations

from typing import Any

from horovod.core.messages import Request, Response

# A response the coordinator decided on: the response, its cache id (all ranks hit it), and for
# an eager allreduce every member's data (global rank -> bytes), else None.
Built = tuple[Response, int | None, dict[int, Any] | None]


class Pending:
    __slots__ = ("reqs", "cids", "times", "t0", "ready", "warned", "data")

    def __init__(self, t0: float) -> None:
        self.reqs: dict[int, Request] = {}
        self.cids: dict[int, int | None] = {}
        self.data: dict[int, Any] | None = None  # eager allreduce: each rank's bytes
        self.times: dict[int, float] = {}  # when each rank's request reached the coordinator
        self.t0 = t0
        self.ready = False
        self.warned = False
