"""Upstream's ``horovod.runner.common.util``: ``env`` and ``secret``.

Must not touch: the launcher itself (these are thin public helpers).
"""
