"""Benchmark suite: the same model, data and mesh trained by a plain PyTorch loop, Lightning's own strategies and
this package's strategies, measured in one run. Entry point: `python -m benchmarks.run --help`."""
