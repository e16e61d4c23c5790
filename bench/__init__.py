"""Benchmarks: rtserve side by side with the servers users would pick instead.

``python -m bench <suite>`` runs one (see :mod:`bench.__main__` and bench/README.md).
"""
