"""The names ops are negotiated under and where they were called from: ``<op>.<name>`` or
``<op>.noname.<k>`` (unnamed ops match across ranks by call order per process set), grouped
names, group ids, and the caller's ``file:line`` shown in errors and the hang doctor.

Must not touch: the engine, argument checks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from horovod.core import context as _context
from horovod.core.diagnose import is_user_file

# The horovod package: frames inside it are not a call site.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a code file is, for call sites (memoized): horovod itself (never a call site), a
# framework or the standard library (torch's autograd, TensorFlow's op wrappers: a call site
# only when no application frame is found above), or the application's own code.
_HOROVOD, _LIBRARY, _USER = 0, 1, 2
_KIND: dict[str, int] = {}
_SITES: dict[tuple[Any, int], str] = {}  # (code, line) -> "file.py:42 in fn" (memoized)


def _kind(filename: str) -> int:
    kind = _KIND.get(filename)
    if kind is None:
        if os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep):
            kind = _HOROVOD
        else:
            kind = _USER if is_user_file(filename) else _LIBRARY
        _KIND[filename] = kind
    return kind


def callsite() -> str:
    """``train.py:42 in step``: the innermost frame of the application that led to this
    collective. Frames of horovod, of frameworks (a gradient hook runs under torch's
    autograd, a TF op under TensorFlow's dispatch) and of the standard library are skipped;
    without any application frame, the innermost frame outside horovod."""
    f: Any = sys._getframe(1)
    fallback = None
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind == _USER:
            break
        if kind == _LIBRARY and fallback is None:
            fallback = f
        f = f.f_back
    if f is None:
        f = fallback
        if f is None:
            return ""
    key = (f.f_code, f.f_lineno)
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) > 4096:
            _SITES.clear()
        site = _SITES[key] = (
            f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"
        )
    return site


def op_names(
    ctx: _context.Context, prefix: str, name: str | None, ps_id: int, n: int | None, count: int = 1
) -> list[str]:
    """Core names: ``<op>.<name>``, or ``<op>.noname.<k>`` where k counts this rank's unnamed
    ops on that process set, so unnamed ops match across ranks by call order within the set."""
    if n is None and count != 1:
        raise ValueError(f"{prefix}: one tensor expected, got {count}; use the grouped_ form")
    if name:
        base = f"{prefix}.{name}"
    else:
        ctx.op_counters[f"noname.{ps_id}"] += 1
        base = f"{prefix}.noname.{ctx.op_counters[f'noname.{ps_id}']}"
    if n is None:
        return [base]
    return [f"{base}_{i + 1}of{n}" for i in range(n)]


def group_id(ctx: _context.Context, n: int | None) -> int:
    if n is None:
        return -1
    ctx.op_counters["group"] += 1
    return ctx.op_counters["group"]
