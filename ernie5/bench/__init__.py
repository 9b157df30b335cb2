"""Benchmarks behind ``ernie5 bench``: each returns a JSON-able dict of medians and ratios
measured in one process, at the nano shape of ``shared/reference/perf-anchors.md`` by default."""
