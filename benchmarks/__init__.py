"""Benchmark scripts: each runs as `python benchmarks/<name>.py` and may import its siblings (benchmarks.<name>)."""
