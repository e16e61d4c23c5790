"""Benchmark suite: rtserve side by side with the servers users would pick instead.

Run ``python -m bench.run`` (full) or ``python -m bench.run --quick`` from the repository root.
"""
