"""Benchmarks of tierstore, run as modules: ``python -m benchmarks.<name>``."""
