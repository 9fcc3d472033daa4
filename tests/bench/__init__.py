"""Benchmarks against DeepSpeed's own tools (``python -m tests.bench.run_bench --cache DIR``).

Not part of the test suite: no module here is named ``test_*.py``, so pytest collects nothing.
Results and method: docs/benchmarks.md.
"""
