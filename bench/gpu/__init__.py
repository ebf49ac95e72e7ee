"""Checks prepared for a lent GPU: each runs as one device command (docs/benchmarks.md)."""
