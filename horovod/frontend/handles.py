"""Handles of asynchronous ops: ``poll`` and ``synchronize`` by handle id.

Must not touch: submission (a handle exists once its op was submitted).
"""

from __future__ import annotations

from typing import Any

from horovod.frontend.arguments import require_context


def poll(handle: int) -> bool:
    """True once the op behind ``handle`` has completed (never blocks)."""
    ctx = require_context()
    h = ctx.handles.get(handle)
    if h is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return h.done()


def synchronize(handle: int) -> Any:
    """Wait for the op behind ``handle`` and return its output; raises HorovodInternalError if
    the op failed. Each handle can be synchronized once."""
    ctx = require_context()
    h = ctx.handles.pop(handle, None)
    if h is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    results = h.wait()
    return h.finish(results) if h.finish is not None else results[0]
