"""Upstream's ``horovod.tensorflow.util`` (also ``hvd.util``): the TensorFlow helpers that
TF code written for upstream calls.

Must not touch: the engine (these are TensorFlow-side helpers only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (False while a tf.function is traced)."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as a tf.function (a graph of its own)."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoize ``f`` by its arguments, per eager/graph mode (graph results belong to the
    graph they were made in)."""
    cache: dict[Any, Any] = {}

    @functools.wraps(f)
    def wrapper(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(vars: Any) -> Any:
    """Variables as hashable references (``var.ref()``), in the same structure."""
    if isinstance(vars, list):
        return [vars_to_refs(v) for v in vars]
    if isinstance(vars, tuple):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of ``vars_to_refs``."""
    if isinstance(refs, list):
        return [refs_to_vars(r) for r in refs]
    if isinstance(refs, tuple):
        return tuple(refs_to_vars(r) for r in refs)
    return refs.deref()
