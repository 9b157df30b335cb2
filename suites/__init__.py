"""Shipped suites (YAML data only): ``smoke`` (CI), ``nightly`` (the main job), ``full``."""
