"""Upstream's ``horovod.runner.util`` package path (``threads``).

Must not touch: the launcher itself (these are thin public helpers).
"""
