"""Upstream's ``horovod.runner.common`` package path, for the helper modules user code imports.

Must not touch: the launcher itself (these are thin public helpers).
"""
