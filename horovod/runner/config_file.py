"""``horovodrun --config-file FILE``: upstream's YAML keys mapped onto the command-line flags.
Values in the file override flags given before ``--config-file`` and are overridden by flags
given after it.

Must not touch: the training runtime; flags other than those the file names.
"""

from __future__ import annotations

import argparse
from typing import Any

# section -> {key: (argparse dest, kind)}; kind "bool", "int", "float", "str"
KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", "int"),
        "cycle_time_ms": ("cycle_time_ms", "float"),
        "cache_capacity": ("cache_capacity", "int"),
        "hierarchical_allreduce": ("hierarchical_allreduce", "bool"),
        "hierarchical_allgather": ("hierarchical_allgather", "bool"),
        "torus_allreduce": ("torus_allreduce", "bool"),
    },
    "autotune": {
        "enabled": ("autotune", "bool"),
        "log_file": ("autotune_log_file", "str"),
        "warmup_samples": ("autotune_warmup_samples", "int"),
        "steps_per_sample": ("autotune_steps_per_sample", "int"),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", "int"),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", "float"),
    },
    "timeline": {
        "filename": ("timeline_filename", "str"),
        "mark_cycles": ("timeline_mark_cycles", "bool"),
    },
    "stall_check": {
        "enabled": ("stall_check", "bool"),
        "warning_time_seconds": ("stall_check_warning_time_seconds", "float"),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", "float"),
    },
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", "bool"),
        "num_nccl_streams": ("num_nccl_streams", "int"),
        "thread_affinity": ("thread_affinity", "int"),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", "float"),
    },
    "logging": {
        "level": ("log_level", "level"),
        "with_timestamp": ("log_hide_time", "not"),
    },
}


def _value(path: str, raw: Any, kind: str) -> Any:
    if kind in ("bool", "not"):
        if not isinstance(raw, bool):
            raise ValueError(f"{path}: expected true or false, got {raw!r}")
        return (not raw) if kind == "not" else raw
    if kind in ("int", "float"):
        ok = isinstance(raw, int) if kind == "int" else isinstance(raw, int | float)
        if isinstance(raw, bool) or not ok:
            raise ValueError(
                f"{path}: expected a{'n integer' if kind == 'int' else ' number'}, got {raw!r}"
            )
        if raw < 0:
            raise ValueError(f"{path}: must be >= 0, got {raw!r}")
        return raw
    if kind == "level":
        from horovod.common.config import LOG_LEVELS

        if not isinstance(raw, str) or raw.upper() not in LOG_LEVELS:
            raise ValueError(f"{path}: expected one of {', '.join(LOG_LEVELS)}, got {raw!r}")
        return raw.upper()
    if not isinstance(raw, str):
        raise ValueError(f"{path}: expected a string, got {raw!r}")
    return raw


def settings(text: str, source: str = "config file") -> dict[str, Any]:
    """The YAML text -> ``{argparse dest: value}``; ValueError names the offending key."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{source} is not valid YAML: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: expected a mapping of sections at the top level")
    out: dict[str, Any] = {}
    for section, body in doc.items():
        if section == "controller":
            if body not in ("gloo", "mpi"):
                raise ValueError(f"{source}: controller must be gloo or mpi, got {body!r}")
            out["gloo"], out["mpi"] = body == "gloo", body == "mpi"
            continue
        if section not in KEYS:
            raise ValueError(
                f"{source}: unknown section {section!r} (known: controller, {', '.join(KEYS)})"
            )
        if not isinstance(body, dict):
            raise ValueError(f"{source}: section {section!r} must be a mapping")
        for key, raw in body.items():
            if key not in KEYS[section]:
                raise ValueError(
                    f"{source}: unknown key {section}.{key} (known: {', '.join(KEYS[section])})"
                )
            dest, kind = KEYS[section][key]
            out[dest] = _value(f"{source}: {section}.{key}", raw, kind)
    return out


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; with ``--config-file F``, flags before it < the file < flags after it."""
    first = parser.parse_args(argv)
    path = getattr(first, "config_file", None)
    if not path:
        return first
    at = next(
        (i for i, a in enumerate(argv) if a == "--config-file" or a.startswith("--config-file=")),
        None,
    )
    if at is None:  # given in an abbreviated form: treat it as first
        at, width = 0, 0
    else:
        width = 1 if "=" in argv[at] else 2
    try:
        with open(path, encoding="utf-8") as f:
            values = settings(f.read(), path)
    except OSError as e:
        parser.error(f"cannot read --config-file {path}: {e.strerror}")
    except ValueError as e:
        parser.error(str(e))
    ns = parser.parse_args(argv[:at]) if at else argparse.Namespace()
    for dest, v in values.items():
        setattr(ns, dest, v)
    # argparse fills defaults only for names not already in the namespace: later flags win.
    return parser.parse_args(argv[at + width :], namespace=ns)
