"""Benchmarks kept in the package so that `python -m horovod.benchmarks.<name>` runs them."""
