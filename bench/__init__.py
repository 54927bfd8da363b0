"""Benchmark and test drivers (not part of the installed library)."""
