"""Prometheus metrics and per-stage timings."""
