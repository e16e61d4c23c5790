"""The optimization showcase: ``python -m bench.showcase`` regenerates docs/optimization.md."""
