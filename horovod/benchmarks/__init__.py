"""Benchmarks kept in the package so that `python -m horovod.benchmarks.<name>` runs them.

Must not touch: the runtime: benchmarks only use the public APIs, and nothing in the runtime
imports them.
"""
